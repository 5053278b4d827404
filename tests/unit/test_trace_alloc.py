"""The allocator trace of the trace benchmark: deterministic, never hands a live block
out twice, loses no block, keeps lengths within bounds; and the byte pattern the
benchmark checks every transfer with."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest

from benchmarks import trace_pattern as pat
from benchmarks.trace_alloc import BlockPool, TraceConfig, simulate
from benchmarks.trace_case import Case, allocate, layouts, model_spec, sizing
from kvbridge.errors import ConfigError
from kvbridge.plan import Bound, Geometry, Side
from kvbridge.spec import Parallel

CFG = TraceConfig(blocks=400, median_tokens=60, max_tokens=800, slots=40, seed=7)


def _flat(reqs: list) -> list[tuple]:
    return [(r.index, r.tokens, r.p_blocks.tolist(), r.d_blocks.tolist(), r.p_slot, r.d_slot)
            for r in reqs]  # fmt: skip


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a, _ = simulate(CFG, 30)
    b, _ = simulate(CFG, 30)
    c, _ = simulate(replace(CFG, seed=8), 30)
    assert _flat(a) == _flat(b)
    assert _flat(a) != _flat(c)


def test_no_block_handed_out_twice_while_live() -> None:
    _, sim = simulate(CFG, 60, record=True)
    assert sim.events
    held: dict[str, set[int]] = {}
    for pool, op, _, ids in sim.events:
        live = held.setdefault(pool, set())
        if op == "alloc":
            assert not live & set(ids), f"{pool}: {sorted(live & set(ids))} handed out twice"
            assert len(set(ids)) == len(ids)
            live |= set(ids)
        else:
            assert set(ids) <= live, f"{pool}: freeing {sorted(set(ids) - live)} not held"
            live -= set(ids)


def test_every_freed_block_comes_back() -> None:
    _, sim = simulate(CFG, 60, record=True)
    for side in (sim.p, sim.d):
        side.drain()
        assert sorted(side.blocks.free_ids()) == list(range(CFG.blocks))
        assert side.slots is not None
        assert sorted(side.slots.free_ids()) == list(range(CFG.slots))
    assert sim.events is not None
    allocs = {(pool, i) for pool, op, _, ids in sim.events if op == "alloc" for i in ids}
    assert {i for pool, i in allocs if pool == "D"} == set(range(CFG.blocks))  # pool cycled


def test_free_queue_is_fifo_with_freed_blocks_reversed() -> None:
    pool = BlockPool("P", 8)
    first = pool.allocate(3, req=0)
    assert first == [0, 1, 2]
    pool.free(first, req=0)
    assert pool.free_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.allocate(7, req=1) == [3, 4, 5, 6, 7, 2, 1]
    with pytest.raises(ConfigError):
        pool.allocate(2, req=2)


def test_lengths_and_tables_within_bounds() -> None:
    reqs, sim = simulate(CFG, 80)
    tokens = np.array([r.tokens for r in reqs])
    assert tokens.min() >= 1 and tokens.max() <= CFG.max_tokens
    assert len(set(tokens.tolist())) > 10  # a spread, not a constant
    for r in reqs:
        need = -(-r.tokens // CFG.block_tokens)
        assert r.p_blocks.shape == r.d_blocks.shape == (need,)
        for ids in (r.p_blocks, r.d_blocks):
            assert ids.min() >= 0 and ids.max() < CFG.blocks and len(set(ids.tolist())) == need
        assert 0 <= r.p_slot < CFG.slots and 0 <= r.d_slot < CFG.slots
    assert 0 < len(sim.p.live) <= 2 * CFG.live and 0 < len(sim.d.live) <= 2 * CFG.live


def test_fragmented_after_warm_up() -> None:
    reqs, _ = simulate(CFG, 80)
    long = [r for r in reqs if len(r.p_blocks) >= 4]
    breaks = [int(np.count_nonzero(np.diff(r.p_blocks) != 1)) for r in long]
    assert long and sum(breaks) > 0  # ids no longer one consecutive range


def test_pool_too_small_for_the_cap_is_refused() -> None:
    with pytest.raises(ConfigError):
        simulate(TraceConfig(blocks=64, max_tokens=1024), 1)


@pytest.mark.parametrize(
    ("model", "p_tp", "d_tp", "p_layout", "d_layout"),
    [("llama-3.1-8b", 1, 2, "nhd", "nhd"), ("jamba-1.5-mini", 2, 1, "nhd", "hnd")],
)
def test_pattern_check_sees_every_landed_byte(
    model: str, p_tp: int, d_tp: int, p_layout: str, d_layout: str
) -> None:
    """P's pattern moved by the plan (memmove here) checks clean on D; a flipped byte,
    or bytes of another transfer (seed), do not."""
    case = Case(model, p_tp, d_tp, p_layout, d_layout, pool_bytes=160 << 20, live=4)
    spec = model_spec(model)
    size = sizing(spec, case)
    p_lays, d_lay = layouts(spec, case, size)
    word = pat.word_bytes([*p_lays, d_lay])
    p_mem = [allocate(lay)[1] for lay in p_lays]
    d_mem = allocate(d_lay)[1]
    bound = [
        Bound(lay, tuple(r.ctypes.data for r in m)) for lay, m in zip(p_lays, p_mem, strict=True)
    ]
    d_bound = Bound(d_lay, tuple(r.ctypes.data for r in d_mem))
    d_side = Side(spec, Parallel(d_tp), [d_bound])
    geom = Geometry(Side(spec, Parallel(p_tp), bound), d_side, 0, pad_blocks=True)
    req = simulate(size.trace, 1)[0][0]
    state = [spec.is_state_group(g) for g in range(len(spec.groups))]
    p_tab = [np.array([req.p_slot]) if s else req.p_blocks for s in state]
    d_tab = [np.array([req.d_slot]) if s else req.d_blocks for s in state]
    for lay, mem in zip(p_lays, p_mem, strict=True):
        pat.fill(spec, lay, mem, p_tab, 5, word)
    plan = geom.plan(req.tokens, p_tab, d_tab)
    for runs in plan.runs.values():
        for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
            ctypes.memmove(d, s, n)
    assert pat.mismatches(spec, d_lay, d_mem, d_tab, req.tokens, 5, word) == 0
    assert pat.mismatches(spec, d_lay, d_mem, d_tab, req.tokens, 6, word) > 0
    first = next(iter(plan.runs.values()))
    at = int(first.dst[0])
    ctypes.memset(at, ctypes.string_at(at, 1)[0] ^ 0xFF, 1)
    assert pat.mismatches(spec, d_lay, d_mem, d_tab, req.tokens, 5, word) == 1


def test_trace_cases_are_selected_by_label_exactly_or_by_part() -> None:
    from benchmarks.trace_bench import cases, select

    grid = cases()
    one = select(grid, "llama-3.1-8b TP 1→2 nhd", None)
    assert [c.label() for c in one] == ["llama-3.1-8b TP 1→2 nhd"]  # not nhd→hnd too
    part = select(grid, "TP 1→2 nhd", 20)
    assert {c.label() for c in part} == {
        "llama-3.1-8b TP 1→2 nhd",
        "llama-3.1-8b TP 1→2 nhd→hnd",
        "jamba-1.5-mini TP 1→2 nhd",
        "jamba-1.5-mini TP 1→2 nhd→hnd",
    }
    assert all(c.requests == 20 and c.budget_s >= 20 for c in part)
    assert select(grid, "llama-3.1-8b 1→2 nhd", None) == one  # as the table names it
    assert select(grid, None, None) == grid
    with pytest.raises(ValueError, match="no case label contains"):
        select(grid, "mixtral", None)
