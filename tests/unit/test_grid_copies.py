"""A dense request's plan as a grid (``plan.runs.Grid``: per tile pattern run an offset,
per tile a block id, per side a stride), copied by the kernel mover without expanding
it: byte-exact against a per-run numpy copy of the expanded runs, bounds checked from
the grid's extremes (a run outside named, nothing copied), the expansion equal to the
runs the planner applied before, and the kernel mover taking grids end to end."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.plan_bench import bound_all
from benchmarks.shapes import llama
from kvbridge.connector.movers import kernel as kernel_mover
from kvbridge.connector.movers.device_copies import GridCopy
from kvbridge.connector.movers.kernel import copy_groups, run_copy
from kvbridge.connector.movers.memory import Span
from kvbridge.errors import TransportError
from kvbridge.layout.tensor import Region
from kvbridge.plan import Geometry, Side
from kvbridge.plan.geometry import _applied
from kvbridge.plan.runs import Grid, Runs
from kvbridge.spec import Parallel, attention, group_by_kind
from tests.unit.test_connector_loopback import World
from tests.unit.test_kernel_mover import ShmPool, load_one, shm  # noqa: F401


def _span(nbytes: int, seed: int) -> tuple[Span, np.ndarray]:
    buf = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return Span([Region(int(buf.ctypes.data), nbytes)]), buf


def _grid(rng: np.random.Generator, lengths: list[int], tiles: int, stride: int) -> Grid:
    """Disjoint runs: tile pattern runs at distinct slots of a block, distinct block ids."""
    slots = rng.permutation(stride // max(lengths))[: len(lengths)] * max(lengths)
    soff = rng.permutation(slots).astype(np.int64)
    doff = rng.permutation(slots).astype(np.int64)
    pid = rng.permutation(3 * tiles)[:tiles].astype(np.int64)
    did = rng.permutation(3 * tiles)[:tiles].astype(np.int64)
    return Grid(soff, doff, np.array(lengths, np.int64), stride, stride, pid, did)


def _reference(dst: np.ndarray, src: np.ndarray, g: Grid) -> np.ndarray:
    out = dst.copy()
    for t in range(g.soff.shape[0]):
        for b in range(g.pid.shape[0]):
            s = int(g.soff[t] + g.pid[b] * g.sstride)
            d = int(g.doff[t] + g.did[b] * g.dstride)
            out[d : d + int(g.length[t])] = src[s : s + int(g.length[t])]
    return out


@pytest.mark.parametrize(
    ("lengths", "divisor"),
    [([256] * 6, 256), ([64, 64, 192, 64, 192], 64), ([24, 40, 8], 8), ([6, 10], 2), ([3], 1)],
)
def test_grid_copies_are_byte_exact(lengths: list[int], divisor: int) -> None:
    rng = np.random.default_rng(sum(lengths))
    stride = 4096
    g = _grid(rng, lengths, 17, stride)
    src_span, src = _span(3 * 17 * stride + 64, 1)
    dst_span, dst = _span(3 * 17 * stride + 64, 2)
    want = _reference(dst, src, g)
    copies = copy_groups(src_span, dst_span, Runs.of(g), "P rank 0's")
    assert all(isinstance(c, GridCopy) for c in copies)
    assert len(copies) == len(set(lengths))  # one call per length
    for c in copies:
        run_copy(dst_span, src_span, c, divisor, None)
    assert np.array_equal(dst, want)


def test_a_grid_expands_to_the_runs_it_stands_for() -> None:
    g = _grid(np.random.default_rng(3), [64, 128, 64], 9, 1024)
    r = Runs.of(g)
    assert len(r) == 27 and r.nbytes == 9 * 256 and r._src is None  # nothing expanded yet
    want = [
        (int(g.soff[t] + g.pid[b] * 1024), int(g.doff[t] + g.did[b] * 1024), int(g.length[t]))
        for t in range(3)
        for b in range(9)
    ]
    assert list(zip(r.src.tolist(), r.dst.tolist(), r.length.tolist(), strict=True)) == want
    assert len(r) == 27 and r.nbytes == 9 * 256


@pytest.mark.parametrize(("side", "off", "pid_at", "length"), [
    ("src", 0, 10_000, 64),  # a block id past the end
    ("dst", -64, 0, 64),  # below the start
    ("src", 4096 - 32, 23, 64),  # the last run crosses the end
    ("dst", 0, 0, 0),  # an empty run
])  # fmt: skip
def test_a_run_outside_its_memory_is_named_and_nothing_moves(side, off, pid_at, length) -> None:
    g = _grid(np.random.default_rng(4), [64, 64], 8, 4096)
    span_bytes = 24 * 4096
    src_span, _ = _span(span_bytes, 5)
    dst_span, dst = _span(span_bytes, 6)
    before = dst.copy()
    ids = g.pid.copy() if side == "src" else g.did.copy()
    ids[3] = pid_at
    offs = (g.soff if side == "src" else g.doff).copy()
    offs[1] = off
    lens = g.length.copy()
    lens[1] = length if length else 0
    bad = (
        Grid(offs, g.doff, lens, 4096, 4096, ids, g.did)
        if side == "src"
        else Grid(g.soff, offs, lens, 4096, 4096, g.pid, ids)
    )
    with pytest.raises(TransportError, match=r"run .* lies outside its memory"):
        copy_groups(src_span, dst_span, Runs.of(bad), "P rank 0's")
    assert np.array_equal(dst, before)


def test_a_dense_plan_comes_as_a_grid_equal_to_the_applied_runs() -> None:
    spec = llama(4)
    for layout, p_tp, d_tp in [("nhd", 1, 1), ("hnd", 2, 1), ("nhd", 1, 2)]:
        p_b = bound_all(spec, Parallel(p_tp), layout, 200, 1 << 40)
        d_b = bound_all(spec, Parallel(d_tp), layout, 200, 1 << 41)
        geom = Geometry(Side(spec, Parallel(p_tp), p_b), Side(spec, Parallel(d_tp), d_b[:1]), 0)
        rng = np.random.default_rng(7)
        p_ids, d_ids = [rng.permutation(200)[:40]], [rng.permutation(200)[:40]]
        plan = geom.plan(630, p_ids, d_ids)
        assert plan.runs and all(r.grids is not None for r in plan.runs.values()), layout
        tabs = {0: (np.asarray(p_ids[0]), np.asarray(d_ids[0]), 0, 0, 40)}
        for src, r in plan.runs.items():  # the runs as _apply made them before grids
            jobs = [j for j in _jobs_of(geom, 630) if j[1].src_rank == src]
            assert len(jobs) == len(r.grids or ())
            s, d, n = _applied(jobs, tabs, geom.groups)
            assert np.array_equal(r.src, s) and np.array_equal(r.dst, d)
            assert np.array_equal(r.length, n)


def _jobs_of(geom: Geometry, n: int) -> list[tuple]:
    from kvbridge.plan.geometry import _jobs

    jobs: dict[int, list] = {}
    _jobs(geom.groups[0], 0, n, 0, jobs, [])
    return [j for js in jobs.values() for j in js]


def test_the_kernel_mover_copies_a_dense_load_as_grids(shm: ShmPool, monkeypatch) -> None:  # noqa: F811
    seen: list[GridCopy] = []
    real = kernel_mover.grid_copy

    def counted(dst, src, g, divisor, *, stream=None) -> None:
        seen.append(g)
        real(dst, src, g, divisor, stream=stream)

    monkeypatch.setattr(kernel_mover, "grid_copy", counted)
    dense = group_by_kind("dense", [attention(0, 4, 16), attention(1, 4, 16)], 16)
    w = World(p_memory=shm, p_tp=1, layouts=("nhd", "nhd"), d_block=16, spec=dense)
    try:
        out = load_one(w)  # byte-exact against the composed reference
        assert out.mover == "kernel"
        assert seen and out.descriptors == len(seen)
        assert len(seen) == 2  # full blocks, and the last one's 13 tokens
    finally:
        w.close()


def test_a_plan_keeps_its_ids_when_the_caller_reuses_its_arrays() -> None:
    """Grids hold block ids, not addresses: a caller's int64 table changed after
    ``plan()`` and before the runs are read must not change them."""
    spec = llama(4)
    p_b = bound_all(spec, Parallel(1), "nhd", 200, 1 << 40)
    d_b = bound_all(spec, Parallel(1), "nhd", 200, 1 << 41)
    geom = Geometry(Side(spec, Parallel(1), p_b), Side(spec, Parallel(1), d_b), 0)
    rng = np.random.default_rng(8)
    p_ids = rng.permutation(200)[:40].astype(np.int64)
    d_ids = rng.permutation(200)[:40].astype(np.int64)
    want = geom.plan(640, [p_ids.copy()], [d_ids.copy()]).runs[0]
    plan = geom.plan(640, [p_ids], [d_ids])  # grids, not expanded yet
    assert plan.runs[0].grids is not None and plan.runs[0]._src is None
    p_ids[:] = 0  # the caller reuses its arrays
    d_ids[:] = 199
    got = plan.runs[0]
    assert np.array_equal(got.src, want.src) and np.array_equal(got.dst, want.dst)


def test_a_grid_whose_runs_would_wrap_int64_is_refused() -> None:
    span, _ = _span(1 << 16, 9)
    with pytest.raises(TransportError, match="outside its memory"):
        span.check_grid(np.zeros(1, np.int64), np.array([1 << 62]), 4, np.full(1, 64), "x")


def test_grids_of_nothing_or_of_floats_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one grid"):
        Runs.of()
    src_span, _ = _span(4096, 1)
    dst_span, _ = _span(4096, 2)
    bad = GridCopy(np.zeros(2), np.zeros(1, np.int64), 64, np.zeros(2), np.zeros(1), 64, 8)
    with pytest.raises(TransportError, match="1-D integer arrays"):
        run_copy(dst_span, src_span, bad, 8, None)
