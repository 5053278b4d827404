"""Parking (integrations/vllm/park.py): vLLM's caches, made by vLLM's own allocation code
(every ``KVCacheLayout``, MLA, kernel blocks, Mamba state sharing attention's pages), are
copied block by block into a park; every byte of every copied block, read back through
the park's described layout by the ``View`` formula alone, must equal the byte vLLM's
block holds at the same place, and park blocks not copied into keep their old bytes."""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvbridge.api import ConfigError, TransportError
from kvbridge.connector.movers import device_copies
from kvbridge.integrations.vllm import park as park_mod
from kvbridge.integrations.vllm.gpu_layout import LAYOUTS, Placement
from kvbridge.integrations.vllm.park import Order, Park, slabs
from tests.unit import test_vllm_gpu_layout as tvgl
from tests.unit.test_vllm_gpu_layout import (
    KINDS,
    attn_engine,
    describe,
    fill,
    hybrid,
    read_view,
)

PARK = 5
SRC = [[4, 1, 5]]
DST = [[3, 1, 2]]


def filled(caches: dict) -> None:
    for i, name in enumerate(sorted(caches)):
        for j, t in enumerate(caches[name] if isinstance(caches[name], list) else [caches[name]]):
            fill(t, (2 * i + j) << 20)


def check_copy(placed: Placement, src: list, dst: list) -> None:
    park = Park(placed, PARK)
    for d in park.dst:
        d.fill_(0xAB)
    park.copy([Order("r", src, dst)])
    assert len(park.layout.views) == len(placed.layout.views)
    for v, pv in zip(placed.layout.views, park.layout.views, strict=True):
        g = placed.spec.group_of(v.layer)
        s = placed.splits[g]
        raw, praw = park.src[v.region].numpy(), park.dst[pv.region].numpy()
        for seg in range(len(v.seg_units)):
            got = read_view(praw, pv, seg, 1)
            want = read_view(raw, v, seg, 1)
            assert got.shape[1:] == want.shape[1:] and got.shape[0] == PARK * s
            for b, p in zip(src[g], dst[g], strict=True):
                if not b:
                    continue  # null: not copied (its park block is checked as kept)
                for k in range(s):
                    assert np.array_equal(got[p * s + k], want[b * s + k]), (v, b, p)
            # groups sharing a region (one vLLM pool) write each other's pages
            pairs = [bp for t in zip(src, dst, strict=True) for bp in zip(*t, strict=True)]
            written = {p * s + k for b, p in pairs if b for k in range(s)}
            kept = set(range(PARK * s)) - written
            assert all((got[i] == 0xAB).all() for i in kept), (v.layer, v.stream)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("block", "kernel"), [(16, None), (32, 16)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_park_copies_every_byte_of_each_block(
    layout: str, block: int, kernel: int | None, kind: str
) -> None:
    try:
        eng = attn_engine(kind, layout, block, kernel)
    except ValueError:  # vLLM itself refuses kernel blocks in this layout
        return
    filled(eng[0])
    placed = describe(kind, eng, 1, 0, layout)
    check_copy(placed, SRC, DST)


def test_a_layout_interleaving_blocks_is_refused() -> None:
    """A view whose tokens lie a block apart (``[N, B, …]``, no vLLM layout): a block's
    bytes are no slab."""
    eng = attn_engine("kv", "LBNHC", 16, None)
    placed = describe("kv", eng, 1, 0, "LBNHC")
    lay = placed.layout
    v = lay.views[0]
    bad = dataclasses.replace(v, row_strides=(v.block_stride,) * len(v.row_strides), rows=2)
    views = (bad, *lay.views[1:])
    with pytest.raises(ConfigError, match="interleaves blocks"):
        slabs(dataclasses.replace(lay, views=views), placed.spec.group_of, placed.splits)


def split_hybrid(kind: str) -> tuple[Any, Placement]:
    """:func:`hybrid` with the attention group in kernel blocks of 16 (its vLLM blocks of
    32 split in two; the state group's pages whole), from vLLM's own allocation."""
    real = tvgl.allocate_kv_cache
    with mock.patch.object(
        tvgl, "allocate_kv_cache", lambda c, d, lay, _k: real(c, d, lay, [32, 16])
    ):
        return hybrid(kind, "SD", "LBHNC", 1)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kind", ["MAMBA2", "GDN_ATTN"])
def test_park_copies_state_and_attention_sharing_pages(kind: str, split: bool) -> None:
    eng, placed = split_hybrid(kind) if split else hybrid(kind, "SD", "LBHNC", 1)
    assert placed.splits == ((1, 2) if split else (1, 1))
    filled(eng[0])
    # one vLLM pool: the state group's slot and the attention blocks are distinct ids
    check_copy(placed, [[2], [4, 5]], [[3], [1, 4]])


def test_a_group_this_rank_holds_no_layer_of_counts_the_park() -> None:
    """A PP stage of attention layers only (the state group's layers on another stage):
    the park still counts ``park_blocks`` for the state group, as the rank's layout
    counts vLLM's pool (a handle checked against 0 blocks would fail)."""
    _eng, placed = split_hybrid("MAMBA2")  # the memory placed describes, kept
    lay = placed.layout
    views = tuple(v for v in lay.views if placed.spec.group_of(v.layer) == 1)
    stage = dataclasses.replace(placed, layout=dataclasses.replace(lay, views=views))
    park = Park(stage, PARK)
    assert park.layout.num_blocks == (PARK, 2 * PARK)


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_a_wrong_park_fails_the_check(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous: a park whose K and V views are swapped, or whose copy
    writes nothing, fails it."""
    eng = attn_engine("kv", layout, 16, None)
    filled(eng[0])
    placed = describe("kv", eng, 1, 0, layout)
    check_copy(placed, SRC, DST)
    real = park_mod.park_layout

    def swapped(lay: Any, parts: Any, splits: Any, n: int) -> Any:  # K where V is
        got = real(lay, parts, splits, n)
        at = {(v.layer, v.stream): v.offset for v in got.views}
        views = tuple(
            dataclasses.replace(v, offset=at[(v.layer, "v" if v.stream == "k" else "k")])
            for v in got.views
        )
        return dataclasses.replace(got, views=views)

    monkeypatch.setattr(park_mod, "park_layout", swapped)
    with pytest.raises(AssertionError):
        check_copy(placed, SRC, DST)
    monkeypatch.undo()
    monkeypatch.setattr(Park, "copy", lambda self, orders: None)
    with pytest.raises(AssertionError):
        check_copy(placed, SRC, DST)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_park_copies_rank_1_of_tp_2(layout: str) -> None:
    """A rank's slice of the heads (its view's offsets and strides those of its heads)."""
    eng = attn_engine("kv", layout, 16, None, tp=2)
    filled(eng[0])
    check_copy(describe("kv", eng, 2, 1, layout), SRC, DST)


def test_gathers_of_one_block_and_null_entries_copy_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bounded gathers (``CHUNK_WORDS`` down to one block plane per gather) copy every block;
    a null entry (vLLM's block 0, a dropped block) is not copied: park block 0 keeps its
    bytes."""
    monkeypatch.setattr(device_copies, "CHUNK_WORDS", 1)
    eng = attn_engine("kv", "BLNHC", 16, None)
    filled(eng[0])
    placed = describe("kv", eng, 1, 0, "BLNHC")
    check_copy(placed, [[4, 0, 1, 5]], [[3, 0, 1, 2]])


@pytest.mark.parametrize(("src", "dst", "what"), [
    ([[4, 1, 5]], [[3, 1, PARK]], "park slot"),  # one slot past the park: the next plane
    ([[4, 1, 5]], [[3, -1, 2]], "park slot"),
    ([[4, 1, 10_000]], [[3, 1, 2]], "vLLM block"),
])  # fmt: skip
def test_an_id_out_of_range_is_refused_before_any_byte_moves(src, dst, what) -> None:
    """A slot past the park (or a block past vLLM's) whose bytes would still lie inside
    the region (another plane's block): refused, nothing copied."""
    eng = attn_engine("kv", "LBNHC", 16, None)
    filled(eng[0])
    park = Park(describe("kv", eng, 1, 0, "LBNHC"), PARK)
    for d in park.dst:
        d.fill_(0xAB)
    with pytest.raises(TransportError, match=what):
        park.copy([Order("r", src, dst)])
    assert all(bool((d == 0xAB).all()) for d in park.dst)
