"""Bad input to the planner: typed errors, nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import IncompatibleError, LayoutError, PlanError, SpecError, TransportError
from kvbridge.layout import build_layout
from kvbridge.layout.view import RankLayout, View
from kvbridge.plan import Bound, Geometry, Side
from kvbridge.plan.tables import Tables, checked_tables
from kvbridge.spec import DType, Parallel, attention, group_by_kind
from kvbridge.transport.base import Region
from kvbridge.transport.loopback import Fabric, LoopbackTransport

SPEC = group_by_kind("t", [attention(i, 4, 16) for i in range(2)], 16)


def geometry(spec=SPEC, d_spec=SPEC, p_tp=1, d_tp=1, blocks=10):
    p_lay = [build_layout(spec, Parallel(p_tp), r, "nhd", blocks) for r in range(p_tp)]
    d_lay = build_layout(d_spec, Parallel(d_tp), 0, "hnd", blocks)
    p_b = [Bound(lay, tuple(1 << 20 for _ in lay.regions)) for lay in p_lay]
    d_side = Side(d_spec, Parallel(d_tp), [Bound(d_lay, (1 << 30,) * 2)])
    return Geometry(Side(spec, Parallel(p_tp), p_b), d_side, 0)


@pytest.mark.parametrize(
    ("p_ids", "d_ids", "match"),
    [
        ([0, 1, 10], [0, 1, 2], r"P block ids span \[0, 10\]; valid are \[0, 10\)"),
        ([0, -1, 2], [0, 1, 2], r"P block ids span \[-1, 2\]"),
        ([0, 1, 2], [0, 1, 99], r"D block ids span \[0, 99\]"),
        ([0, 1], [0, 1, 2], r"P table has 2 entries; 40 tokens need 3"),
        ([0, 1, 2], [0, 1], r"D table has 2 entries; 40 tokens need 3"),
        ([0, 1, 2], [4, 5, 4], r"D block id 4 is used twice"),
    ],
)
def test_bad_block_ids(p_ids, d_ids, match):
    with pytest.raises(PlanError, match=match):
        geometry().plan(40, [p_ids], [d_ids])


def test_bad_token_counts():
    g = geometry()
    with pytest.raises(PlanError, match="n_tokens=0"):
        g.plan(0, [[0]], [[0]])
    with pytest.raises(PlanError, match="cached=5"):
        g.plan(3, [[0]], [[0]], cached=5)
    with pytest.raises(PlanError, match="2 P and 1 D block tables for 1 groups"):
        g.plan(3, [[0], [1]], [[0]])


def test_specs_that_disagree():
    other = group_by_kind("t", [attention(i, 4, 16, DType.FP16) for i in range(2)], 16)
    with pytest.raises(IncompatibleError, match="store different bytes"):
        geometry(d_spec=other)
    # block sizes may differ: not an incompatibility
    geometry(d_spec=SPEC.with_block_sizes(32))


def test_a_d_rank_without_a_layout_is_named():
    lay = build_layout(SPEC, Parallel(2), 0, "hnd", 10)
    p_side = Side(SPEC, Parallel(1), [Bound(build_layout(SPEC, Parallel(1), 0, "nhd", 10), (0, 0))])
    for bounds, rank in (({0: Bound(lay, (0, 0))}, 1), ([Bound(lay, (0, 0))], 1), ([], 0)):
        with pytest.raises(IncompatibleError, match=f"D rank {rank} of world 2: no layout"):
            Geometry(p_side, Side(SPEC, Parallel(2), bounds), rank)
    with pytest.raises(IncompatibleError, match="P rank 0 of world 1: no layout"):
        d_side = Side(SPEC, Parallel(2), [Bound(lay, (0, 0))])
        Geometry(Side(SPEC, Parallel(1), {1: p_side.bounds[0]}), d_side, 0)
    with pytest.raises(IncompatibleError, match="D rank 2 of world 2"):
        Geometry(p_side, Side(SPEC, Parallel(2), [Bound(lay, (0, 0))] * 3), 2)


def test_impossible_tp_names_the_values():
    spec = group_by_kind("t", [attention(0, 6, 16)])
    with pytest.raises(SpecError, match="6 units cannot be split over TP 4"):
        spec.check_tp(4)
    with pytest.raises(SpecError, match="layer 0 stream 'k'"):
        build_layout(spec, Parallel(4), 0, "nhd", 4)


def test_view_leaving_its_region():
    lay = build_layout(SPEC, Parallel(1), 0, "nhd", 4)
    v = lay.views[0]
    bad = View(v.layer, "x", 0, lay.regions[0] - 8, *vars_of(v))
    with pytest.raises(LayoutError, match="spans bytes"):
        RankLayout(lay.regions, (*lay.views, bad), lay.block_sizes, lay.num_blocks, lay.pools)


def vars_of(v: View) -> tuple:
    return (
        v.block_stride,
        v.rows,
        v.blocks,
        v.seg_units,
        v.seg_offsets,
        v.row_strides,
        v.unit_strides,
        v.unit_bytes,
    )


def test_loopback_refuses_runs_outside_registered_memory_and_writes_nothing():
    fabric = Fabric()
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    a, b = LoopbackTransport("a", fabric), LoopbackTransport("b", fabric)
    peer = b.add_peer(a.register([Region(src.ctypes.data, 256)]))
    b.register([Region(dst.ctypes.data, 256)])
    addr = np.array([src.ctypes.data, src.ctypes.data + 200], np.uint64)
    local = np.array([dst.ctypes.data, dst.ctypes.data + 100], np.uint64)
    with pytest.raises(TransportError, match="source run 1"):
        b.read(peer, local, addr, np.array([16, 100], np.uint64))
    assert not dst.any()
    b.read(peer, local, addr, np.array([16, 56], np.uint64))
    assert (dst[:16] == src[:16]).all() and (dst[100:156] == src[200:256]).all()


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ([0, 0.9], r"table 0 holds 0.9 \(float\), not a block id"),
        ([1, True], r"table 0 holds True \(bool\), not a block id"),
        (["3"], r"table 0 holds '3' \(str\), not a block id"),
        ([0, 10], r"table 0 holds block 10, outside \[0, 10\)"),
        ([3, -2], r"table 0 holds block -2, outside \[0, 10\)"),
        (np.array([0, 10]), r"table 0 holds block 10, outside \[0, 10\)"),
        (np.array([2**63], dtype=np.uint64), r"table 0 holds block 9223372036854775808, outside"),
        (np.array([-1], dtype=np.int8), r"table 0 holds block -1, outside \[0, 10\)"),
        (np.array([1.0]), r"table 0 is a float64 array of shape \(1,\)"),
        ("012", r"table 0 is a str, not a list of block ids"),
    ],
)
def test_tables_are_checked_once_at_the_edge(table, match):
    with pytest.raises(PlanError, match="D's block tables: " + match):
        checked_tables([table], [10], "D's block tables")


def test_checked_tables_are_int64_arrays_the_planner_takes_as_they_are():
    """Lists, numpy integers and integer arrays become one int64 array per group, equal to
    the ids given; the plan over them is the plan over the lists. Tables checked against
    more blocks than P holds are checked again by the planner."""
    given = [[0, np.int32(1), 2], np.array([3, 4, 5], dtype=np.uint16)]
    tabs = checked_tables(given, [10, 10], "P")
    assert isinstance(tabs, Tables) and len(tabs) == 2
    for got, want in zip(tabs.ids, ([0, 1, 2], [3, 4, 5]), strict=True):
        assert got.dtype == np.int64 and got.ndim == 1 and got.tolist() == want
    assert tabs.lists() == [[0, 1, 2], [3, 4, 5]]
    assert checked_tables(tabs, [10, 10], "P") is tabs
    g = geometry()
    p, d = checked_tables([[0, 1, 2]], [10], "P"), checked_tables([[5, 6, 7]], [10], "D")
    want, got = g.plan(40, [[0, 1, 2]], [[5, 6, 7]]), g.plan(40, p, d)
    for src, runs in want.runs.items():
        for a, b in zip(runs.as_uint64(), got.runs[src].as_uint64(), strict=True):
            assert np.array_equal(a, b)
    loose = checked_tables([[0, 1, 10]], [100], "P")
    with pytest.raises(PlanError, match=r"P block ids span \[0, 10\]; valid are \[0, 10\)"):
        g.plan(40, loose, [[0, 1, 2]])


def test_checked_tables_are_a_frozen_copy_and_only_checked_tables_are_trusted():
    """The caller may reuse its buffer after handing it over: the checked ids keep their
    values. A :class:`Tables` not made by ``checked_tables`` (or checked against other
    limits) is checked again, by the planner and at the edge."""
    buf = np.array([0, 1, 2], dtype=np.int64)
    tabs = checked_tables([buf], [10], "D")
    buf[:] = 7
    assert tabs.ids[0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="read-only"):
        tabs.ids[0][0] = 9
    forged = Tables((np.array([0, 1, 10**6]),), (10,))
    with pytest.raises(PlanError, match=r"P block ids span \[0, 1000000\]; valid are \[0, 10\)"):
        geometry().plan(40, forged, [[0, 1, 2]])
    with pytest.raises(PlanError, match=r"D: table 0 holds block 1000000, outside \[0, 10\)"):
        checked_tables(forged, [10], "D")
    wide = checked_tables([[0, 1, 15]], [20], "D")
    with pytest.raises(PlanError, match=r"D: table 0 holds block 15, outside \[0, 10\)"):
        checked_tables(wide, [10], "D")
    assert checked_tables(wide, [20], "D") is wide
