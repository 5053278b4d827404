"""`kvbridge bench` runs the checkout's benchmarks/ (not installed with the package) in a
process of its own: the CLI's process imports nothing from the checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cli import bench_cmd
from kvbridge.cli.main import main
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


def test_another_checkout_runs_with_its_own_kvbridge(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """kvbridge not installed from a checkout: the working directory's runs, with that
    checkout's ``src/kvbridge`` first on the child's path (never its benchmarks against
    another kvbridge); the child's exit code is the command's."""
    installed = tmp_path / "site-packages" / "kvbridge" / "cli" / "bench_cmd.py"
    monkeypatch.setattr(bench_cmd, "__file__", str(installed))
    root = tmp_path / "clone"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "__init__.py").write_text("")
    (root / "benchmarks" / "bench_cli.py").write_text(
        "import sys, kvbridge\nprint(kvbridge.__file__, sys.argv[1:])\nsys.exit(3)\n"
    )
    (root / "src" / "kvbridge").mkdir(parents=True)
    (root / "src" / "kvbridge" / "__init__.py").write_text("")
    monkeypatch.chdir(root)
    assert bench_cmd.checkout() == root
    assert main(["bench", "trace", "--only=-x", "--quick"]) == 3
    out = capfd.readouterr().out
    assert str(root / "src" / "kvbridge" / "__init__.py") in out, out
    assert "'--only=-x'" in out and "'--quick'" in out, out


def test_a_relative_plot_is_the_callers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "figs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "plan", "--quick", "--calls", "1", "--plot", "figs/p.png"]) == 0
    assert (tmp_path / "figs" / "p.png").stat().st_size > 0


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
