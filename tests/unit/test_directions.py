"""AUTO mode: D measures READ and WRITE with each P once and pushes only where WRITE is
clearly faster (GPU memory between processes without RDMA: READ emulated over TCP). A D
transport whose READs are slow stands in for that pair; bytes stay byte-exact either way."""

from __future__ import annotations

import itertools
import time

import numpy as np

from kvbridge.connector.load import Mode
from kvbridge.connector.movers import MARGIN, PROBE_ROUNDS, PROBE_TIMEOUT_S, Directions
from kvbridge.transport.base import XferHandle
from kvbridge.transport.loopback import LoopbackTransport
from tests.unit.test_connector_loopback import World, check_bytes

READ_GBPS = 0.5  # GPU-to-GPU READ under UCX's emulation (docs/gpu.md)
READ_LATENCY_S = 0.05  # the toy P's regions are small: a fixed cost makes the gap plain


class SlowReads(LoopbackTransport):
    """READs take 50 ms plus their bytes at 0.5 GB/s; WRITEs (P's, into this agent) take
    what the loopback copy takes (plus the side channel's round trip to ask for them)."""

    def read(self, peer, local, remote, nbytes, notif=None) -> XferHandle:  # type: ignore[no-untyped-def]
        time.sleep(READ_LATENCY_S + float(np.asarray(nbytes).sum()) / (READ_GBPS * 1e9))
        return super().read(peer, local, remote, nbytes, notif)


def load(w: World, rid: str, n: int = 45):
    before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
    handle, d_tabs = w.request(rid, n)
    w.consumers[0].load(handle, d_tabs)
    (out,) = w.wait()
    assert out.ok, out.error
    check_bytes(w, before, n, 0, d_tabs)
    return out


def test_auto_pushes_where_reads_are_slow_and_measures_once() -> None:
    w = World(mode=Mode.AUTO, d_transport=SlowReads)
    try:
        out = load(w, "a")
        assert out.mover == "push" and "auto: push, measured READ" in out.reason, out.reason
        (found,) = w.consumers[0].directions.values()
        assert found.write_s * MARGIN < found.read_s and found.nbytes > 0
        assert load(w, "b").mover == "push"
        assert len(w.consumers[0].directions) == 1  # measured once per P epoch
    finally:
        w.close()


def test_auto_pulls_where_both_directions_cost_the_same() -> None:
    w = World(mode=Mode.AUTO)
    try:
        out = load(w, "a")
        assert out.mover == "pull" and "auto: pull, measured READ" in out.reason, out.reason
    finally:
        w.close()


def test_auto_pulls_when_p_cannot_push_and_says_why() -> None:
    w = World(mode=Mode.AUTO)
    try:
        for r, info in list(w.producer.ranks.items()):  # P ranks without a push channel
            import msgspec

            w.producer.ranks[r] = msgspec.structs.replace(info, endpoint="")
        out = load(w, "a")
        assert out.mover == "pull" and "serves no push channel" in out.reason, out.reason
    finally:
        w.close()


def test_the_choice_needs_a_clear_margin() -> None:
    assert Directions(1 << 20, 1.0, 0.5).choice()[0] is Mode.PUSH
    assert Directions(1 << 20, 1.0, 0.8).choice()[0] is Mode.PULL
    assert Directions(1 << 20, 0.01, 1.0).choice()[0] is Mode.PULL
    mode, why = Directions(0, 0.0, 0.0, "probe failed: x").choice()
    assert mode is Mode.PULL and "probe failed" in why


def test_the_whole_probe_has_one_deadline() -> None:
    """READs of 50 ms each: every wait of the probe gets what is left of one
    ``PROBE_TIMEOUT_S``, never a full timeout of its own (a stalled P costs the first
    load one probe timeout at most, not one per transfer)."""
    w = World(mode=Mode.AUTO, d_transport=SlowReads)
    try:
        d = w.consumers[0]
        given: list[float] = []
        real = d.transport.wait

        def wait(handle, timeout):  # type: ignore[no-untyped-def]
            given.append(timeout)
            return real(handle, timeout)

        d.transport.wait = wait  # type: ignore[method-assign]
        load(w, "a")
        probe = given[:PROBE_ROUNDS]  # the probe's READs come first
        assert all(b < a - 0.04 for a, b in itertools.pairwise(probe)), probe
        assert probe[0] <= PROBE_TIMEOUT_S
    finally:
        w.close()
