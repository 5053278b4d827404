"""No import circle among kvbridge's modules: the graph of every ``import`` and ``from …
import`` between modules of ``src/kvbridge`` (at module level, under ``TYPE_CHECKING`` too:
a type is a dependency) must have no cycle. Importing a module depends on it and on every
package above it (their ``__init__`` runs first), except the packages above the importer
itself, already loading; ``from package import name`` depends on the submodule ``name``
where there is one, else on the package, the importer's own too. Imports inside functions
are left out: they
are the way to load a heavy or optional module late (Triton, the reference engine), and
run after every module loaded. Prints each cycle found (one per strongly connected set
of modules) and exits 1 if there is any.

Usage: python tools/check_imports.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "kvbridge"


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_level_imports(tree: ast.Module, here: str, is_pkg: bool, modules: set[str]) -> set[str]:
    """Modules imported at module level (``if``, ``try``, ``with`` and class bodies
    included, function bodies not); a name taken from a package: :data:`NAME` + it."""
    out: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If | ast.Try):
            todo += node.body + node.orelse
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
            todo += getattr(node, "finalbody", [])
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, here, is_pkg)
            for a in node.names:  # a submodule imported by name, else a name of ``base``
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else NAME + base)
        elif isinstance(node, ast.ClassDef | ast.With):
            todo += node.body
    return out


def _absolute(node: ast.ImportFrom, here: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = here.split(".") if is_pkg else here.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


NAME = "name:"
"""Marks an import of a name (not a submodule) from a package: it needs the package's
``__init__`` to have run that far, even the importer's own package."""


def edges_of(mod: str, deps: set[str], modules: set[str]) -> set[str]:
    """Modules ``mod`` needs loaded: each imported module and every package above it
    (loading a module runs its packages' ``__init__`` first), except the packages above
    ``mod`` itself (already loading when ``mod`` runs) unless a name is taken from one."""
    out = set()
    for dep in deps:
        named, d = dep.startswith(NAME), dep.removeprefix(NAME)
        parts = d.split(".")
        for i in range(1, len(parts) + 1):
            p = ".".join(parts[:i])
            if not mod.startswith(p + ".") or (named and p == d):
                out.add(p)
    return {d for d in out if d in modules and d != mod}


def graph() -> dict[str, set[str]]:
    paths = {module_of(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for mod, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        deps = top_level_imports(tree, mod, path.name == "__init__.py", set(paths))
        edges[mod] = edges_of(mod, deps, set(paths))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    edges = graph()
    bad = cycles(edges)
    for group in bad:
        inner = [f"{a} -> {b}" for a in group for b in sorted(edges[a]) if b in group]
        print(f"import circle among {len(group)} modules: " + "; ".join(inner))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
