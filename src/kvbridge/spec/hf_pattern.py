"""What each model layer caches, from the formats Hugging Face configs use: the first
present wins, in the order of ``_READERS`` (the formats: ``docs/spec-file.md``).

Entries: ``full`` (global attention: K/V or MLA, by architecture), ``sliding``,
``chunked``, ``linear`` (a state mixer: Mamba, DeltaNet…), ``both`` (attention and a
state mixer in one layer: Falcon-H1, in ``attn_layer_indices`` or every layer) and
``none`` (a block that caches nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.spec.hf_fields import Fields

FULL, SLIDING, CHUNKED, LINEAR, BOTH, NONE = "full", "sliding", "chunked", "linear", "both", "none"

_LAYER_TYPES = {
    "full_attention": FULL,
    "attention": FULL,
    "sliding_attention": SLIDING,
    "chunked_attention": CHUNKED,
    "linear_attention": LINEAR,
    "mamba": LINEAR,
}
_OVERRIDE_CHARS = {"M": LINEAR, "*": FULL, "-": NONE, "E": NONE}


@dataclass(frozen=True, slots=True)
class Pattern:
    entries: tuple[str, ...]
    source: str
    """The config field the pattern was read from (for error messages)."""


def layer_pattern(f: Fields, n: int, parallel_hybrid: bool = False) -> Pattern:
    """One entry per model layer of a config with ``n`` layers."""
    if parallel_hybrid:
        return _parallel(f, n)
    for key, reader in _READERS:
        if f.has(key):
            entries = reader(f, n)
            if len(entries) != n:
                raise ConfigError(
                    f"{f.path(key)} describes {len(entries)} layers; "
                    f"{f.path('num_hidden_layers')} is {n}"
                )
            return Pattern(tuple(entries), f.path(key))
    return Pattern(tuple(_uniform(f, n)), f.path("num_hidden_layers"))


def _layer_types(f: Fields, n: int) -> list[str]:
    return _named(f, "layer_types", f.str_list("layer_types"), _LAYER_TYPES, "layer type", ", ")


def _override(f: Fields, n: int) -> list[str]:
    key = "hybrid_override_pattern"
    return _named(f, key, f.text(key), _OVERRIDE_CHARS, "block", " ")


def _named(
    f: Fields, key: str, names: Sequence[str], table: dict[str, str], what: str, sep: str
) -> list[str]:
    """The entries ``table`` maps ``names`` to; an unknown one names its position."""
    for i, name in enumerate(names):
        if name not in table:
            raise ConfigError(
                f"{f.path(key)}[{i}]: unknown {what} {name!r}; known: {sep.join(table)}"
            )
    return [table[name] for name in names]


def _index_lists(f: Fields, n: int) -> list[str]:
    """``full_attn_layers`` and ``kda_layers`` (1-indexed) must partition the layers."""
    lin = f.section("linear_attn_config")
    out: list[str | None] = [None] * n
    for key, entry in (("full_attn_layers", FULL), ("kda_layers", LINEAR)):
        for pos, k in enumerate(lin.int_list(key, minimum=1)):
            where = f"{lin.path(key)}[{pos}]"
            if k > n:
                raise ConfigError(f"{where}: layer {k} > {f.path('num_hidden_layers')}={n}")
            if out[k - 1] is not None:
                raise ConfigError(f"{where}: layer {k} (1-indexed) is listed twice")
            out[k - 1] = entry
    missing = [i + 1 for i, e in enumerate(out) if e is None]
    if missing:
        raise ConfigError(
            f"{lin.path('full_attn_layers')} and {lin.path('kda_layers')} leave layers "
            f"{missing} (1-indexed) in neither list"
        )
    return [e for e in out if e is not None]


def _flags(f: Fields, key: str) -> list[int]:
    flags = f.int_list(key)
    for i, v in enumerate(flags):
        if v not in (0, 1):
            raise ConfigError(f"{f.path(key)}[{i}]: expected 0 or 1, got {v}")
    return flags


def _attn_type_list(f: Fields, n: int) -> list[str]:
    return [FULL if t == 1 else LINEAR for t in _flags(f, "attn_type_list")]


def _interval(f: Fields, n: int) -> list[str]:
    k = f.req_int("full_attention_interval")
    return [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]


def _period_offset(f: Fields, n: int) -> list[str]:
    period = f.req_int("attn_layer_period")
    offset = f.req_int("attn_layer_offset", minimum=0)
    if offset >= period:
        raise ConfigError(
            f"{f.path('attn_layer_offset')}={offset} must be < "
            f"{f.path('attn_layer_period')}={period}"
        )
    return [FULL if i % period == offset else LINEAR for i in range(n)]


def _chunked(f: Fields, n: int) -> list[str]:
    """Llama-4: ``no_rope_layers[i] == 1`` (RoPE) layers use chunked local attention."""
    if f.has("no_rope_layers"):
        flags = _flags(f, "no_rope_layers")
    else:
        k = f.opt_int("no_rope_layer_interval") or 4
        flags = [int((i + 1) % k != 0) for i in range(n)]
    return [CHUNKED if v == 1 else FULL for v in flags]


def _sliding_pattern(f: Fields, n: int) -> list[str]:
    p = f.req_int("sliding_window_pattern")
    return [FULL if (i + 1) % p == 0 else SLIDING for i in range(n)]


def _uniform(f: Fields, n: int) -> list[str]:
    if f.has("sliding_window") and f.flag("use_sliding_window", True):
        first = f.opt_int("max_window_layers", minimum=0) or 0
        return [SLIDING if i >= first else FULL for i in range(n)]
    return [FULL] * n


def _parallel(f: Fields, n: int) -> Pattern:
    key = "attn_layer_indices"
    if not f.has(key):
        return Pattern((BOTH,) * n, f.path("num_hidden_layers"))
    attn = set()
    for pos, i in enumerate(f.int_list(key)):
        if i >= n:
            raise ConfigError(f"{f.path(key)}[{pos}]: layer {i} ≥ num_hidden_layers={n}")
        attn.add(i)
    return Pattern(tuple(BOTH if i in attn else LINEAR for i in range(n)), f.path(key))


_READERS: tuple[tuple[str, Callable[[Fields, int], list[str]]], ...] = (
    ("layer_types", _layer_types),
    ("hybrid_override_pattern", _override),
    ("linear_attn_config", _index_lists),
    ("attn_type_list", _attn_type_list),
    ("full_attention_interval", _interval),
    ("attn_layer_period", _period_offset),
    ("attention_chunk_size", _chunked),
    ("sliding_window_pattern", _sliding_pattern),
)
