"""The trace benchmark on two tiny cases over real NIXL: every transfer's bytes are
checked and none differs; kvbridge never posts more descriptors than the vLLM-like path
for the same request and layout."""

from __future__ import annotations

import pytest

from benchmarks.trace_bench import run_all
from benchmarks.trace_case import Case
from benchmarks.trace_report import table

pytestmark = pytest.mark.integration


def _tiny(model: str, p_tp: int, d_tp: int, layout: str, pool_mib: int) -> Case:
    return Case(model, p_tp, d_tp, layout, layout, requests=2, pool_bytes=pool_mib << 20,
                live=4, budget_s=2.0, min_requests=2)  # fmt: skip


def test_tiny_cases_verify_bytes_and_need_no_more_descriptors_than_vllm() -> None:
    lines: list[str] = []
    rows = run_all(
        todo=[_tiny("llama-3.1-8b", 1, 2, "hnd", 64), _tiny("jamba-1.5-mini", 1, 2, "hnd", 160)],
        progress=lines.append,
    )
    assert len(lines) == 2 and len(rows) == 4
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["verified_transfers"] > 0 and row["verified_bytes"] > 0
        assert row["mismatches"] == 0
        assert row["requests"] == 2 and row["e2e_ms_median"] > 0 and row["ratio"] > 0
        assert row["vllm_ms_median"] is not None, row.get("vllm_note")
        assert row["vllm_ratio"] > 0  # the floor of ×vLLM: vLLM-like's own contiguous ratio
    text = table(rows)
    assert text.count(" / ") >= 4 and "×vLLM / floor" in text, text
    direct = [r for r in rows if r["strategy"] == "direct"]
    for row in direct:
        # kvbridge joins runs across blocks; the vLLM-like path posts one per (layer, block)
        assert row["descriptors_vs_vllm_max"] <= 1.0
        assert set(row["posting_ms"]) == {
            "initialize_xfer",
            "prep+make_prepped",
            "strided+make_prepped",
        }
