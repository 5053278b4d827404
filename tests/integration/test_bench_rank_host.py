"""``python -m benchmarks.bench_rank_host --quick``: the kernel mover's host time per
request alone and in a spawned rank process, back to back and after idle gaps (the rank
blocking or polling), printed side by side (issue 32's in-rank host-time figure, in every
``make test``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def test_quick_rank_host_bench_prints_all_five_figures(capsys: pytest.CaptureFixture) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_rank_host", "--quick", "--gap-ms", "20"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with capsys.disabled():  # the figures go into make test's log
        print("\n" + done.stdout)
    (row,) = [ln for ln in done.stdout.splitlines() if ln.startswith("1024 tokens")]
    figures = [float(x) for x in re.findall(r"\d+\.\d", row.split("nhd", 1)[1])]
    assert len(figures) == 5 and all(0 < f < 1e6 for f in figures), row
