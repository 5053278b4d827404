"""`kvbridge bench` runs the checkout's benchmarks/ (not installed with the package) in a
process of its own: the CLI's process imports nothing from the checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cli import bench_cmd
from kvbridge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_outside_a_checkout_bench_says_what_it_needs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    installed = tmp_path / "site-packages" / "kvbridge" / "cli" / "bench_cmd.py"
    monkeypatch.setattr(bench_cmd, "__file__", str(installed))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="source checkout"):
        bench_cmd.checkout()


def test_the_working_directorys_checkout_comes_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_cli.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert bench_cmd.checkout() == tmp_path


def test_bench_runs_in_a_child_and_imports_nothing_of_the_checkout(tmp_path: Path) -> None:
    """From another directory (the checkout found where the package is installed in
    place), `bench plan` prints its rows, and the CLI's own process never imported
    ``benchmarks`` nor put the checkout on its path."""
    code = (
        "import sys, json; from kvbridge.cli.main import main; "
        "rc = main(['bench', 'plan', '--quick', '--calls', '2', '--json']); "
        "print(json.dumps([rc, 'benchmarks' in sys.modules, sys.path]), file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    rc, imported, path = json.loads(out.stderr.strip().splitlines()[-1])
    assert rc == 0 and not imported, out.stderr
    assert str(ROOT) not in path
    assert len(json.loads(out.stdout)) == 8
