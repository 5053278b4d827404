"""The engine's API: cache in kvbridge's layout, block tables, request lifecycle."""

from __future__ import annotations

import pytest
import torch

from kvbridge.layout import layout_names
from kvbridge.spec import Parallel
from refengine import EngineError, Instance, encode, preset
from refengine.cache import PagedCache
from refengine.spec import model_spec

pytestmark = pytest.mark.e2e

PROMPT = encode("block tables")


@pytest.mark.parametrize("layout", layout_names())
def test_cache_views_address_the_layout_bytes_and_do_not_overlap(layout: str) -> None:
    spec = model_spec(preset("kimi-linear"), block_size=4)
    cache = PagedCache(spec, Parallel(tp=2), 1, layout, num_blocks=3)
    for v in cache.layout.views:  # the corners of every view are where the layout says
        for s, seg in enumerate(cache.segments(v.layer, v.stream)):
            a, b = v.seg_units[s]
            base = v.offset + v.seg_offsets[s]
            at = (  # element [-1, -1, -1, -1]
                base
                + (v.blocks - 1) * v.block_stride
                + (v.rows - 1) * v.row_strides[s]
                + (b - a - 1) * v.unit_strides[s]
                + v.unit_bytes[s]
                - 8
            )
            seg[0, 0, 0, 0] = -1.0
            seg[-1, -1, -1, -1] = -2.0
            region = cache.regions[v.region]
            assert region[base : base + 8].view(torch.float64).item() == -1.0
            assert region[at : at + 8].view(torch.float64).item() == -2.0
    tags: dict[tuple[int, str, int], float] = {}
    for v in cache.layout.views:  # block g of group g: no two views share a byte
        for s, seg in enumerate(cache.segments(v.layer, v.stream)):
            tags[(v.layer, v.stream, s)] = float(len(tags) + 1)
            seg[spec.group_of(v.layer)] = tags[(v.layer, v.stream, s)]
    for (layer, stream, s), tag in tags.items():
        block = cache.segments(layer, stream)[s][spec.group_of(layer)]
        assert bool((block == tag).all()), (layer, stream, s)


def test_regions_match_the_layout_and_are_distinct() -> None:
    with Instance("jamba", layout="block-major") as inst:
        regions = inst.regions(0)
        assert tuple(n for _, n in regions) == inst.layout(0).regions
        assert len({a for a, _ in regions}) == len(regions)


def test_tables_grow_with_decode_and_free_returns_blocks() -> None:
    with Instance("gemma", block_size=4, num_blocks=8) as inst:
        pre = inst.prefill("a", PROMPT)
        assert [len(t) for t in pre.tables] == [4, 4]  # 13 tokens, 4-token blocks
        inst.decode("a", 5)
        assert [len(t) for t in inst.tables("a")] == [5, 5]  # 18 tokens computed
        with pytest.raises(EngineError, match="blocks needed"):
            inst.prefill("b", PROMPT)
        inst.free("a")
        inst.prefill("b", PROMPT)


def test_shared_pool_groups_draw_distinct_ids() -> None:
    with Instance("kimi-linear", layout="shared-pool", num_blocks=16) as inst:
        tables = inst.prefill("a", PROMPT).tables
        ids = [i for t in tables for i in t]
        assert len(ids) == len(set(ids))


def test_lifecycle_is_checked() -> None:
    with Instance("llama") as inst:
        inst.reserve("r", PROMPT)
        with pytest.raises(EngineError, match="waiting for KV, not running"):
            inst.decode("r", 1)
        inst.start_decode("r", 7)
        with pytest.raises(EngineError, match="running, not waiting"):
            inst.start_decode("r", 7)
        with pytest.raises(EngineError, match="already exists"):
            inst.prefill("r", PROMPT)
        with pytest.raises(EngineError, match="out of vocab"):
            inst.prefill("s", [1, 999])
        with pytest.raises(EngineError, match="no request"):
            inst.free("t")
