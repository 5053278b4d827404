"""Staging on the device: D's staging slots and P's gather slots live in the ranks'
device memory and are copied by torch kernels (here: torch on host memory,
``KVBRIDGE_DEVICE_ON_CPU=1``). Byte-exact against the reference; stray runs refused before
any byte moves. (The scatter and gather of device memory over several regions are
property-tested beside host memory's, ``test_staging.py``.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvbridge.connector.movers.memory import LocalMemory
from kvbridge.connector.movers.staging import StagingPool
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
    assert not LocalMemory([Region(int(buf.ctypes.data), 64, DEVICE)]).host  # torch's copies
    assert LocalMemory([Region(int(buf.ctypes.data), 64)]).host  # numpy's


def test_device_copies_refuse_stray_runs_and_move_nothing() -> None:
    buf = np.zeros(256, np.uint8)
    mem = LocalMemory([Region(int(buf.ctypes.data), 256, DEVICE)])
    stage = torch.arange(64, dtype=torch.uint8)
    at = np.array([int(buf.ctypes.data) + 8, int(buf.ctypes.data) + 250], np.uint64)
    off = np.array([0, 16], np.int64)
    for bad, why in [
        ([16, 16], "run 1 .* lies in no region"),  # past the region's end
        ([16, 0], "run 1 .* length 0 B is outside"),
        ([16, 1 << 63], f"run 1 .* length {1 << 63} B is outside"),  # as sent
    ]:
        with pytest.raises(TransportError, match=why):
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
            # the choice, not the timing of a loaded machine
            c.stager.costs.link = replace(c.stager.costs.link, desc_s=1e-4)
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
