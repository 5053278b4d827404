"""Ordering with the engine's streams, P side: a transfer may start as soon as the handle
is out, so P's engine hands out a step's handles only after its KV writes completed
(``ProducerWorker.written``). An engine whose KV write is still running (a thread here,
a kernel on another stream on a GPU) shows what the rule prevents: D copies the old bytes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvbridge.errors import TransferTimeout
from tests.support.reference import expected_dest, fill_source
from tests.support.scenario import random_tables
from tests.unit.test_connector_loopback import SPEC, World
from tests.unit.test_kernel_mover import ShmPool


class AsyncWrite:
    """P's KV write of one request, running late: ``query()`` as ``torch.cuda.Event``."""

    def __init__(self, w: World, n: int, start: threading.Event):
        self.tables = random_tables(SPEC, n, 32, w.rng)
        old = [[b.copy() for b in bufs] for bufs in w.p.bufs]
        for r in range(w.p.par.world):
            fill_source(SPEC, w.p.par, r, w.p.layouts[r], w.p.bufs[r], n, self.tables)
        self.new = [[b.copy() for b in bufs] for bufs in w.p.bufs]
        for bufs, was in zip(w.p.bufs, old, strict=True):  # not written yet
            for b, o in zip(bufs, was, strict=True):
                b[:] = o
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(w, start), daemon=True)
        self.thread.start()

    def _run(self, w: World, start: threading.Event) -> None:
        start.wait(10)
        for bufs, new in zip(w.p.bufs, self.new, strict=True):
            for b, o in zip(bufs, new, strict=True):
                b[:] = o
        self.done.set()

    def query(self) -> bool:
        return self.done.is_set()


def load(w: World, write: AsyncWrite, n: int, wait: bool, start: threading.Event) -> bool:
    """Whether D's bytes match P's final KV, with or without the rule."""
    if wait:
        start.set()
        for worker in w.workers:
            worker.written(write, timeout_s=5)
    before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
    handle = w.producer.prefill_done("r", write.tables, n)
    d_tabs = random_tables(w.d.spec, n, 64, w.rng)
    w.consumers[0].load(handle, d_tabs)
    (out,) = w.wait()
    assert out.ok, out.error
    start.set()
    write.thread.join(10)
    want = expected_dest(w.d.spec, w.d.par, 0, w.d.layouts[0], before[0], n, 0, d_tabs)
    return all(np.array_equal(g, e) for g, e in zip(w.d.bufs[0], want, strict=True))


@pytest.mark.parametrize("wait", [True, False])
def test_a_transfer_waits_for_the_engines_kv_writes(wait: bool) -> None:
    pool = ShmPool()  # P shares its memory: the kernel mover reads the moment it may
    w = World(p_memory=pool)
    try:
        start = threading.Event()
        exact = load(w, AsyncWrite(w, 45, start), 45, wait, start)
        assert exact is wait  # without the rule D copied the bytes before the write
    finally:
        w.close()
        pool.close()


def test_writes_that_never_complete_time_out_typed() -> None:
    w = World()
    try:

        class Never:
            def query(self) -> bool:
                return False

        with pytest.raises(TransferTimeout, match=r"not complete after 0\.05 s"):
            w.workers[0].written(Never(), timeout_s=0.05)
        w.workers[0].written()  # host memory, no event: nothing to wait for
    finally:
        w.close()
