"""A load starts on the caller's thread (``Consumer.inline``, True by default) where
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

from kvbridge.connector.peers import Peer
from kvbridge.control.lease import LeaseState
from kvbridge.control.messages import LeaseReply
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


def _same_channel(peer: Peer) -> None:
    peer.fast = peer.client  # what the fast channel exists to avoid


@pytest.mark.parametrize("one_channel", [False, True])
def test_work_queued_before_an_inline_start_does_not_wait_on_its_channel(
    shm: ShmPool, monkeypatch, one_channel: bool
) -> None:
    """Both workers busy, two releases queued (each a call to P over the peer's
    channel), then a load started inline: its ``begin`` holds its channel until a worker
    takes it, and the releases run first. On the fast channel all end; on the peer's
    own channel (``one_channel``) the releases wait on it while the load waits behind
    them: nothing moves until the test takes the load's answer by hand."""
    if one_channel:
        monkeypatch.setattr(Peer, "__post_init__", _same_channel)
    w = World(p_memory=shm)
    gate = threading.Event()
    try:
        d = w.consumers[0]
        load_one(w, "r0")
        assert [f.request_id for f in w.producer.freed(wait_for=1)] == ["r0"]
        released = [w.request(f"q{i}", 20)[0] for i in range(2)]
        for _ in range(2):  # both workers busy (not loads: one may start inline)
            d._pool.submit(gate.wait, 5)
        for handle in released:
            d.release(handle)
        d.load(*w.request("i", 20))
        gate.set()
        if one_channel:
            time.sleep(1.0)
            assert not d.poll() and not w.producer.freed()  # they hold each other
            job = d._loads["i"]
            assert job.started is not None  # its run still queued behind the releases
            assert job.peer is not None and job.peer.fast is job.peer.client
            job.started.answer.take(quiet=True)  # frees the channel: all go on
            (out,) = w.wait(1, timeout=10)
            assert out.ok, out.error
            return
        (out,) = w.wait(1, timeout=10)
        assert out.ok and out.request_id == "i" and "handoff" in out.stages, out.error
        freed = {f.request_id: f.reason for f in w.producer.freed(wait_for=3)}
        assert {"q0", "q1", "i"} <= freed.keys(), freed
    finally:
        gate.set()
        job = d._loads.get("i")
        if job is not None and job.started is not None:  # never leave the deadlock behind
            job.started.answer.take(quiet=True)
        w.close()


def test_a_lease_refused_after_an_inline_launch_fails_the_load_and_holds_nothing(
    shm: ShmPool, monkeypatch
) -> None:
    """P answers "expired" to a ``begin`` whose copies were launched on the caller's
    thread: the load fails (never reported done), and afterwards nothing is held: the
    peer unused, its fast channel free, every mapping without users, nothing pending."""
    w = World(p_memory=shm)
    try:
        _overlap(w)
        d = w.consumers[0]
        load_one(w, "r0")
        real = w.producer.leases.on_op
        monkeypatch.setattr(
            w.producer.leases,
            "on_op",
            lambda m: LeaseReply("expired") if m.op == "begin" else real(m),
        )
        handle, d_tabs = w.request("r1", 45)
        d.load(handle, d_tabs)
        (out,) = w.wait()
        assert not out.ok and "LeaseExpired" in out.error, out.error
        assert {"handoff", "launch"} <= out.stages.keys()
        time.sleep(0.2)
        peer = d.peers.known(handle)
        assert peer is not None and peer.users == 0 and peer.fast is not None
        assert not peer.fast._lock.locked() and d.pending() == 0
        assert d.kernel is not None and all(m.users == 0 for m in d.kernel._sources.values())
    finally:
        w.close()


def test_close_ends_a_load_started_inline_that_no_worker_ran(shm: ShmPool) -> None:
    """Both workers busy, a load started inline waits in the queue, then the consumer
    closes: the queued run is cancelled, and close() takes P's answer (freeing the fast
    channel it then closes), ends the copies and tells P ``fail`` with the token: P
    frees the blocks at once. close() returns."""
    w = World(p_memory=shm)
    gate = threading.Event()
    try:
        _overlap(w)
        d = w.consumers[0]
        load_one(w, "r0")
        for _ in range(2):
            d._pool.submit(gate.wait, 1.0)
        d.load(*w.request("i", 20))
        assert d.pending() == 1
        closed = threading.Event()
        threading.Thread(target=lambda: (d.close(), closed.set()), daemon=True).start()
        gate.set()
        assert closed.wait(8), "Consumer.close hung"
        freed = w.producer.freed(wait_for=2)
        assert {f.request_id: f.reason for f in freed}["i"] == LeaseState.DONE
    finally:
        gate.set()
        w.close()


def test_inline_starts_only_where_a_worker_is_idle_for_it(shm: ShmPool, monkeypatch) -> None:
    """Loads beyond the idle workers go to the queue whole: a load started inline waits
    for no one (nor does its lease, unrenewable until a worker takes its answer)."""
    w = World(p_memory=shm)
    try:
        d = w.consumers[0]
        load_one(w, "r0")
        hold_begin(w, monkeypatch, lambda: False, 0.05)
        loads = [w.request(f"r{i}", 20) for i in range(1, 5)]
        for handle, d_tabs in loads:
            d.load(handle, d_tabs)
        outs = {o.request_id: o for o in w.wait(4, timeout=20)}
        assert all(o.ok for o in outs.values()), [o.error for o in outs.values()]
        assert "handoff" in outs["r1"].stages  # both workers idle: started inline
        assert "handoff" not in outs["r3"].stages and "handoff" not in outs["r4"].stages
        assert d._free == 2  # every worker's slot given back
    finally:
        w.close()
