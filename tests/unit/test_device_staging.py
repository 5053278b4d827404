"""Staging on the device: D's staging slots and P's gather slots live in the ranks'
device memory and are copied by torch kernels (here: torch on host memory,
``KVBRIDGE_DEVICE_ON_CPU=1``). Byte-exact against the reference and against the host
path; nothing outside the runs touched; stray runs refused before any byte moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.device_memory import DeviceMemory
from kvbridge.connector.staging import StagingPool, local_memory
from kvbridge.errors import TransportError
from kvbridge.layout.tensor import MemKind, Region
from tests.unit.test_connector_loopback import World, check_bytes
from tests.unit.test_staged_push import HeadSplit, N

DEVICE = MemKind.DEVICE


@pytest.fixture(autouse=True)
def device_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_DEVICE_ON_CPU", "1")


def test_pools_and_copies_live_where_the_regions_do() -> None:
    pool = StagingPool(2, 4096, DEVICE, 0)
    assert isinstance(pool.buf, torch.Tensor) and pool.region.kind is DEVICE
    assert pool.region.addr == pool.buf.data_ptr() and pool.region.nbytes == 8192
    buf = np.zeros(64, np.uint8)
    assert isinstance(local_memory([Region(int(buf.ctypes.data), 64, DEVICE)]), DeviceMemory)
    assert not isinstance(local_memory([Region(int(buf.ctypes.data), 64)]), DeviceMemory)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_device_scatter_and_gather_over_several_regions(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(64, 2048)) for _ in range(3)]
    whole = np.zeros(sum(sizes) + 4 * 64, np.uint8)  # guard gaps between the regions
    starts = np.cumsum([64] + [n + 64 for n in sizes[:-1]])
    bufs = [whole[a : a + n] for a, n in zip(starts, sizes, strict=True)]
    mem = DeviceMemory([Region(int(b.ctypes.data), b.nbytes, DEVICE) for b in bufs])
    dst, length, pos = [], [], [0, 0, 0]
    for _ in range(int(rng.integers(1, 80))):
        r, n = int(rng.integers(0, 3)), int(rng.choice([3, 8, 24, 64]))
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
    stage = torch.from_numpy(rng.integers(0, 256, int(ln.sum()) + 8, dtype=np.uint8))
    off = np.concatenate(([0], np.cumsum(ln)[:-1]))
    mem.scatter(d.view(np.uint64), stage, off, ln.view(np.uint64))  # wire-typed, as pulled
    back = torch.zeros_like(stage)
    mem.gather(d, back, off, ln)
    want = np.zeros_like(whole)
    for a, o, n in zip(d.tolist(), off.tolist(), ln.tolist(), strict=True):
        at = a - int(whole.ctypes.data)
        want[at : at + n] = stage.numpy()[o : o + n]
    assert np.array_equal(whole, want)  # every run landed; gaps and the rest untouched
    assert torch.equal(back[: int(ln.sum())], stage[: int(ln.sum())])


def test_device_copies_refuse_stray_runs_and_move_nothing() -> None:
    buf = np.zeros(256, np.uint8)
    mem = DeviceMemory([Region(int(buf.ctypes.data), 256, DEVICE)])
    stage = torch.arange(64, dtype=torch.uint8)
    at = np.array([int(buf.ctypes.data) + 8, int(buf.ctypes.data) + 250], np.uint64)
    off = np.array([0, 16], np.int64)
    for bad in ([16, 16], [16, 0], [16, 1 << 63]):
        with pytest.raises(TransportError, match="lies in no region"):
            mem.scatter(at, stage, off, np.array(bad, np.uint64))
    assert not buf.any()


def test_staged_push_between_device_ranks_is_byte_exact() -> None:
    w = HeadSplit(memory=DEVICE)
    try:
        assert w.workers[0].gather is not None
        assert w.workers[0].gather.pool.region.kind is DEVICE
        before, d_tabs = w.load("s")
        outs = w.wait(2)
        assert all(o.ok and o.mover == "push" for o in outs), outs
        assert all(o.staged_runs > 300 and o.descriptors < 10 for o in outs), outs
        check_bytes(w, before, N, 0, d_tabs)
        assert w.workers[0].gather.gathered >= 2
    finally:
        w.close()


def test_staged_pull_into_device_memory_is_byte_exact() -> None:
    w = World(p_tp=1, d_tp=2, memory=(DEVICE, DEVICE))
    try:
        for c in w.consumers:
            assert c.stager is not None and c.stager.pool.region.kind is DEVICE
            assert c.stager.costs.on_device
            c.stager.costs.c_desc = 1e-4  # the choice, not the timing of a loaded machine
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("r", 120)
        for c in w.consumers:
            c.load(handle, d_tabs)
        outs = w.wait(2)
        assert all(o.ok and o.mover == "pull" for o in outs), outs
        assert any(o.staged_runs > 0 for o in outs), outs
        check_bytes(w, before, 120, 0, d_tabs)
    finally:
        w.close()
