"""A load starts on the caller's thread (``Consumer(inline=True)``, the default) where
nothing there waits: P known, its mapping and geometry made, the fast channel free. Then
``begin`` is out, the plan made and (where the kernel mover overlaps P's answer, as on a
GPU) the copies launched before :meth:`Consumer.load` returns; a worker ends the load.
Where anything would wait, the load goes to a worker whole, as before. Bytes are checked
against the element-wise reference every time; failures keep the lease protocol's rules."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvbridge.control.lease import LeaseState
from kvbridge.errors import PlanError
from kvbridge.plan.geometry import Geometry
from tests.support.reference import expected_dest, fill_source
from tests.unit.test_connector_loopback import SPEC, World, check_bytes
from tests.unit.test_kernel_mover import ShmPool, _landed, hold_begin, load_one, shm

__all__ = ["shm"]  # the fixture, used by name


def _overlap(w: World) -> None:
    for c in w.consumers:
        assert c.kernel is not None
        c.kernel.overlap = True  # as on a GPU (the host copy itself stays synchronous)


def test_a_warm_kernel_load_has_its_bytes_moving_before_load_returns(shm: ShmPool) -> None:
    w = World(p_memory=shm)
    try:
        _overlap(w)
        first = load_one(w, "r1")
        assert "handoff" not in first.stages  # a new pair: handshake, mapping in a worker
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("r2", 45)
        w.consumers[0].load(handle, d_tabs)
        assert _landed(w, before, 45, d_tabs)  # copied on this thread (CPU: synchronously)
        (out,) = w.wait()
        assert out.ok and out.mover == "kernel", out.error
        assert {"handoff", "launch"} <= out.stages.keys()
        assert out.stages["queue"] < 0.01
        check_bytes(w, before, 45, 0, d_tabs)
    finally:
        w.close()


@pytest.mark.parametrize("kernel", [True, False])
def test_a_warm_load_plans_on_the_callers_thread_and_a_worker_moves_it(
    shm: ShmPool, kernel: bool
) -> None:
    """Host copies (and pulls) wait for P's answer: the caller's thread sends ``begin``
    and plans; a worker takes the answer, then moves the bytes."""
    w = World(p_memory=shm)
    try:
        if not kernel:
            w.consumers[0].kernel = None
        load_one(w, "r1")
        out = load_one(w, "r2")
        assert out.mover == ("kernel" if kernel else "pull")
        assert "handoff" in out.stages and "launch" not in out.stages
        w.consumers[0].inline = False
        assert "handoff" not in load_one(w, "r3").stages
    finally:
        w.close()


def test_a_busy_channel_sends_the_load_to_a_worker_and_none_waits_on_another(
    shm: ShmPool, monkeypatch
) -> None:
    """P holds each ``begin`` answer 50 ms: the first load's inline ``begin`` keeps the
    fast channel until a worker takes its answer, so loads made meanwhile go to the
    workers whole (over the peer's own channel). Seven loads at once, two workers: all
    end (an inline start holding a channel a worker waits on would hang here), every
    request's blocks (disjoint on both sides) byte-exact."""
    w = World(p_memory=shm)
    try:
        _overlap(w)
        load_one(w, "r0")
        hold_begin(w, monkeypatch, lambda: False, 0.05)
        d, rng = w.consumers[0], np.random.default_rng(3)
        p_ids, d_ids = rng.permutation(32), rng.permutation(64)
        loads = []
        for i in range(7):
            n = 17 + i
            p_tabs = [[int(x) for x in p_ids[4 * i + 2 * g : 4 * i + 2 * g + 2]] for g in (0, 1)]
            d_tabs = [[int(x) for x in d_ids[6 * i + 3 * g : 6 * i + 3 * g + 3]] for g in (0, 1)]
            for r in range(w.p.par.world):
                fill_source(SPEC, w.p.par, r, w.p.layouts[r], w.p.bufs[r], n, p_tabs)
            loads.append((w.producer.prefill_done(f"r{i + 1}", p_tabs, n), d_tabs))
        want = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        for handle, d_tabs in loads:
            d.load(handle, d_tabs)
            want[0] = expected_dest(
                w.d.spec, w.d.par, 0, w.d.layouts[0], want[0], handle.n_tokens, 0, d_tabs
            )
        outs = {o.request_id: o for o in w.wait(7, timeout=30)}
        assert all(o.ok for o in outs.values()), [o.error for o in outs.values()]
        inline = [rid for rid, o in outs.items() if "handoff" in o.stages]
        assert "r1" in inline and len(inline) < 7, inline
        for got, exp in zip(w.d.bufs[0], want[0], strict=True):
            assert np.array_equal(got, exp)
    finally:
        w.close()


def test_a_plan_failing_on_the_callers_thread_fails_the_load_and_frees_p_at_once(
    shm: ShmPool, monkeypatch
) -> None:
    """The error is the load's outcome (never the caller's exception); P's answer to the
    inline ``begin`` is taken first, so ``fail`` carries its token and P frees the
    blocks at once; the next load goes through."""
    w = World(p_memory=shm)
    try:
        _overlap(w)
        load_one(w, "r1")
        real = Geometry.plan
        calls = {"n": 0}

        def broken(self, *a, **k):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            raise PlanError("plan refused")

        monkeypatch.setattr(Geometry, "plan", broken)
        handle, d_tabs = w.request("r2", 45)
        w.consumers[0].load(handle, d_tabs)
        assert calls["n"] == 1 and threading.current_thread() is threading.main_thread()
        (out,) = w.wait()
        assert not out.ok and "plan refused" in out.error and "handoff" in out.stages
        freed = w.producer.freed(wait_for=2)
        assert {f.request_id: f.reason for f in freed}["r2"] == LeaseState.DONE
        monkeypatch.setattr(Geometry, "plan", real)
        load_one(w, "r3", 30)
    finally:
        w.close()


def test_a_p_restarted_since_is_met_in_a_worker(shm: ShmPool) -> None:
    """A handle of a new P epoch is never started inline (the peer cached is the old
    epoch's): the worker's handshake meets the new one."""
    w = World(p_memory=shm)
    try:
        load_one(w, "r1")
        w.producer.epoch = "restarted"
        handle, d_tabs = w.request("r2", 45)
        assert handle.epoch == "restarted"
        peer = w.consumers[0].peers.known(handle)
        assert peer is not None and peer.epoch != handle.epoch
        assert w.consumers[0].peers.ready(handle) is None
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok and "handoff" not in out.stages, out.error
        check_bytes(w, before, 45, 0, d_tabs)
        assert w.consumers[0].peers.known(handle).epoch == "restarted"  # type: ignore[union-attr]
    finally:
        w.close()


def test_an_inline_start_costs_the_caller_little(shm: ShmPool) -> None:
    """Not a timing test of speed: a sanity bound that the caller's thread does no
    waiting (P holds its answers 200 ms; load returns well before)."""
    w = World(p_memory=shm)
    try:
        load_one(w, "r1")
        real = w.producer.leases.on_op

        def slow(msg):  # type: ignore[no-untyped-def]
            if msg.op == "begin":
                time.sleep(0.2)
            return real(msg)

        w.producer.leases.on_op = slow  # type: ignore[method-assign]
        handle, d_tabs = w.request("r2", 45)
        t0 = time.monotonic()
        w.consumers[0].load(handle, d_tabs)
        assert time.monotonic() - t0 < 0.15
        (out,) = w.wait()
        assert out.ok and "handoff" in out.stages, out.error
    finally:
        w.close()
