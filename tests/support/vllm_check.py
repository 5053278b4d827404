"""The check that a class still fits vLLM's API (docs/vllm.md, "vLLM versions"):
:func:`check_class` compares an implementation with its bases, :func:`check_construct` a
constructor with the way vLLM's factory calls it; each returns a list of problems, one
line each, empty when the class fits. :func:`differences` lists what one reading of a
class changes against another. The readings: :mod:`tests.support.vllm_api`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.support.vllm_api import EXPR, ClassApi, Construct, Method, Param, method_text

POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
NAMED = ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")


@dataclass
class _Shape:
    """A parameter list split the way a call binds it."""

    positional: list[Param] = field(default_factory=list)
    keyword_only: dict[str, Param] = field(default_factory=dict)
    var_positional: bool = False
    var_keyword: bool = False

    @classmethod
    def of(cls, params: tuple[Param, ...]) -> _Shape:
        s = cls()
        for p in params:
            if p.kind in POSITIONAL:
                s.positional.append(p)
            elif p.kind == "KEYWORD_ONLY":
                s.keyword_only[p.name] = p
            s.var_positional |= p.kind == "VAR_POSITIONAL"
            s.var_keyword |= p.kind == "VAR_KEYWORD"
        return s


def _same_param(where: str, base: Param, over: Param) -> list[str]:
    """``over`` where calls pass ``base``: by position only (any name will do), or by
    name too (the same name, not positional-only)."""
    out = []
    if base.kind != "POSITIONAL_ONLY" and over.name != base.name:
        out.append(f"{where} is named '{over.name}', vLLM's '{base.name}'")
    if over.kind == "POSITIONAL_ONLY" and base.kind != "POSITIONAL_ONLY":
        out.append(f"{where} '{over.name}' is {over.kind}, vLLM's is {base.kind}")
    return out + _same_default(where, base, over)


def _same_default(where: str, base: Param, over: Param) -> list[str]:
    if base.default is not None and over.default is None:
        return [f"{where} '{over.name}' has no default, vLLM's has {base.default}"]
    if {base.default, over.default}.isdisjoint({EXPR, None}) and base.default != over.default:
        return [f"{where} '{over.name}' defaults to {over.default}, vLLM's {base.default}"]
    return []


def check_override(base: Method, over: Method) -> list[str]:
    """Problems for ``over`` standing in for ``base``: every call vLLM may make with
    ``base``'s signature must bind to ``over`` the same way (same names, order, kinds; a
    default where vLLM's has one, the same value where both are literals); parameters
    ``over`` adds need defaults."""
    if over.kind != base.kind:
        return [f"{over.name}: a {over.kind}, vLLM's is a {base.kind}"]
    b, o = _Shape.of(base.params), _Shape.of(over.params)
    out = []
    for i, bp in enumerate(b.positional):
        if i < len(o.positional):
            out += _same_param(f"parameter {i}", bp, o.positional[i])
        elif not (o.var_positional and (o.var_keyword or bp.kind == "POSITIONAL_ONLY")):
            out.append(f"lacks parameter {i} '{bp.name}'")
    extra = {p.name: p for p in o.positional[len(b.positional) :] if p.kind in NAMED}
    for p in o.positional[len(b.positional) :]:
        if p.default is None and p.name not in b.keyword_only:
            out.append(f"adds parameter '{p.name}' without a default")
    for name, bp in b.keyword_only.items():
        op = o.keyword_only.get(name, extra.get(name))
        if op is not None:
            out += _same_default("keyword", bp, op)
        elif not o.var_keyword:
            out.append(f"lacks keyword-only parameter '{name}'")
    out += [
        f"adds keyword-only parameter '{n}' without a default"
        for n, p in o.keyword_only.items()
        if n not in b.keyword_only and p.default is None
    ]
    if b.var_positional and not o.var_positional:
        out.append("lacks *args, which vLLM's has")
    if b.var_keyword and not o.var_keyword:
        out.append("lacks **kwargs, which vLLM's has")
    return [f"{over.name}: {line}" for line in out]


AHEAD = frozenset({"supports_sleep_mode"})
"""Hooks only a newer vLLM's base has, defined by kvbridge ahead (0.33's
``supports_sleep_mode``): an older base may lack them; a snapshot of the newer one
checks them (``tests/unit/test_vllm_api.py``)."""


def check_class(impl: ClassApi, bases: list[ClassApi]) -> list[str]:
    """Problems for ``impl`` as a subclass of ``bases``: each public method it defines
    exists in a base and fits it (:func:`check_override`; private helpers may be its own,
    dunders other than ``__init__`` are left out; :data:`AHEAD` may be missing); each
    abstract method of the bases is defined by ``impl``; what ``impl`` reads from
    ``self`` exists in a base."""
    out = []
    for name, over in sorted(impl.methods.items()):
        if name.startswith("__") and name != "__init__":
            continue
        base = next((b.methods[name] for b in bases if name in b.methods), None)
        if base is not None:
            out += [f"{impl.name}.{line}" for line in check_override(base, over)]
        elif not name.startswith("_") and name not in AHEAD:
            out.append(f"{impl.name}.{name}: not a method of {', '.join(b.name for b in bases)}")
    for b in bases:
        for name, m in sorted(b.methods.items()):
            if m.abstract and (name not in impl.methods or impl.methods[name].abstract):
                out.append(f"{impl.name}: does not define {b.name}.{name}, which is abstract")
    known = set().union(*(set(b.methods) | b.attrs for b in bases))
    out += [f"{impl.name}: uses self.{n}, which no base defines" for n in sorted(impl.uses - known)]
    return out


def check_construct(init: Method, call: Construct) -> list[str]:
    """Problems for a connector whose ``__init__`` is ``init`` when vLLM's factory builds
    it as ``call`` says."""
    s = _Shape.of(init.params[1:])  # without self
    out = []
    free = s.positional
    if call.positional > len(free) and not s.var_positional:
        out.append(f"takes {len(free)} positional arguments, the factory passes {call.positional}")
    for p in free[call.positional :]:
        if p.default is None and p.name not in call.keywords:
            out.append(f"parameter '{p.name}' is not passed by vLLM's factory and has no default")
    bound = {p.name for p in free[: call.positional]}
    nameable = {p.name for p in free if p.kind in NAMED} | set(s.keyword_only)
    for name in call.keywords:
        if name in bound:
            out.append(f"vLLM's factory passes '{name}' by keyword, __init__ takes it by position")
        elif name not in nameable and not s.var_keyword:
            out.append(f"vLLM's factory passes '{name}', __init__ has no such parameter")
    for name in call.named:
        if name not in nameable and not s.var_keyword:
            out.append(f"vLLM's factory requires a parameter '{name}' it can name")
    return [f"__init__: {line}" for line in out]


def differences(old: ClassApi, new: ClassApi) -> list[str]:
    """Methods ``new`` adds (``+``), drops (``-``) or changes (``~``) against ``old``, one
    line each in :func:`method_text`'s form; and attributes added or dropped."""
    added = sorted(n for n in new.methods if n not in old.methods)
    out = [f"+ {n} {method_text(new.methods[n])}" for n in added]
    out += [f"- {n}" for n in sorted(old.methods) if n not in new.methods]
    out += [
        f"~ {n} {method_text(m)} -> {method_text(new.methods[n])}"
        for n, m in sorted(old.methods.items())
        if n in new.methods and method_text(m) != method_text(new.methods[n])
    ]
    out += [f"+ self.{a}" for a in sorted(new.attrs - old.attrs)]
    out += [f"- self.{a}" for a in sorted(old.attrs - new.attrs)]
    return out
