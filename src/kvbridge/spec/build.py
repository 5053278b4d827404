"""Helpers that build layers the way engines describe them."""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.spec.dtypes import DType
from kvbridge.spec.model import Group, Kind, Layer, ModelSpec, Segment, Stream


def attention(
    index: int,
    kv_heads: int,
    head_dim: int,
    dtype: DType = DType.BF16,
    kind: Kind = Kind.FULL,
    window: int = 0,
    chunk: int = 0,
    v_head_dim: int | None = None,
) -> Layer:
    """A K/V attention layer: streams ``k`` and ``v`` of ``kv_heads`` head units."""
    k = Stream("k", (Segment(kv_heads, head_dim * dtype.itemsize),), dtype)
    vdim = head_dim if v_head_dim is None else v_head_dim
    v = Stream("v", (Segment(kv_heads, vdim * dtype.itemsize),), dtype)
    return Layer(index, kind, (k, v), window=window, chunk=chunk)


def mla(index: int, latent_width: int, dtype: DType = DType.BF16) -> Layer:
    """An MLA layer: one ``latent`` stream of ``latent_width`` elements, replicated."""
    seg = Segment(1, latent_width * dtype.itemsize)
    return Layer(index, Kind.MLA, (Stream("latent", (seg,), dtype, replicated=True),))


def state_tensor(
    name: str,
    rows: int,
    segments: Sequence[tuple[int, int]],
    dtype: DType = DType.BF16,
    replicated: bool = False,
) -> Stream:
    """A per-sequence tensor: ``rows`` rows of segments ``(units, elements per unit)``."""
    segs = tuple(Segment(u, e * dtype.itemsize) for u, e in segments)
    return Stream(name, segs, dtype, rows=rows, replicated=replicated)


def state(index: int, tensors: Sequence[Stream]) -> Layer:
    return Layer(index, Kind.STATE, tuple(tensors))


def mamba2(
    index: int,
    heads: int,
    head_dim: int,
    n_groups: int,
    d_state: int,
    conv_kernel: int,
    conv_dtype: DType = DType.BF16,
    ssm_dtype: DType = DType.BF16,
) -> Layer:
    """Mamba-2 state: conv ``[kernel-1, x|B|C]`` and SSM ``[heads, head_dim, d_state]``."""
    conv = state_tensor(
        "conv",
        conv_kernel - 1,
        [(heads, head_dim), (n_groups, d_state), (n_groups, d_state)],
        conv_dtype,
    )
    ssm = state_tensor("ssm", 1, [(heads, head_dim * d_state)], ssm_dtype)
    return state(index, [conv, ssm])


def group_by_kind(name: str, layers: Sequence[Layer], block_size: int = 16) -> ModelSpec:
    """A spec with one group per layer kind present (state layers in their own group)."""
    groups: dict[str, list[int]] = {}
    for lay in layers:
        key = "state" if lay.kind is Kind.STATE else "attn"
        if lay.kind is Kind.SLIDING or lay.kind is Kind.CHUNKED:
            key = str(lay.kind)
        groups.setdefault(key, []).append(lay.index)
    grps = tuple(Group(k, tuple(v), 1 if k == "state" else block_size) for k, v in groups.items())
    return ModelSpec(name, tuple(layers), grps)
