"""``tools/check_imports.py`` finds import circles (``TYPE_CHECKING`` imports count, a
module's parent packages and imports inside functions do not) and ``src/kvbridge`` has
none."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_imports", ROOT / "tools" / "check_imports.py")
assert spec is not None and spec.loader is not None
check_imports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_imports)


def _edges(sources: dict[str, str], packages: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    mods = set(sources)
    out = {}
    for mod, text in sources.items():
        deps = check_imports.top_level_imports(ast.parse(text), mod, mod in packages, mods)
        out[mod] = check_imports.edges_of(mod, deps, mods)
    return out


def test_a_type_only_import_closes_a_circle() -> None:
    edges = _edges({
        "p.a": "from p.b import thing\n",
        "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import A\n",
        "p.c": "def late():\n    from p.a import x\n",
        "p": "from p.c import late\n",
    })  # fmt: skip
    assert check_imports.cycles(edges) == [["p.a", "p.b"]]


def test_imports_inside_functions_and_parent_packages_are_no_edges() -> None:
    edges = _edges({
        "p": "from p.a import f\n",
        "p.a": "from p import b\n\ndef f():\n    from p.c import g\n",
        "p.b": "import p\n",
        "p.c": "from p.a import f\n",
    })  # fmt: skip
    assert edges["p.a"] == {"p.b"} and edges["p.b"] == set()
    assert check_imports.cycles(edges) == []


def test_circles_through_package_inits_are_found() -> None:
    """Importing ``p.a.x`` runs ``p/a/__init__`` first; a name taken from one's own
    package needs its ``__init__`` too (both fail at import time in Python)."""
    edges = _edges(
        {
            "p": "",
            "p.a": "from p.a.x import X\n",
            "p.a.x": "from p.b.y import Y\nX = 1\n",
            "p.b": "",
            "p.b.y": "from p.a.z import Z\nY = 1\n",
            "p.a.z": "Z = 1\n",
        },
        frozenset({"p", "p.a", "p.b"}),
    )
    assert "p.a" in edges["p.b.y"]
    assert check_imports.cycles(edges) == [["p.a", "p.a.x", "p.b.y"]]
    own = _edges({"q": "from q.m import M\n", "q.m": "from q import N\nM = 1\n"}, frozenset({"q"}))
    assert check_imports.cycles(own) == [["q", "q.m"]]
    relative = _edges(
        {"r": "", "r.s": "from . import t\n", "r.t": "import r.s as s\n"}, frozenset({"r"})
    )
    assert check_imports.cycles(relative) == [["r.s", "r.t"]]


def test_kvbridge_has_no_import_circle() -> None:
    assert check_imports.cycles(check_imports.graph()) == []
