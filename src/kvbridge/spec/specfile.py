"""The neutral spec file (format: ``docs/spec-file.md``): a model spec in TOML or JSON,
for engines and models without a Hugging Face config. It says everything the Python API
can say."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.spec.build import attention, mla
from kvbridge.spec.dtypes import DType
from kvbridge.spec.hf import load_config
from kvbridge.spec.hf_fields import Fields
from kvbridge.spec.info import ModelInfo, default_groups
from kvbridge.spec.model import Group, Kind, Layer, ModelSpec, Segment, Stream

VERSION = 1
_TOP_KEYS = {"kvbridge_spec", "name", "dtype", "block_size", "layers", "groups"}
_LAYER_KEYS = {"kind", "window", "chunk", "streams", "repeat", "dtype"}
_KV_KEYS = {"kv_heads", "head_dim", "v_head_dim"}
_STREAM_KEYS = {"name", "segments", "dtype", "rows", "replicated"}
_GROUP_KEYS = {"name", "layers", "block_size"}


def load_spec_file(path: str | Path, kv_dtype: DType | None = None) -> ModelInfo:
    """Read a ``.toml`` or ``.json`` spec file. ``kv_dtype`` replaces the dtype of every
    per-token stream whose segments are given in elements."""
    return spec_from_dict(load_config(path), kv_dtype)


def spec_from_dict(data: Mapping[str, Any], kv_dtype: DType | None = None) -> ModelInfo:
    f = _fields(data, "", _TOP_KEYS)
    version = f.req_int("kvbridge_spec")
    if version != VERSION:
        raise ConfigError(f"kvbridge_spec: version {version} is not supported (only {VERSION})")
    dtype = f.dtype("dtype") or DType.BF16
    layers: list[Layer] = []
    for i, entry in enumerate(f.items("layers")):
        lf = _fields(entry, f"layers[{i}].", _LAYER_KEYS | _KV_KEYS | {"latent_width"})
        for _ in range(lf.opt_int("repeat") or 1):
            layers.append(_layer(lf, len(layers), lf.dtype("dtype") or dtype, kv_dtype))
    if not layers:
        raise ConfigError("layers: the spec has no layers")
    block_size = f.opt_int("block_size") or 16
    if f.has("groups"):
        groups = tuple(_group(g, i, block_size) for i, g in enumerate(f.items("groups")))
    else:
        groups = default_groups(layers, block_size)
    name = f.text("name") if f.has("name") else "spec"
    spec = ModelSpec(name, tuple(layers), groups)
    return ModelInfo(spec, "spec file", tuple(range(len(layers))))


def _fields(data: Any, prefix: str, known: set[str]) -> Fields:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'top level'}: expected an object, got {data!r}")
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown key; known: {', '.join(sorted(known))}")
    return Fields(data, prefix)


def _kind(f: Fields) -> Kind:
    name = f.text("kind")
    try:
        return Kind(name)
    except ValueError:
        known = ", ".join(k.value for k in Kind)
        raise ConfigError(f"{f.path('kind')}: unknown kind {name!r}; known: {known}") from None


def _layer(f: Fields, index: int, dtype: DType, kv_dtype: DType | None) -> Layer:
    kind = _kind(f)
    window = f.req_int("window") if kind is Kind.SLIDING else 0
    chunk = f.req_int("chunk") if kind is Kind.CHUNKED else 0
    for key, needed in (("window", Kind.SLIDING), ("chunk", Kind.CHUNKED)):
        if f.has(key) and kind is not needed:
            raise ConfigError(f"{f.path(key)}: only {needed} layers have one (kind is {kind})")
    shorthand = [k for k in (*sorted(_KV_KEYS), "latent_width") if f.has(k)]
    if f.has("streams") == bool(shorthand):
        raise ConfigError(
            f"{f.path('streams')}: give either streams or a shorthand "
            f"(kv_heads/head_dim, latent_width), not {'both' if shorthand else 'neither'}"
        )
    if shorthand:
        return _shorthand(f, index, kind, kv_dtype or dtype, window, chunk)
    streams = tuple(
        _stream(s, f"{f.path('streams')}[{i}].", kind, dtype, kv_dtype)
        for i, s in enumerate(f.items("streams"))
    )
    return Layer(index, kind, streams, window=window, chunk=chunk)


def _shorthand(f: Fields, index: int, kind: Kind, dtype: DType, window: int, chunk: int) -> Layer:
    if kind is Kind.MLA:
        if any(f.has(k) for k in _KV_KEYS):
            raise ConfigError(f"{f.path('kv_heads')}: an mla layer takes latent_width only")
        return mla(index, f.req_int("latent_width"), dtype)
    if kind is Kind.STATE or f.has("latent_width"):
        raise ConfigError(
            f"{f.path('kind')}: the shorthand is kv_heads/head_dim for full, sliding and "
            f"chunked layers, latent_width for mla; {kind} layers list their streams"
        )
    v_dim = f.opt_int("v_head_dim")
    return attention(
        index, f.req_int("kv_heads"), f.req_int("head_dim"), dtype, kind, window, chunk, v_dim
    )


def _stream(data: Any, prefix: str, kind: Kind, dtype: DType, kv_dtype: DType | None) -> Stream:
    f = _fields(data, prefix, _STREAM_KEYS)
    rows = f.opt_int("rows", minimum=0) or 0
    dt = f.dtype("dtype") or dtype
    rescaled = kind is not Kind.STATE and kv_dtype is not None
    dt = kv_dtype if rescaled and kv_dtype else dt
    segs = tuple(
        _segment(s, f"{f.path('segments')}[{i}]", dt, rescaled)
        for i, s in enumerate(f.items("segments"))
    )
    replicated = f.flag("replicated", False)
    return Stream(f.text("name"), segs, dt, rows=rows, replicated=replicated)


def _segment(data: Any, where: str, dtype: DType, rescaled: bool) -> Segment:
    if isinstance(data, list):
        if len(data) != 2:
            raise ConfigError(f"{where}: expected [units, elements], got {data!r}")
        data = {"units": data[0], "elements": data[1]}
    f = _fields(data, where + ".", {"units", "elements", "bytes"})
    units = f.req_int("units")
    if f.has("elements") == f.has("bytes"):
        raise ConfigError(f"{where}: give exactly one of elements and bytes")
    if f.has("bytes"):
        if rescaled:
            raise ConfigError(f"{where}.bytes: a KV dtype override cannot rescale bytes")
        return Segment(units, f.req_int("bytes"))
    return Segment(units, f.req_int("elements") * dtype.itemsize)


def _group(data: Any, i: int, block_size: int) -> Group:
    f = _fields(data, f"groups[{i}].", _GROUP_KEYS)
    layers = tuple(f.int_list("layers"))
    return Group(f.text("name"), layers, f.opt_int("block_size") or block_size)


def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """The explicit file form of ``spec`` (every stream and group spelled out)."""
    return {
        "kvbridge_spec": VERSION,
        "name": spec.name,
        "layers": [_layer_dict(lay) for lay in spec.layers],
        "groups": [
            {"name": g.name, "layers": list(g.layers), "block_size": g.block_size}
            for g in spec.groups
        ],
    }


def dump_spec_file(spec: ModelSpec) -> str:
    """``spec`` as a JSON spec file."""
    return json.dumps(spec_to_dict(spec), indent=1)


def _layer_dict(lay: Layer) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": str(lay.kind)}
    if lay.kind is Kind.SLIDING:
        out["window"] = lay.window
    if lay.kind is Kind.CHUNKED:
        out["chunk"] = lay.chunk
    out["streams"] = [_stream_dict(s) for s in lay.streams]
    return out


def _stream_dict(s: Stream) -> dict[str, Any]:
    out: dict[str, Any] = {"name": s.name, "dtype": str(s.dtype)}
    if s.rows:
        out["rows"] = s.rows
    if s.replicated:
        out["replicated"] = True
    size = s.dtype.itemsize
    out["segments"] = [
        [g.units, g.unit_bytes // size]
        if g.unit_bytes % size == 0
        else {"units": g.units, "bytes": g.unit_bytes}
        for g in s.segments
    ]
    return out
