"""Every ``--json`` output is strict JSON: a figure not measured (NaN, inf) is null."""

from __future__ import annotations

import json
import math

import pytest

from kvbridge.jsonio import dumps, finite


def strict(text: str) -> object:
    """Parse as a strict reader does: ``NaN``/``Infinity`` are refused."""

    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_figures_become_null() -> None:
    rows = [{"case": "a", "ms": math.nan, "n": 3, "x": [1.5, math.inf, -math.inf]}]
    assert strict(dumps(rows)) == [{"case": "a", "ms": None, "n": 3, "x": [1.5, None, None]}]
    assert strict(dumps({"t": (math.nan, 2.0)}, indent=None)) == {"t": [None, 2.0]}
    assert finite(2.5) == 2.5 and finite("nan") == "nan"


def test_what_cannot_be_made_finite_is_refused() -> None:
    with pytest.raises(TypeError):
        dumps({"s": {1.0}})  # a set: the writer does not guess


def test_vllm_bench_row_without_loads_writes_null() -> None:
    pytest.importorskip("vllm")
    from benchmarks.vllm_bench import summary_row

    timed = [{"ttft_s": 0.2, "d_s": 0.1, "loads": 0.0}]
    row = summary_row("case", "kvbridge", "ok", timed)
    assert math.isnan(row["transfer_ms"])  # no request loaded: no transfer figure
    assert strict(dumps([row]))[0]["transfer_ms"] is None  # type: ignore[index]
