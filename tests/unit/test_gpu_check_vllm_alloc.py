"""gpu-check's reproduction of vLLM 0.32's KV cache allocation
(``benchmarks/gpu_check/vllm_alloc.py``, for the GPU machine, which has no vLLM) against
vLLM's own functions, here: for each of the six ``KVCacheLayout``s, K|V, K and V of different
sizes, MLA, kernel blocks, and Mamba-2 / Gated DeltaNet hybrids with conv SD and DS, every
layer's view must have vLLM's shape, strides, offset, dtype and allocation size (or both
refuse), and a Mamba page must split into vLLM's conv and SSM views. The state shapes the
phase uses are vLLM's ``MambaStateShapeCalculator``'s. A change in vLLM breaks this test,
not silently the GPU check."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm")
import torch
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)

from benchmarks.gpu_check import vllm_alloc as ours
from benchmarks.gpu_check.vllm_cases import ATTENTION, STATE_SHAPES, attention_specs, hybrid_groups
from kvbridge.integrations.vllm.gpu_layout import LAYOUTS
from tests.unit.test_vllm_gpu_layout import allocate

NB = 5


def theirs(groups: list[Any], layout: str, kernel: int | None) -> dict[str, Any]:
    """vLLM's own views of ``groups`` (vLLM's records)."""
    return allocate(groups, layout, kernel, NB)[0]


def as_vllm(g: ours.KVCacheGroupSpec) -> Any:
    """The same group as vLLM's records."""
    s = g.kv_cache_spec
    if isinstance(s, ours.MambaSpec):
        spec: Any = MambaSpec(
            block_size=s.block_size,
            shapes=s.shapes,
            dtypes=s.dtypes,
            page_size_padded=s.page_size_padded,
            mamba_type=MambaAttentionBackendEnum[s.mamba_type],
        )
    elif isinstance(s, ours.MLAAttentionSpec):
        spec = MLAAttentionSpec(
            block_size=s.block_size, num_kv_heads=1, head_size=s.head_size, dtype=s.dtype
        )
    else:
        spec = FullAttentionSpec(
            block_size=s.block_size,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_size,
            head_size_v=s.head_size_v,
            dtype=s.dtype,
        )
    return KVCacheGroupSpec(list(g.layer_names), spec)


def facts(t: Any) -> tuple:
    return (
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.untyped_storage().nbytes(),
    )


def same(groups: list[ours.KVCacheGroupSpec], layout: str, kernel: int | None = None) -> None:
    try:
        want = {
            n: facts(t) for n, t in theirs([as_vllm(g) for g in groups], layout, kernel).items()
        }
    except ValueError:
        with pytest.raises(ValueError):
            ours.allocate(groups, layout, NB, torch.device("cpu"), kernel)
        return
    got, cfg = ours.allocate(groups, layout, NB, torch.device("cpu"), kernel)
    assert {n: facts(t) for n, t in got.items()} == want
    assert cfg.num_blocks == NB


@pytest.mark.parametrize("kind", list(ATTENTION))
@pytest.mark.parametrize(("block", "kernel"), [(16, None), (32, None), (32, 16)])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_views_are_vllms(
    layout: str, tp: int, block: int, kernel: Any, kind: str
) -> None:
    same(
        [
            ours.KVCacheGroupSpec(
                ["m.layers.0.attn", "m.layers.1.attn"], attention_specs(kind, block, tp)
            )
        ],
        layout,
        kernel,
    )


@pytest.mark.parametrize("kind", ["MAMBA2", "GDN_ATTN"])
@pytest.mark.parametrize("conv", ["SD", "DS"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_views_and_state_split_are_vllms(layout: str, conv: str, kind: str) -> None:
    groups = hybrid_groups(kind, conv, 32)
    same(groups, layout)
    caches, _ = ours.allocate(groups, layout, NB, torch.device("cpu"))
    spec = groups[0].kv_cache_spec
    assert isinstance(spec, ours.MambaSpec)
    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer, caches["m.layers.0.mixer"])
    mine = ours.split_state(caches["m.layers.0.mixer"], spec)
    assert [facts(x) for x in mine] == [facts(x) for x in layer.kv_cache]


@pytest.mark.parametrize("conv", ["SD", "DS"])
def test_state_shapes_are_vllms(conv: str) -> None:
    """The phase's Mamba-2 and GDN state shapes are what vLLM computes for its models."""
    calc = mamba_utils.MambaStateShapeCalculator
    with mock.patch.object(mamba_utils, "is_conv_state_dim_first", lambda: conv == "DS"):
        want = {
            "MAMBA2": calc.mamba2_state_shape(1, 32, 2, 4, 8, 6, 4),
            "GDN_ATTN": calc.gated_delta_net_state_shape(1, 2, 4, 8, 4, 4),
        }
    assert {k: STATE_SHAPES[k](conv == "DS") for k in want} == want
