"""Staged pulls: spans and chunks against a naive copy, the scatter, the slot pool, and
a consumer over loopback that stages a transposed-K block-size change byte-exact."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.movers.copies import copy_equal
from kvbridge.connector.movers.memory import LocalMemory
from kvbridge.connector.movers.staging import CostModel, StagingPool, chunks
from kvbridge.errors import TransportError
from kvbridge.layout.tensor import MemKind
from kvbridge.plan.runs import Runs
from kvbridge.transport.base import Region


def naive(src_mem: np.ndarray, runs: Runs, size: int) -> np.ndarray:
    out = np.zeros(size, np.uint8)
    for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
        out[d : d + n] = src_mem[s : s + n]
    return out


@st.composite
def run_sets(draw: st.DrawFn) -> Runs:
    """Disjoint destination runs over 4 KiB, sources anywhere (touching, overlapping)."""
    n = draw(st.integers(1, 60))
    lengths = draw(st.lists(st.sampled_from([1, 3, 8, 16, 64, 100]), min_size=n, max_size=n))
    dst, pos = [], 0
    for ln in lengths:
        pos += draw(st.integers(0, 8))
        dst.append(pos)
        pos += ln
    src = [draw(st.integers(0, 4000 - ln)) for ln in lengths]
    order = draw(st.permutations(range(n)))
    pick = np.array(order, dtype=np.int64)
    return Runs(
        np.array(src, np.int64)[pick],
        np.array(dst, np.int64)[pick],
        np.array(lengths, np.int64)[pick],
    )


@settings(max_examples=200, deadline=None)
@given(runs=run_sets(), slot=st.sampled_from([100, 256, 1000, 5000]))
def test_chunks_then_scatter_equal_a_naive_copy(runs: Runs, slot: int) -> None:
    rng = np.random.default_rng(0)
    src_mem = rng.integers(0, 256, 4096, dtype=np.uint8)
    want = naive(src_mem, runs, 4800)
    dst_mem = np.zeros(4800, np.uint8)
    mem = LocalMemory([Region(int(dst_mem.ctypes.data), dst_mem.nbytes)])
    try:
        parts = chunks(runs, slot)
    except TransportError:  # a run longer than the slot: the consumer sends it direct
        return
    assert sum(c.run_len.shape[0] for c in parts) == len(runs)
    for c in parts:
        stage = np.zeros(slot, np.uint8)
        assert int(c.span_len.sum()) <= slot
        for s, o, n in zip(
            c.span_src.tolist(), c.span_stage.tolist(), c.span_len.tolist(), strict=True
        ):
            stage[o : o + n] = src_mem[s : s + n]  # what the READ of the spans does
        mem.scatter(c.run_dst + int(dst_mem.ctypes.data), stage, c.run_stage, c.run_len)
    assert np.array_equal(dst_mem, want)


def test_touching_sources_become_one_span() -> None:
    # 64 runs of 128 B contiguous on the source, scattered 1 KiB apart on the destination
    src = np.arange(64, dtype=np.int64) * 128
    runs = Runs(src[::-1].copy(), np.arange(64, dtype=np.int64)[::-1] * 1024, np.full(64, 128))
    (c,) = chunks(runs, 1 << 20)
    assert c.span_len.tolist() == [64 * 128]
    parts = chunks(runs, 1024)  # 8 runs per slot round
    assert [p.span_len.tolist() for p in parts] == [[1024]] * 8


def test_scatter_refuses_a_run_outside_local_memory() -> None:
    buf = np.zeros(256, np.uint8)
    mem = LocalMemory([Region(int(buf.ctypes.data), 256)])
    stage = np.ones(64, np.uint8)
    with pytest.raises(TransportError, match="lies in no region"):
        one = np.array([1], np.int64)
        mem.scatter(np.array([int(buf.ctypes.data) + 250]), stage, one * 0, one * 8)


def test_copy_equal_word_and_byte_paths() -> None:
    src = np.arange(4096, dtype=np.uint32).view(np.uint8)
    for size, off in [(64, 0), (12, 4), (7, 3)]:
        dst = np.zeros(4 * 4096, np.uint8)
        s_off = np.arange(40, dtype=np.int64) * 100 + off
        d_off = np.arange(40, dtype=np.int64)[::-1] * 200 + off
        copy_equal(dst, d_off, src, s_off, size)
        for a, b in zip(d_off, s_off, strict=True):
            assert np.array_equal(dst[a : a + size], src[b : b + size])


@st.composite
def equal_runs(draw: st.DrawFn) -> tuple[int, np.ndarray, np.ndarray]:
    """Runs of one size as engines make them: blocks of rows, each row cut into
    ``heads`` runs (heads within a row on the source, NHD; head-major on the
    destination, HND, when there are several), blocks in any order on either side, rows
    rising or falling, sometimes strided apart, sometimes shuffled run by run;
    destinations disjoint (they may touch)."""
    size = draw(st.sampled_from([1, 8, 24, 64, 96, 128]))
    blocks, rows = draw(st.integers(1, 12)), draw(st.integers(1, 20))
    heads = draw(st.sampled_from([1, 1, 2, 3, 4]))
    d_gap, s_gap = draw(st.sampled_from([0, 8, size])), draw(st.integers(0, 3 * size))
    s_row = heads * size + s_gap  # source: row r, head h at r·s_row + h·size
    d_head = rows * (size + d_gap)  # destination: head h, row r at h·d_head + r·(size+gap)
    s_blk, d_blk = rows * s_row, heads * d_head
    d_ids = np.array(draw(st.permutations(range(blocks))), np.int64)
    s_ids = np.array(draw(st.permutations(range(blocks))), np.int64)
    r = np.arange(rows, dtype=np.int64)
    if draw(st.booleans()):
        r = r[::-1].copy()
    h = np.arange(heads, dtype=np.int64)
    if draw(st.booleans()):
        h = h[::-1].copy()
    d = d_ids[:, None, None] * d_blk + r[None, :, None] * (size + d_gap) + h * d_head
    s = s_ids[:, None, None] * s_blk + r[None, :, None] * s_row + h * size
    drop = draw(st.integers(0, heads - 1))  # a last row cut short
    d, s = d.ravel()[: d.size - drop], s.ravel()[: s.size - drop]
    if draw(st.booleans()):
        pick = np.array(draw(st.permutations(range(d.shape[0]))), np.int64)
        d, s = d[pick], s[pick]
    return size, d + draw(st.integers(0, 7)), s + draw(st.integers(0, 7))


@settings(max_examples=300, deadline=None)
@given(case=equal_runs())
def test_copy_equal_matches_a_run_by_run_copy(case: tuple[int, np.ndarray, np.ndarray]) -> None:
    size, d_off, s_off = case
    src = np.random.default_rng(1).integers(0, 256, int(s_off.max()) + size + 5, dtype=np.uint8)
    got = np.zeros(int(d_off.max()) + size + 3, np.uint8)
    want = got.copy()
    for a, b in zip(d_off.tolist(), s_off.tolist(), strict=True):
        want[a : a + size] = src[b : b + size]
    copy_equal(got, d_off, src, s_off, size)
    assert np.array_equal(got, want)


def _memory(where: str, bufs: list[np.ndarray]) -> LocalMemory:
    if where == "host":
        return LocalMemory([Region(int(b.ctypes.data), b.nbytes) for b in bufs])
    with mock.patch.dict(os.environ, {"KVBRIDGE_DEVICE_ON_CPU": "1"}):
        regions = [Region(int(b.ctypes.data), b.nbytes, MemKind.DEVICE) for b in bufs]
        return LocalMemory(regions)


@pytest.mark.parametrize("where", ["host", "device"])
@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_scatter_and_gather_over_several_regions_and_lengths(where: str, seed: int) -> None:
    """Host memory through numpy, device memory through torch (here torch CPU tensors
    over the same bytes, KVBRIDGE_DEVICE_ON_CPU)."""
    rng = np.random.default_rng(seed)
    # three regions carved from one buffer with guard gaps between them: the copies go
    # through one view spanning all regions, and must never write into a gap
    sizes = [int(rng.integers(64, 2048)) for _ in range(3)]
    whole = np.zeros(sum(sizes) + 4 * 64, np.uint8)
    starts = np.cumsum([64] + [n + 64 for n in sizes[:-1]])
    bufs = [whole[a : a + n] for a, n in zip(starts, sizes, strict=True)]
    mem = _memory(where, bufs)
    dst, length, pos = [], [], [0, 0, 0]
    for _ in range(int(rng.integers(1, 80))):  # disjoint runs, region and length at random
        r, n = int(rng.integers(0, 3)), int(rng.choice([3, 4, 8, 24, 64]))
        pos[r] += int(rng.integers(0, 16))
        if pos[r] + n > bufs[r].nbytes:
            continue
        dst.append(int(bufs[r].ctypes.data) + pos[r])
        length.append(n)
        pos[r] += n
    if not dst:
        return
    pick = rng.permutation(len(dst))
    d, ln = np.array(dst, np.int64)[pick], np.array(length, np.int64)[pick]
    stage = rng.integers(0, 256, int(ln.sum()) + 8, dtype=np.uint8)
    off = np.concatenate(([0], np.cumsum(ln)[:-1]))
    back = np.zeros_like(stage)
    as_buf = (lambda a: a) if where == "host" else torch.from_numpy  # same bytes
    mem.scatter(d.view(np.uint64), as_buf(stage), off, ln.view(np.uint64))  # wire-typed
    mem.gather(d, as_buf(back), off, ln)  # the same runs read back
    covered = [np.zeros(b.nbytes, bool) for b in bufs]
    for a, o, n in zip(d.tolist(), off.tolist(), ln.tolist(), strict=True):
        r = next(i for i, b in enumerate(bufs) if b.ctypes.data <= a < b.ctypes.data + b.nbytes)
        at = a - int(bufs[r].ctypes.data)
        assert np.array_equal(bufs[r][at : at + n], stage[o : o + n])
        covered[r][at : at + n] = True
    assert np.array_equal(back[: int(ln.sum())], stage[: int(ln.sum())])
    assert not any(b[~c].any() for b, c in zip(bufs, covered, strict=True))  # nothing else
    in_region = np.zeros(whole.shape[0], bool)
    for a, n in zip(starts, sizes, strict=True):
        in_region[a : a + n] = True
    assert not whole[~in_region].any()  # the guard gaps stayed untouched


def test_scatter_refuses_lengths_out_of_range_and_takes_uint64_addresses() -> None:
    buf = np.zeros(256, np.uint8)
    mem = LocalMemory([Region(int(buf.ctypes.data), 256)])
    stage = np.arange(64, dtype=np.uint8)
    at = np.array([int(buf.ctypes.data) + 8], np.uint64)
    zero = np.zeros(1, np.int64)
    outside = r"B is outside \(0, 2\^40\) B"
    for bad in (0, 1 << 63, (1 << 64) - 8):  # from the wire as uint64, named as sent
        wire = np.array([bad], np.uint64).view(np.int64)
        with pytest.raises(TransportError, match=f"length {bad} {outside}"):
            mem.scatter(at, stage, zero, wire)
    mem.scatter(at, stage, zero.astype(np.uint64), np.array([16], np.uint64))
    assert np.array_equal(buf[8:24], stage[:16]) and not buf[:8].any() and not buf[24:].any()


def test_pool_quarantines_a_dirty_slot() -> None:
    pool = StagingPool(2, 4096)
    a, b = pool.take(0.1), pool.take(0.1)
    assert {a, b} == {0, 1} and pool.take(0.01) is None
    pool.give_back(a, clean=False)  # a READ may still land in it
    pool.give_back(b, clean=True)
    assert pool.take(0.01) == b and pool.take(0.01) is None and pool.quarantined == 1


def test_cost_model_stages_many_small_runs_not_few_large() -> None:
    m = CostModel()
    assert m.per_run >= 0 and m.per_byte >= 0
    assert m.staged_wins(runs=12_000, spans=24, nbytes=12_000 * 128, rounds=1)
    assert not m.staged_wins(runs=4, spans=4, nbytes=4 << 20, rounds=1)


def test_cost_model_learns_descriptor_and_byte_costs_from_timed_transfers() -> None:
    m = CostModel()
    c_desc, c_byte = 5e-6, 1e-10  # a transport at 5 µs per descriptor, 10 GB/s
    for _ in range(40):
        m.learn(16_384, 16_384 * 1024, 16_384 * c_desc + 16_384 * 1024 * c_byte)  # 1 KiB runs
        m.learn(64, 64 << 20, 64 * c_desc + (64 << 20) * c_byte)  # 1 MiB runs
    assert m.link.desc_s == pytest.approx(c_desc, rel=0.05)
    assert m.link.byte_s == pytest.approx(c_byte, rel=0.05)
    gap = int(m.link.desc_s / m.link.byte_s)  # 50 KB: a gap cheaper than a descriptor
    assert m.max_gap() == gap
    m.learn(16_384, 16_384 * 1024, 600.0)  # one stalled transfer: moves it, within bounds
    assert m.link.desc_s <= 0.8 * c_desc * 1.05 + 0.2 * 1e-4
    before = (m.link.desc_s, m.link.byte_s)
    m.learn(100, 100 << 10, 1.0)  # neither many small runs nor long ones: says nothing
    m.learn(0, 0, 1.0)
    assert (m.link.desc_s, m.link.byte_s) == before


def test_a_pull_failing_before_its_staged_reads_gives_the_slot_back(monkeypatch) -> None:
    """The direct READs of a pull with staged ranks fail while posting: no staged READ
    went out, so the slot the stager took comes back clean (not lost, not quarantined)."""
    from kvbridge.connector.movers.staging import CostModel, Stager
    from kvbridge.errors import TransportError
    from tests.unit.test_connector_loopback import World

    w = World()
    try:
        d = w.consumers[0]
        assert d.stager is not None
        pool, real = d.stager.pool, Stager.choose

        def one_staged(self, runs, *a, **kw):  # P rank 0 staged, rank 1 direct
            staged, slot = real(self, runs, *a, **kw)
            assert slot is not None and 0 in staged  # staging wins here (forced below)
            return {k: v for k, v in staged.items() if k == 0}, slot

        def refused(*a, **kw):
            raise TransportError("posting refused")

        monkeypatch.setattr(CostModel, "staged_wins", lambda *a, **kw: True)
        monkeypatch.setattr(Stager, "choose", one_staged)
        monkeypatch.setattr(d.transport, "read", refused)
        free = pool._free.qsize()
        handle, tabs = w.request("r", 45)
        d.load(handle, tabs)
        (out,) = w.wait()
        assert not out.ok and "posting refused" in out.error, out.error
        assert pool._free.qsize() == free and pool.quarantined == 0
    finally:
        w.close()
