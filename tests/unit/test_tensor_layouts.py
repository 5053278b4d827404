"""Engine-allocated tensors described in place (layout/tensor.py), including units kept in
parts (K transposed per head, as vLLM's CPU kernels keep it), planned and moved byte-exact
against the element-wise reference; and bad descriptions refused."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import LayoutError
from kvbridge.layout.tensor import RegionSet, TensorDesc, tensor_views
from kvbridge.layout.view import RankLayout, View
from kvbridge.spec.build import attention
from kvbridge.spec.dtypes import DType
from kvbridge.spec.model import Group, Kind, ModelSpec
from kvbridge.spec.parallel import Parallel, shard_interval
from tests.support.scenario import Side, run_scenario

HEADS, HD = 4, 8


def spec(block: int, kinds: tuple[Kind, ...] = (Kind.FULL,) * 3) -> ModelSpec:
    layers = tuple(attention(i, HEADS, HD, DType.FP32, k, window=7) for i, k in enumerate(kinds))
    groups = tuple(
        Group(f"g{k}", tuple(i for i, x in enumerate(kinds) if x is k), block)
        for k in dict.fromkeys(kinds)
    )
    return ModelSpec("t", layers, groups)


def transposed_k_layout(s: ModelSpec, par: Parallel, rank: int, blocks: int) -> RankLayout:
    """One tensor per layer ``[blocks, heads, block, 2·head]``: K ``[head][token]`` then V
    ``[token][head]`` per block and head (vLLM's CPU cache); regions at offset 0."""
    regions = RegionSet()
    views: list[View] = []
    item = 4
    for lay in s.layers:
        bs = s.groups[s.group_of(lay.index)].block_size
        heads = shard_interval(HEADS, par.tp, rank)
        h = heads[1] - heads[0]
        base = sum(regions.sizes)
        regions.add(base, blocks * h * bs * 2 * HD * item)
        s0, s1 = h * bs * 2 * HD, bs * 2 * HD
        k = TensorDesc(base, (blocks, h, HD, bs), (s0, s1, bs, 1), item, "BHDT")
        v = TensorDesc(base + bs * HD * item, (blocks, h, bs, HD), (s0, s1, HD, 1), item, "BHTD")
        views += tensor_views(lay.index, k, ("k",), heads, regions)
        views += tensor_views(lay.index, v, ("v",), heads, regions)
    sizes = tuple(g.block_size for g in s.groups)
    return RankLayout(
        regions.sizes, tuple(views), sizes, (blocks,) * len(s.groups), (0,) * len(s.groups)
    )


def side(
    block: int, tp: int, named: str | None, kinds: tuple[Kind, ...] = (Kind.FULL,) * 3
) -> Side:
    s, par, blocks = spec(block, kinds), Parallel(tp), 64
    if named is not None:
        return Side(s, par, named, blocks)
    layouts = [transposed_k_layout(s, par, r, blocks) for r in range(tp)]
    return Side(s, par, "custom", blocks, layouts=layouts)


@pytest.mark.parametrize(
    ("p", "d"),
    [
        ((32 // 8, 1, None), (16, 1, None)),  # 4 → 16, both transposed
        ((16, 1, None), (4, 1, None)),  # 16 → 4
        ((4, 2, None), (6, 1, None)),  # TP 2 → 1, 4 → 6 (not divisible)
        ((6, 1, None), (4, 4, None)),  # TP 1 → 4
        ((4, 1, None), (8, 2, "nhd")),  # transposed → NHD
        ((8, 2, "hnd"), (4, 1, None)),  # HND → transposed
    ],
)
@pytest.mark.parametrize("cached", [0, 8])
def test_transposed_units_byte_exact(p: tuple, d: tuple, cached: int) -> None:
    run_scenario(side(*p), side(*d), 45, cached, np.random.default_rng(7))


def test_sliding_and_full_groups_byte_exact() -> None:
    kinds = (Kind.SLIDING, Kind.FULL, Kind.SLIDING)
    run_scenario(side(4, 1, None, kinds), side(16, 2, None, kinds), 50, 0, np.random.default_rng(3))


def test_same_block_size_keeps_whole_blocks_as_runs() -> None:
    plans = run_scenario(side(8, 1, None), side(8, 1, None), 64, 0, np.random.default_rng(1),
                         shuffle=False)  # fmt: skip
    # 3 layers, K|V of one block and all heads adjacent, consecutive ids: one run per layer
    assert plans[0].descriptors == 3


@pytest.mark.parametrize("kinds", [(Kind.FULL,) * 3, (Kind.SLIDING, Kind.FULL, Kind.SLIDING)])
def test_padded_blocks_are_one_run_not_one_per_element(kinds) -> None:
    """The vLLM connector's case: 61 tokens in blocks of 8 end inside block 8, and a
    window of 7 starts inside block 7 (token 54); the transposed K cuts every element of
    a partial block into its own run (HD × heads runs per layer and partial block). With
    ``pad_blocks`` partial blocks move whole: one run per layer over consecutive ids;
    bytes of the needed tokens exact (run_scenario checks every byte)."""
    rng = np.random.default_rng

    def plan(n: int, pad: bool):
        a, b = side(8, 1, None, kinds), side(8, 1, None, kinds)
        return run_scenario(a, b, n, 0, rng(1), shuffle=False, pad_blocks=pad)[0]

    exact, padded = plan(61, False), plan(61, True)
    assert exact.descriptors > 3 * HD * HEADS  # K: one run per element and layer
    assert padded.descriptors == len(kinds)
    if Kind.SLIDING not in kinds:
        assert padded.nbytes == plan(64, False).nbytes


def test_bad_descriptions_are_refused() -> None:
    with pytest.raises(LayoutError, match="differ in length"):
        TensorDesc(0, (2, 3), (3, 1, 1), 4, "BD")
    with pytest.raises(LayoutError, match="each of"):
        TensorDesc(0, (2, 3), (3, 1), 4, "BB")
    with pytest.raises(LayoutError, match="block axis"):
        TensorDesc(0, (2, 3), (3, 1), 4, "TD")
    regions = RegionSet()
    regions.add(0, 100)
    with pytest.raises(LayoutError, match="overlaps"):
        regions.add(50, 100)
    with pytest.raises(LayoutError, match="no registered region"):
        tensor_views(0, TensorDesc(90, (2, 8), (8, 1), 4, "BD"), ("k",), (0, 1), regions)
    with pytest.raises(LayoutError, match="H axis"):
        tensor_views(0, TensorDesc(0, (2, 2, 4), (8, 4, 1), 1, "BHD"), ("k",), (0, 3), regions)
