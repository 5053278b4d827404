"""vLLM's Mamba-2 and Gated DeltaNet state (``MambaSpec``) as kvbridge state layers and
views (:func:`state_descs`: where vLLM keeps it)."""

from __future__ import annotations

import math
from typing import Any

from kvbridge.api import (
    ConfigError,
    Layer,
    RegionSet,
    Stream,
    TensorDesc,
    View,
    gated_deltanet,
    mamba2,
    parse_dtype,
    shard_interval,
)


def conv_dim_first() -> bool:
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:  # unit tests without vLLM: its default, SD
        return False
    return bool(is_conv_state_dim_first())


def state_layer(index: int, cs: Any, tp: int, conv_dim_first: bool) -> Layer:
    """A Mamba-2 or Gated DeltaNet layer from a ``MambaSpec``'s per-rank shapes."""
    kind = getattr(cs.mamba_type, "name", str(cs.mamba_type))
    if getattr(cs, "num_speculative_blocks", 0) or getattr(cs, "tp_replicated", False):
        raise ConfigError(f"layer {index}: Mamba state with speculative blocks or TP-replicated")
    if len(cs.shapes) != 2 or len(cs.dtypes) != 2 or len(cs.shapes[0]) != 2:
        raise ConfigError(f"layer {index}: {kind} state of shapes {cs.shapes}: expected conv, ssm")
    conv, ssm = (tuple(int(x) for x in s) for s in cs.shapes)
    channels, rows = conv if conv_dim_first else conv[::-1]
    conv_dt, ssm_dt = (parse_dtype(str(d)) for d in cs.dtypes)
    if kind == "MAMBA2" and len(ssm) == 3:
        heads, head_dim, d_state = ssm
        groups2, rest = divmod(channels - heads * head_dim, 2 * d_state)
        if rest or groups2 < 1:
            raise ConfigError(f"layer {index}: Mamba-2 conv width {channels} is not x|B|C")
        return mamba2(index, heads * tp, head_dim, groups2 * tp, d_state, rows + 1, conv_dt, ssm_dt)
    if kind == "GDN_ATTN" and len(ssm) == 3:
        v_heads, v_dim, k_dim = ssm
        k_heads2, rest = divmod(channels - v_heads * v_dim, 2 * k_dim)
        if rest or k_heads2 < 1:
            raise ConfigError(f"layer {index}: Gated DeltaNet conv width {channels} is not q|k|v")
        return gated_deltanet(
            index, k_heads2 * tp, k_dim, v_heads * tp, v_dim, rows + 1, conv_dt, ssm_dt
        )
    raise ConfigError(f"layer {index}: vLLM Mamba state {kind} of shapes {cs.shapes} not supported")


def state_shapes(cs: Any) -> tuple[tuple[tuple[int, ...], ...], tuple[Any, ...]]:
    """A ``MambaSpec``'s per-rank state shapes and dtypes (conv, then SSM)."""
    return tuple(tuple(int(x) for x in s) for s in cs.shapes), tuple(cs.dtypes)


def state_descs(
    name: str, t: Any, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[Any, ...], dim_first: bool
) -> list[TensorDesc]:
    """The conv and SSM tensors of a Mamba layer as :class:`TensorDesc` (``shapes`` and
    ``dtypes``: the per-rank ``MambaSpec`` ones, conv then SSM).

    vLLM hands the connector either the two tensors or, its hybrid allocator on CPU, the
    raw page buffer ``[blocks, …]`` of bytes; each page holds the conv state at offset 0
    and the SSM state right after it, both dense, the rest padding (measured on 0.32).
    """
    conv_shape, ssm_shape = shapes
    ci, si = (int(getattr(d, "itemsize", 0)) for d in dtypes)
    ssm_elems = math.prod(ssm_shape)
    conv_inner = (conv_shape[1], 1)
    if isinstance(t, (list, tuple)):
        if len(t) != 2:
            raise ConfigError(f"{name}: {len(t)} state tensors, expected conv and ssm")
        c, x = t
        if tuple(c.shape[1:]) != conv_shape or tuple(x.shape[1:]) != ssm_shape:
            raise ConfigError(f"{name}: state tensors {tuple(c.shape)}, {tuple(x.shape)}; {shapes}")
        if not x[0].is_contiguous() or c.element_size() != ci or x.element_size() != si:
            raise ConfigError(f"{name}: ssm state {x.dtype} {x.stride()} not dense per slot")
        nb, conv_addr = int(c.shape[0]), c.data_ptr()
        conv_strides = tuple(int(v) for v in c.stride())
        ssm = TensorDesc(x.data_ptr(), (nb, ssm_elems), (int(x.stride(0)), 1), si, "BD")
    else:
        if t.dim() < 1:
            raise ConfigError(f"{name}: Mamba page buffer of shape {tuple(t.shape)}")
        nb, page, conv_addr = int(t.shape[0]), t.stride(0) * t.element_size(), t.data_ptr()
        conv_bytes = math.prod(conv_shape) * ci
        if page % ci or page % si or conv_bytes % si or conv_bytes + ssm_elems * si > page:
            raise ConfigError(f"{name}: state {shapes} {dtypes} does not fit a {page}-byte page")
        conv_strides = (page // ci, *conv_inner)
        ssm = TensorDesc(conv_addr + conv_bytes, (nb, ssm_elems), (page // si, 1), si, "BD")
    if conv_strides[1:] != conv_inner:
        raise ConfigError(f"{name}: conv state strides {conv_strides} are not dense per slot")
    axes = "BDT" if dim_first else "BTD"
    conv = TensorDesc(conv_addr, (nb, *conv_shape), conv_strides, ci, axes)
    return [conv, ssm]


def state_views(
    layer: Layer,
    name: str,
    descs: list[TensorDesc],
    tp: int,
    tp_rank: int,
    regions: RegionSet,
) -> list[View]:
    """Views of a Mamba layer's conv and SSM tensors (one block = one request's slot).

    Each stream's segments (conv: x|B|C or q|k|v; ssm: heads) are this rank's shards laid
    side by side along the channel axis, so a segment is a unit interval at an offset.
    """
    views = []
    for stream, t in zip(layer.streams, descs, strict=True):
        item = t.itemsize
        if item != stream.dtype.itemsize:
            raise ConfigError(f"{name}: {stream.name} of {item}-byte items, spec {stream.dtype}")
        ch_stride = t.stride_bytes("D")
        row_stride = t.stride_bytes("T")
        if t.size("T") != stream.rows:
            raise ConfigError(f"{name}: {stream.name} has {t.size('T')} rows, spec {stream.rows}")
        segs, offset = _segments(stream, tp, tp_rank, item, ch_stride)
        seg_units, seg_offsets, unit_strides, unit_bytes, pieces, piece_strides = zip(
            *segs, strict=True
        )
        if offset != t.size("D"):
            raise ConfigError(
                f"{name}: {stream.name} holds {t.size('D')} elements per row; the spec's "
                f"shards on rank {tp_rank} of {tp} make {offset}"
            )
        region, base = regions.locate(t.addr, t.nbytes_spanned)
        transposed = any(p > 1 for p in pieces)
        views.append(
            View(
                layer.index,
                stream.name,
                region,
                base,
                t.stride_bytes("B"),
                stream.rows,
                t.size("B"),
                seg_units,
                seg_offsets,
                (row_stride,) * len(seg_units),
                unit_strides,
                unit_bytes,
                pieces if transposed else (),
                piece_strides if transposed else (),
            )
        )
    return views


def _segments(
    stream: Stream, tp: int, tp_rank: int, item: int, ch_stride: int
) -> tuple[list[tuple[Any, ...]], int]:
    """Per segment: units held, offset, unit stride, unit bytes, pieces, piece stride; and
    the row's elements on this rank."""
    segs = []
    offset = 0  # elements of the row before this segment
    for seg in stream.segments:
        a, b = shard_interval(seg.units, tp, tp_rank, stream.replicated)
        elems = seg.unit_bytes // item
        piece = 1 if ch_stride == item else elems
        segs.append(
            ((a, b), offset * ch_stride, elems * ch_stride, seg.unit_bytes, piece, ch_stride)
        )
        offset += (b - a) * elems
    return segs, offset
