"""The planner posts the fewest descriptors that describe its byte map.

The minimum is computed here, independently of the planner: runs are cut into units
(the gcd of every length and address, so no run boundary falls inside a unit), each
unit is a (src, dst) pair, and a descriptor is needed wherever a unit's predecessor
pair ``(src - unit, dst - unit)`` is not moved too: the count of maximal chains.
Bytes stay exact: ``run_scenario`` checks every D byte against the element-wise reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbridge.plan.links import unique_rows
from kvbridge.plan.runs import Runs
from kvbridge.spec import ModelSpec, Parallel, attention, group_by_kind, mamba2
from tests.support.scenario import Side, run_scenario
from tests.unit.test_planner_properties import PAIRS, tp_ok


def minimum_descriptors(runs: Runs) -> int:
    """Maximal chains of (src, dst) unit pairs where each continues the last on both sides."""
    src = [int(x) for x in runs.src]
    dst = [int(x) for x in runs.dst]
    length = [int(x) for x in runs.length]
    unit = math.gcd(*src, *dst, *length)
    pairs = set()
    for s, d, n in zip(src, dst, length, strict=True):
        for k in range(0, n, unit):
            pairs.add((s + k, d + k))
    assert len(pairs) * unit == sum(length)  # no unit listed twice
    return sum(1 for s, d in pairs if (s - unit, d - unit) not in pairs)


def assert_minimal(plans) -> None:
    for r, plan in plans.items():
        for src, runs in plan.runs.items():
            want = minimum_descriptors(runs)
            assert len(runs) == want, f"D rank {r}, source {src}: {len(runs)} runs, {want} needed"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_tp=st.sampled_from([1, 2, 4]),
    d_tp=st.sampled_from([1, 2, 4]),
    pp=st.integers(1, 2),
    pad=st.booleans(),
    **PAIRS,
)
def test_random_plans_post_the_minimum(
    spec, p_tp, d_tp, pp, pad, p_bs, d_bs, p_lay, d_lay, n, cached_frac, shuffle, seed
):
    assume(tp_ok(spec, p_tp) and tp_ok(spec, d_tp))
    pp = min(pp, len(spec.layers))
    p = Side(spec.with_block_sizes(p_bs), Parallel(p_tp, pp), p_lay, 300)
    d = Side(spec.with_block_sizes(d_bs), Parallel(d_tp), d_lay, 300)
    rng = np.random.default_rng(seed)
    plans = run_scenario(p, d, n, int(cached_frac * n), rng, shuffle, pad_blocks=pad)
    assert_minimal(plans)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_bs=st.sampled_from([1, 2, 4, 16]),
    d_bs=st.sampled_from([1, 2, 4, 16]),
    p_lay=st.sampled_from(["nhd", "hnd", "block-major"]),
    d_lay=st.sampled_from(["nhd", "hnd", "block-major"]),
    n=st.integers(1, 80),
    order=st.sampled_from(["up", "down", "up-down", "runs", "shuffled"]),
    seed=st.integers(0, 2**16),
)
def test_reused_block_orders_post_the_minimum(p_bs, d_bs, p_lay, d_lay, n, order, seed):
    """Ids that ascend or descend on both sides (vLLM's pool hands freed blocks back in
    reverse), streaks of them, and the same with one side shuffled."""
    rng = np.random.default_rng(seed)
    s = llama()
    tabs = [[_ids(-(-n // bs), order, rng, side)] for bs, side in ((p_bs, 0), (d_bs, 1))]
    plans = run(s.with_block_sizes(p_bs), s.with_block_sizes(d_bs), p_lay, d_lay, n, tabs)
    assert_minimal(plans)


def _ids(k: int, order: str, rng: np.random.Generator, side: int, pool: int = 300) -> list[int]:
    """``k`` distinct ids below ``pool`` in the given order."""
    base = 5 + 40 * side
    if order == "up":
        ids = np.arange(base, base + k)
    elif order == "down":
        ids = np.arange(base + k, base, -1)
    elif order == "up-down":
        ids = np.concatenate((np.arange(base, base + k // 2), np.arange(200, 200 - k + k // 2, -1)))
    elif order == "runs":  # streaks of 1-3 ids, each up or down, in random places
        ids = []
        for a in rng.permutation(np.arange(0, pool - 2, 3)):
            m = int(rng.integers(1, 4))
            ids.extend(range(a, a + m) if rng.random() < 0.5 else range(a + m - 1, a - 1, -1))
        ids = np.array(ids[:k])
    else:
        ids = rng.permutation(pool)[:k] if side == 0 else np.arange(base, base + k)
    return [int(x) for x in ids]


def llama(layers: int = 2, heads: int = 4) -> ModelSpec:
    return group_by_kind("llama", [attention(i, heads, 8) for i in range(layers)], 16)


def run(p_spec, d_spec, p_lay, d_lay, n, tables, p_tp=1, d_tp=1, cached=0):
    p = Side(p_spec, Parallel(p_tp), p_lay, 300)
    d = Side(d_spec, Parallel(d_tp), d_lay, 300)
    return run_scenario(p, d, n, cached, np.random.default_rng(7), tables=tables)


@pytest.mark.parametrize("lay", ["nhd", "hnd", "block-major"])
@pytest.mark.parametrize("shuffled", [False, True])
def test_p_block_1_to_d_block_16(lay, shuffled):
    s = llama()
    n = 16 * 9 + 5
    p_ids = np.random.default_rng(3).permutation(300)[:n] if shuffled else np.arange(10, 10 + n)
    tables = ([[int(x) for x in p_ids]], [list(range(100, 110))])
    assert_minimal(run(s.with_block_sizes(1), s, lay, lay, n, tables))


@pytest.mark.parametrize("lay", ["nhd", "hnd"])
def test_p_block_16_shuffled_to_d_block_1_consecutive(lay):
    s = llama()
    n = 16 * 6
    p_ids = [int(x) for x in np.random.default_rng(4).permutation(300)[:6]]
    tables = ([p_ids], [list(range(20, 20 + n))])
    assert_minimal(run(s, s.with_block_sizes(1), lay, lay, n, tables))


@pytest.mark.parametrize("lay", ["nhd", "block-major"])
def test_ids_descending_on_both_sides_are_one_run_per_layer(lay):
    """63 reused blocks, handed back in reverse on both sides: one contiguous span."""
    s = llama(layers=4)
    tables = ([list(range(70, 7, -1))], [list(range(200, 137, -1))])
    plans = run(s, s, lay, lay, 63 * 16, tables)
    assert_minimal(plans)
    assert plans[0].descriptors == (4 if lay == "nhd" else 1)


@pytest.mark.parametrize(("p_lay", "d_lay"), [("nhd", "nhd"), ("hnd", "hnd"), ("nhd", "hnd")])
@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 16), (4, 16), (16, 4), (8, 12)])
def test_consecutive_ids_with_a_partial_last_tile(p_lay, d_lay, p_bs, d_bs):
    s = llama()
    n = 48 * 3 + 7
    tables = ([list(range(3, 3 + -(-n // p_bs)))], [list(range(90, 90 + -(-n // d_bs)))])
    plans = run(s.with_block_sizes(p_bs), s.with_block_sizes(d_bs), p_lay, d_lay, n, tables)
    assert_minimal(plans)
    if (p_lay, p_bs) == (d_lay, d_bs) == ("nhd", 16):
        assert plans[0].descriptors == 2 * 2  # per layer: all but the last block's V, V


def test_tp_split_with_descending_ids():
    s = llama(heads=4)
    tables = ([list(range(40, 10, -1))], [list(range(80, 50, -1))])
    assert_minimal(run(s, s, "hnd", "hnd", 30 * 16, tables, p_tp=2, d_tp=4))
    assert_minimal(run(s, s, "hnd", "hnd", 30 * 16, tables, p_tp=4, d_tp=1, cached=37))


@pytest.mark.parametrize("order", ["up", "down", "runs", "shuffled"])
@pytest.mark.parametrize(("n", "bs"), [(600, 1), (1100, 1), (2000, 16)])
def test_long_tables(order, n, bs):
    """More ids than the small-table shortcuts take (sorting, counting) on both sides."""
    rng = np.random.default_rng(n + bs)
    s = llama().with_block_sizes(bs)
    k = -(-n // bs)
    p_ids, d_ids = _ids(k, order, rng, 0, 3000), _ids(k, order, rng, 1, 3000)
    p = Side(s, Parallel(1), "nhd", 3000)
    d = Side(s, Parallel(1), "nhd", 3000)
    plans = run_scenario(p, d, n, 0, rng, tables=([p_ids], [d_ids]))
    assert_minimal(plans)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_hybrid_shared_pool(shuffle, p_tp, d_tp):
    """Groups share pages of one pool: a block of one group may continue into a slot of
    another when their ids are neighbours (consecutive ids: they are)."""
    layers = [attention(0, 4, 8), mamba2(1, 4, 4, 2, 4, 3), attention(2, 4, 8)]
    layers.append(mamba2(3, 4, 4, 2, 4, 3))
    s = group_by_kind("hybrid", layers, 16)
    p = Side(s, Parallel(p_tp), "shared-pool", 60)
    d = Side(s, Parallel(d_tp), "shared-pool", 60)
    plans = run_scenario(p, d, 70, 0, np.random.default_rng(5), shuffle)
    assert_minimal(plans)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(1, 5),
    st.sampled_from([3, 1000, 2**40, 2**62]),
    st.integers(0, 2**32 - 1),
)
def test_unique_rows_is_numpys_unique_over_rows(n: int, k: int, span: int, seed: int) -> None:
    """The links' row grouping against ``np.unique(axis=0)``: small ranges (one int64
    key), huge ones (column by column), negative values, repeated rows."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(-span, span, size=(n, k), dtype=np.int64)
    if n > 2:
        rows[rng.integers(0, n, n // 2)] = rows[0]
    got_u, got_inv = unique_rows(rows)
    want_u, want_inv = np.unique(rows, axis=0, return_inverse=True)
    assert np.array_equal(got_u, want_u)
    assert np.array_equal(got_inv, want_inv.reshape(-1))


def test_unique_rows_of_int32_near_its_limits() -> None:
    """Keys are built in int64 whatever the input's integer type (no wrap-around)."""
    big = np.iinfo(np.int32).max
    rows = np.array([[big, -big, 1], [-big, big, 2], [big, -big, 1], [0, 0, 0]], np.int32)
    got_u, got_inv = unique_rows(rows)
    want_u, want_inv = np.unique(rows, axis=0, return_inverse=True)
    assert np.array_equal(got_u, want_u)
    assert np.array_equal(got_inv, want_inv.reshape(-1))
