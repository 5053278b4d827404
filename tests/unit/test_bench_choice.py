"""gpu-check's cases, planned for real, priced by the per-request choice under the three
pairs of ``benchmarks/bench_choice.py``: GPU memory without RDMA never reads, host
memory pulls as the bandwidth probe did, and the benchmark itself runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.bench_choice import CASES, PAIRS, Staging, plan_runs
from kvbridge.connector.load import Mode
from kvbridge.connector.movers.choice import PairCosts, choose, slow


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_case_chooses_as_its_pair_says(case) -> None:  # type: ignore[no-untyped-def]
    _, model, tokens, p_tp, d_tp, p_lay, d_lay, p_blk, d_blk = case
    runs = plan_runs(model, tokens, (p_tp, d_tp), (p_lay, d_lay), (p_blk, d_blk))
    got = {
        name: choose(PairCosts(read, write, never=slow(read, write, 8 << 20)), runs, Staging())
        for name, (read, write) in PAIRS.items()
    }
    assert got["GPU, no RDMA"][0] is Mode.PUSH and "never READ" in got["GPU, no RDMA"][1]
    assert got["host, this VM"][0] is Mode.PULL, got["host, this VM"][1]
    assert got["RDMA"][0] is Mode.PULL and "priced pull" in got["RDMA"][1]


def test_the_benchmark_prints_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_choice", "--calls", "3"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    with capsys.disabled():  # the choices, priced, go into make test's log
        print("\n" + out)
    rows = [ln for ln in out.splitlines() if "→" in ln and "µs)" in ln]
    assert len(rows) == len(CASES), out
