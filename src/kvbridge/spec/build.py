"""Builders of layers, one per cache kind, in the words engines use. The ``config.json``
readers (:mod:`kvbridge.spec.hf`) call these too, so a spec built by hand and one
loaded from the model's config have the same streams and the same compat hash."""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.spec.dtypes import DType
from kvbridge.spec.info import default_groups
from kvbridge.spec.model import Kind, Layer, ModelSpec, Segment, Stream


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
    """Mamba-2 state: ``conv_state [kernel-1, x|B|C]`` (x: heads × head_dim, B and C:
    n_groups × d_state) and ``ssm_state [heads, head_dim, d_state]``."""
    conv = state_tensor(
        "conv_state",
        conv_kernel - 1,
        [(heads, head_dim), (n_groups, d_state), (n_groups, d_state)],
        conv_dtype,
    )
    ssm = state_tensor("ssm_state", 1, [(heads, head_dim * d_state)], ssm_dtype)
    return state(index, [conv, ssm])


def mamba1(
    index: int,
    d_inner: int,
    d_state: int,
    conv_kernel: int,
    conv_dtype: DType = DType.BF16,
    ssm_dtype: DType = DType.BF16,
) -> Layer:
    """Mamba-1 state: ``conv_state [kernel-1, d_inner]`` and ``ssm_state [d_inner,
    d_state]``, both sharded by channel (``d_inner`` units)."""
    conv = state_tensor("conv_state", conv_kernel - 1, [(d_inner, 1)], conv_dtype)
    ssm = state_tensor("ssm_state", 1, [(d_inner, d_state)], ssm_dtype)
    return state(index, [conv, ssm])


def gated_deltanet(
    index: int,
    k_heads: int,
    k_dim: int,
    v_heads: int,
    v_dim: int,
    conv_kernel: int,
    conv_dtype: DType = DType.BF16,
    state_dtype: DType = DType.BF16,
) -> Layer:
    """Gated DeltaNet state: ``conv_state [kernel-1, q|k|v]`` (q, k: k_heads × k_dim,
    v: v_heads × v_dim) and ``recurrent_state [v_heads, k_dim, v_dim]``."""
    conv_segs = [(k_heads, k_dim), (k_heads, k_dim), (v_heads, v_dim)]
    conv = state_tensor("conv_state", conv_kernel - 1, conv_segs, conv_dtype)
    rec = state_tensor("recurrent_state", 1, [(v_heads, k_dim * v_dim)], state_dtype)
    return state(index, [conv, rec])


def kimi_delta(
    index: int,
    heads: int,
    head_dim: int,
    conv_kernel: int,
    conv_dtype: DType = DType.BF16,
    state_dtype: DType = DType.FP32,
) -> Layer:
    """Kimi Delta Attention state: ``conv_state_{q,k,v} [kernel-1, heads·head_dim]`` and
    ``recurrent_state [heads, head_dim, head_dim]`` (float32 unless told: serving engines
    keep it so)."""
    convs = [
        state_tensor(f"conv_state_{x}", conv_kernel - 1, [(heads, head_dim)], conv_dtype)
        for x in "qkv"
    ]
    rec = state_tensor("recurrent_state", 1, [(heads, head_dim * head_dim)], state_dtype)
    return state(index, [*convs, rec])


def group_by_kind(name: str, layers: Sequence[Layer], block_size: int = 16) -> ModelSpec:
    """A spec grouped as a loaded config is (:func:`kvbridge.spec.info.default_groups`)."""
    return ModelSpec(name, tuple(layers), default_groups(layers, block_size))
