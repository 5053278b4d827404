"""`kvbridge bench` runs the checkout's benchmarks/, which are not installed with the package."""

from __future__ import annotations

import importlib
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
    with pytest.raises(ConfigError, match="source checkout"):
        bench_cmd._checkout()


def test_in_a_checkout_bench_imports_the_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        monkeypatch.delitem(sys.modules, name)
    bench_cmd._checkout()
    assert str(ROOT) in sys.path
    assert importlib.import_module("benchmarks.plan_bench").__file__ == str(
        ROOT / "benchmarks" / "plan_bench.py"
    )
