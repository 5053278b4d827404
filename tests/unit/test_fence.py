"""A failed load is reported only once none of its bytes can land (the fence).

The test loopback transport's ``stall(peer)`` keeps transfers with that peer pending,
and ``resume`` lands them late, as a stopped P rank or a cut link does over TCP (measured
with NIXL: releasing or removing the peer does not stop a READ). Before the fence, D
reported these loads failed at the deadline and the late bytes then overwrote blocks
the engine had been told were free.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.connector.consumer import Consumer, Mode, Outcome
from kvbridge.connector.fence import Fence, Held
from kvbridge.control.messages import PushFence, PushRuns
from kvbridge.errors import PeerError
from kvbridge.transport.loopback import Fabric, LoopbackTransport
from tests.support.stalling import StallingLoopback
from tests.unit.test_connector_loopback import SECRET, World

SCRIBBLE = 0xAB


def d_transport(w: World) -> StallingLoopback:
    t = w.consumers[0].transport
    assert isinstance(t, StallingLoopback)
    return t


def scribble(w: World) -> None:
    for b in w.d.bufs[0]:
        b[:] = SCRIBBLE


def untouched(w: World) -> bool:
    return all(bool((b == SCRIBBLE).all()) for b in w.d.bufs[0])


def stall_then_resume(w: World, stalled: list[StallingLoopback], peers: list[str]) -> None:
    """Load a request while ``stalled`` hold transfers to ``peers``; check the outcome
    is held past the deadline, resume, then check it is delivered (failed) and that
    nothing lands in D's memory once the engine could reuse it."""
    for t in stalled:
        for p in peers:
            t.stall(p)
    handle, d_tabs = w.request("late", 120)
    c = w.consumers[0]
    c.load(handle, d_tabs)
    time.sleep(1.2)  # deadline 0.3 s: a failure, but bytes may still land
    assert c.poll() == [] and c.fence.held() == 1 and c.pending() == 1
    t0 = time.monotonic()
    for t in stalled:
        for p in peers:
            t.resume(p)  # the late bytes land now, before the engine hears of the request
    (out,) = w.wait(timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert not out.ok and out.stages["fence"] > 0.8, out
    assert c.fence.held() == 0 and c.pending() == 0
    scribble(w)  # the engine reuses the blocks
    time.sleep(0.2)
    assert untouched(w)


def test_pull_failure_is_held_until_the_read_ended():
    w = World(timeout_s=0.3, staging_bytes=0)
    try:
        stall_then_resume(w, [d_transport(w)], ["p0", "p1"])
    finally:
        w.close()


def test_staged_pull_failure_gives_its_slot_back_once_the_read_ended():
    w = World(timeout_s=0.3)
    try:
        stager = w.consumers[0].stager
        assert stager is not None
        stall_then_resume(w, [d_transport(w)], ["p0", "p1"])
        assert stager.pool._free.qsize() == 2  # both slots free again
        handle, d_tabs = w.request("after", 200)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok and out.staged_runs > 0, out
    finally:
        w.close()


def test_push_failure_is_held_until_each_p_rank_says_its_writes_ended():
    w = World(timeout_s=0.3, mode=Mode.PUSH)
    try:
        writers = [wk.transport for wk in w.workers]
        assert all(isinstance(t, StallingLoopback) for t in writers)
        stall_then_resume(w, writers, ["d0"])  # type: ignore[arg-type]
    finally:
        w.close()


def test_a_fenced_push_is_refused_by_the_p_rank():
    w = World(timeout_s=0.3, mode=Mode.PUSH)
    try:
        client = w.consumers[0].peers
        handle, d_tabs = w.request("x", 40)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok
        peer = client.known(handle)
        assert peer is not None
        ch = peer.rank_client(0)
        assert ch.call(PushFence("y")).ended  # type: ignore[union-attr]
        empty = np.zeros(0, "<u8").tobytes()
        d_meta = w.consumers[0].metadata
        with pytest.raises(PeerError, match="fenced"):
            ch.call(PushRuns("y", d_meta, empty, empty, empty, b"n"))
    finally:
        w.close()


class SlowPosts(LoopbackTransport):
    """Each posted request takes 30 ms (NIXL copies inside the call over shared memory)."""

    def read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.03)
        return super().read(*args, **kwargs)


def test_posting_stops_at_the_deadline():
    """~1,700 runs posted 50 per request: 35 posts × 30 ms would take ~1 s; with a 0.1 s
    deadline D stops posting and reports within the deadline plus one post."""
    w = World()
    try:
        slow = Consumer(
            "D-slow", w.d.spec, w.d.par, 0, w.d.layouts[0], list(w.d.bound(0).bases),
            SlowPosts("d-slowpost", w.fabric), SECRET, transfer_timeout_s=0.1, staging_bytes=0,
        )  # fmt: skip
        slow.post_runs = 50
        try:
            handle, d_tabs = w.request("big", 200)
            slow.load(handle, d_tabs)
            end = time.monotonic() + 5
            out = []
            while not out and time.monotonic() < end:
                out = slow.poll()
                time.sleep(0.005)
            assert len(out) == 1 and not out[0].ok, out
            assert "while posting" in out[0].error, out[0].error
            # posting everything takes ~1 s; stopping at the deadline, well under that
            assert out[0].seconds - out[0].stages.get("queue", 0) < 0.6, out[0]
        finally:
            slow.close()
    finally:
        w.close()


def test_a_push_to_a_p_without_push_channels_fails_and_is_reported():
    """P ranks serve no push channel: D's push fails at once, typed, and the outcome is
    delivered (nothing was sent, nothing to fence); the peer is not pinned."""
    w = World(timeout_s=2.0)  # pull P: no push channels
    try:
        c = w.consumers[0]
        c.mode = Mode.PUSH
        handle, d_tabs = w.request("r1", 20)
        c.load(handle, d_tabs)
        (out,) = w.wait(timeout=3)
        assert not out.ok and "serves no push channel" in out.error, out.error
        assert c.pending() == 0 and c.fence.held() == 0
        peer = c.peers.known(handle)
        assert peer is not None and peer.users == 0
    finally:
        w.close()


def test_the_fence_survives_a_check_that_raises():
    """A check raising an unexpected error is logged and asked again; the outcome still
    arrives, and a clean-up that raises does not cost it."""
    got: list[Outcome] = []
    fence = Fence(LoopbackTransport("fence-only", Fabric()), got.append)
    calls = []

    def flaky() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("socket trouble")
        return True

    def broken_cleanup() -> None:
        raise OSError("already closed")

    try:
        fence.hold(Held(Outcome("x", False, error="E"), [], [flaky], [broken_cleanup]))
        end = time.monotonic() + 3
        while not got and time.monotonic() < end:
            time.sleep(0.01)
        assert [o.request_id for o in got] == ["x"] and len(calls) >= 2
        assert fence.held() == 0
    finally:
        fence.close()
