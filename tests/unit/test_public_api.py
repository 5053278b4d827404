"""The declared public API: ``kvbridge.api`` (and lazily ``kvbridge.<name>``); the
reference engine, the vLLM integration and the examples import nothing else of kvbridge."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvbridge
from kvbridge import api

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "kvbridge"


def test_the_lazy_names_are_the_api() -> None:
    assert set(api.__all__) == kvbridge._API
    for name in api.__all__:
        assert getattr(kvbridge, name) is getattr(api, name)
    public = {
        n for n, v in vars(api).items() if getattr(v, "__module__", "").startswith("kvbridge")
    }
    assert public <= set(api.__all__), public - set(api.__all__)  # nothing unlisted


def test_import_kvbridge_loads_nothing_heavy() -> None:
    code = (
        "import sys, kvbridge; from kvbridge import catalog; "
        "print(sorted(m for m in ('numpy', 'torch', 'zmq', 'nixl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _kvbridge_imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "kvbridge":
            mods.update(f"kvbridge.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return {m for m in mods if m == "kvbridge" or m.startswith("kvbridge.")}


REFENGINE = ROOT / "src" / "refengine"
ALLOWED = {
    REFENGINE: (
        "kvbridge.api",
        "kvbridge.adapter",  # the engine-neutral half of an engine adapter
        "kvbridge.registry",  # the name-keyed table behind the mixers (refengine/mixers.py)
        "kvbridge.cli",  # `kvbridge demo`'s arguments and report (refengine/demo.py)
        "kvbridge.jsonio",  # `kvbridge demo --json`
    ),
    PKG / "integrations": (
        "kvbridge.api",
        "kvbridge.adapter",
        "kvbridge.integrations",
        "kvbridge.envs",  # settings read from the environment (progress delay)
    ),
}


def test_engine_and_integrations_use_the_public_api_only() -> None:
    bad = []
    for folder, allowed in ALLOWED.items():
        for path in folder.rglob("*.py"):
            for mod in _kvbridge_imports(path):
                if not mod.startswith(allowed):
                    bad.append(f"{path.relative_to(ROOT)}: {mod}")
    assert bad == []


def test_the_adapter_imports_no_engine() -> None:
    """``kvbridge.adapter`` is engine-neutral: of kvbridge the public API and the registry
    only, no engine, torch or numpy of its own; importing it loads no engine (torch comes
    with ``kvbridge.api``'s connector)."""
    allowed = ("kvbridge.api", "kvbridge.adapter", "kvbridge.registry")
    for path in (PKG / "adapter").rglob("*.py"):
        assert all(m.startswith(allowed) for m in _kvbridge_imports(path)), path.name
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        heavy = {m.split(".")[0] for m in names} & {"vllm", "torch", "numpy", "refengine"}
        assert not heavy, f"{path.name}: {heavy}"
    code = (
        "import sys, kvbridge.adapter; "
        "print(sorted(m for m in ('vllm', 'refengine') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


LAZY = {"benchmarks": "cli/bench_cmd.py", "refengine": "cli/demo_cmd.py"}
"""The two thin CLI entries, each importing its tooling inside a function, never at the top."""


def test_the_library_imports_no_test_bench_or_engine_module() -> None:
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                root = name.split(".")[0]
                if root == "tests" or (root in LAZY and (LAZY[root] != rel or node in top)):
                    bad.append(f"{rel}: {name}")
    assert bad == []


def test_examples_use_the_public_api_only() -> None:
    allowed = ("kvbridge.api", "refengine")
    for path in (ROOT / "examples").glob("*.py"):
        assert all(m.startswith(allowed) for m in _kvbridge_imports(path)), path.name
