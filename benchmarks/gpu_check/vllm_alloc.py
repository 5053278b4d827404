"""vLLM 0.32's KV cache allocation, reproduced for a machine without vLLM (the GPU
machine of ``make gpu-check``): the spec records the connector reads, the allocation plan
(``vllm/v1/core/kv_cache_utils.py``: ``get_kv_cache_config_from_groups``) and the per-layer
``[B, H, N, C]`` views (``vllm/v1/kv_cache_interface.py``: ``compute_layer_kv_cache_shape_bytes``,
``compute_layout_strides``, ``create_kv_cache_views``; ``vllm/v1/worker/utils.py``:
``allocate_kv_cache``), and a Mamba page's split into conv and SSM state
(``MambaBase.bind_kv_cache``). Only what the phase uses: full attention, MLA and Mamba specs,
no hisparse, no alignment, one allocation. ``tests/unit/test_gpu_check_vllm_alloc.py`` pins
every view (shape, strides, offset, dtype) against vLLM's own functions.

Logical axes ``[L, B, H, N, C]``: layers, blocks, head slots, states per block, content bytes;
a layout names their order in memory, outermost first."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

ORDERS = {  # KVCacheLayout's value: logical axis per physical position, outermost first
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
_L, _B = 0, 1


@dataclass(frozen=True)
class FullAttentionSpec:
    """vLLM's spec of the same name: a page is ``[H heads, N tokens, K|V]``."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        if self.head_size_v is None:  # as vLLM's: V of K's size unless told
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads

    def states(self, block: int) -> int:
        return block

    @property
    def content(self) -> int:
        """Bytes per (head, token): K then V."""
        return (self.head_size + (self.head_size_v or 0)) * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.num_heads * self.block_size * self.content


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """One latent per token (``head_size`` elements), one head slot, no V."""

    head_size_v: int | None = 0


@dataclass(frozen=True)
class MambaSpec:
    """Conv then SSM state, one slot per block, the page padded to ``page_size_padded``."""

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None
    mamba_type: str = "MAMBA2"
    num_heads: int = 1

    def states(self, block: int) -> int:
        return 1

    @property
    def content(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.content


Spec = FullAttentionSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Spec


def _shape(spec: Spec, blocks: int, kernel: int | None = None) -> tuple[int, int, int, int]:
    """``(B, H, N, C)`` of one layer, C in bytes (kernel blocks: ``B`` counts them)."""
    bs = kernel or spec.block_size
    assert spec.block_size % bs == 0, (spec.block_size, bs)
    return blocks * (spec.block_size // bs), spec.num_heads, spec.states(bs), spec.content


def strides(
    spec: Spec,
    blocks: int,
    layers: int,
    layout: str,
    kernel: int | None = None,
    fixed: tuple[int | None, ...] = (None,) * 5,
) -> tuple[int, ...]:
    """Byte strides in logical ``[L, B, H, N, C]`` order: dense in the layout's order,
    ``fixed`` ones kept, a padded page's grid (L and B, and what lies outside them) a
    multiple of the padded page."""
    shape = (layers, *_shape(spec, blocks, kernel))
    order = ORDERS[layout]
    padded, grid_end = spec.page_size_padded, max(order.index(_L), order.index(_B)) + 1
    if padded is not None:
        assert math.prod(shape[d] for d in order[:grid_end]) == layers * blocks, layout
    out, current = [0] * 5, 1
    for pos, dim in reversed(tuple(enumerate(order))):
        if padded is not None and pos == grid_end - 1:
            current = max(current, padded)
        out[dim] = fixed[dim] or current
        current = out[dim] * shape[dim]
    return tuple(out)


def check_layout(layout: str, groups: list[KVCacheGroupSpec]) -> None:
    """vLLM's ``validate_kv_cache_layout``: mixed page sizes need a block-compact layout
    (and, with several groups, the layer axis inside the block axis)."""
    pages = {g.kv_cache_spec.page_size_bytes for g in groups for _ in g.layer_names}
    order = ORDERS[layout]
    if len(pages) > 1 and (set(order[:2]) != {_L, _B} or (len(groups) > 1 and order[0] == _L)):
        raise ValueError(f"KV cache layout {layout} cannot express mixed page sizes {pages}")


def plan(groups: list[KVCacheGroupSpec], layout: str, blocks: int) -> tuple[int, list[Any]]:
    """Bytes of the allocation and, per group, ``(offset, layer stride, block stride)``
    of its layers (every group aliases the allocation from byte 0)."""
    check_layout(layout, groups)
    outer = ORDERS[layout][0] == _B
    per_block = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
    places = []
    for g in groups:
        spec, n = g.kv_cache_spec, len(g.layer_names)
        fixed = (None, per_block if outer else None, None, None, None)
        layer_stride, block_stride = strides(spec, blocks, n, layout, fixed=fixed)[:2]
        places.append((0, layer_stride, block_stride))
    return per_block * blocks, places


def allocate(
    groups: list[KVCacheGroupSpec],
    layout: str,
    blocks: int,
    device: torch.device,
    kernel: int | None = None,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Per layer name its ``[B, H, N, C]`` view of one zeroed int8 allocation on
    ``device`` (in the spec's dtype; Mamba: int8), and what the connector reads of vLLM's
    ``KVCacheConfig`` (``num_blocks``, ``kv_cache_groups``). ``kernel``: kernel block size
    of the attention groups (vLLM raises ``ValueError`` where pages are not dense)."""
    size, places = plan(groups, layout, blocks)
    buf = torch.zeros(size, dtype=torch.int8, device=device)
    caches: dict[str, torch.Tensor] = {}
    for g, (offset, layer_stride, block_stride) in zip(groups, places, strict=True):
        spec = g.kv_cache_spec
        k = kernel if isinstance(spec, FullAttentionSpec) else None
        shape = _shape(spec, blocks, k)
        ratio = shape[0] // blocks
        if ratio > 1:
            if block_stride != math.prod(_shape(spec, 1)[1:]):
                raise ValueError(f"{layout} does not store blocks as dense, unpadded pages")
            block_stride //= ratio
        fixed = (layer_stride, block_stride, None, None, None)
        st = strides(spec, blocks, len(g.layer_names), layout, k, fixed)
        view = torch.as_strided(buf, (len(g.layer_names), *shape), st, offset)
        dtype = getattr(spec, "dtype", None)
        for i, name in enumerate(g.layer_names):
            caches[name] = view[i] if dtype is None else view[i].view(dtype)
    return caches, SimpleNamespace(num_blocks=blocks, kv_cache_groups=groups)


def split_state(t: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, ...]:
    """A Mamba layer's int8 page view ``[B, 1, 1, C]`` as its states ``[B, *shape]`` in
    their dtypes, dense one after another from each page's start (``bind_kv_cache``)."""
    pages = t.squeeze(dim=(1, 2))
    out, at = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(pages[:, at : at + nbytes].view(dtype).view(-1, *shape))
        at += nbytes
    return tuple(out)
