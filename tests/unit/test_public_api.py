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


def test_a_missing_name_and_dir_load_nothing_heavy() -> None:
    code = (
        "import sys, kvbridge; assert not hasattr(kvbridge, 'no_such_name'); d = dir(kvbridge); "
        "assert 'Consumer' in d and 'rows_copy' in d; "
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


LAZY = {"refengine": "kvbridge/cli/demo_cmd.py"}
"""The thin CLI entry importing its tooling inside a function, never at import
time. The installed packages (``kvbridge``, and ``refengine``, which ``kvbridge demo``
runs) import no test or benchmark module at all."""


def _imports_at(tree: ast.AST) -> list[tuple[str, bool]]:
    """Every absolute import of ``tree``: the module, and whether it sits in a function."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module or "", in_function))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def test_the_library_imports_no_test_bench_or_engine_module() -> None:
    bad = []
    for path in [*PKG.rglob("*.py"), *REFENGINE.rglob("*.py")]:
        rel = path.relative_to(ROOT / "src").as_posix()
        for name, in_function in _imports_at(ast.parse(path.read_text())):
            root = name.split(".")[0]
            lazy_ok = LAZY.get(root) == rel and in_function
            tooling = root in ("tests", "benchmarks") or (
                root == "refengine" and rel.startswith("kvbridge/")
            )
            if tooling and not lazy_ok:
                bad.append(f"{rel}: {name}")
    assert bad == []


def test_the_import_check_sees_imports_run_at_import_time() -> None:
    code = (
        "try:\n    import benchmarks\nexcept ImportError:\n    pass\ndef f():\n    import tests\n"
    )
    assert _imports_at(ast.parse(code)) == [("benchmarks", False), ("tests", True)]


def test_examples_use_the_public_api_only() -> None:
    allowed = ("kvbridge.api", "refengine")
    for path in (ROOT / "examples").glob("*.py"):
        assert all(m.startswith(allowed) for m in _kvbridge_imports(path)), path.name
