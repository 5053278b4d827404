"""``kvbridge bench transfer --quick --plot FILE.png`` end to end: the bench runs over
NIXL in its own processes and leaves its figure next to its rows (about 10 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="pip install 'kvbridge[plot]'")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SRC = Path(__file__).resolve().parents[2] / "src"


def test_quick_transfer_bench_writes_its_figure(tmp_path: Path) -> None:
    out = tmp_path / "transfer.png"
    env = {**os.environ, "PYTHONPATH": str(SRC), "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
    argv = ["bench", "transfer", "--quick", "--json", "--plot", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli.main", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert len(rows) == 6 and all(r["memcpy_gbps"] > 0 for r in rows)
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert f"figure written to {out}" in done.stderr
