"""AUTO mode: D measures each direction's costs with each P epoch once (a round, a
descriptor, a byte) and prices every request both ways (:mod:`kvbridge.connector.movers.choice`).
D transports whose READs are slow in one way or another stand in for the pairs that
differ; bytes stay byte-exact whichever way a request goes."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from kvbridge.connector.load import Mode
from kvbridge.connector.movers.choice import PROBE_ROUNDS, PROBE_TIMEOUT_S, SLOW_NET_S
from kvbridge.transport.base import XferHandle
from kvbridge.transport.loopback import LoopbackTransport
from tests.unit.test_connector_loopback import World, check_bytes

READ_LATENCY_S = 0.05  # the toy P's regions are small: a fixed cost makes the gap plain


class SlowReads(LoopbackTransport):
    """READs take 50 ms plus their bytes at 0.5 GB/s; WRITEs (P's, into this agent) take
    what the loopback copy takes (plus the side channel's round trip to ask for them)."""

    def read(self, peer, local, remote, nbytes, notif=None) -> XferHandle:  # type: ignore[no-untyped-def]
        time.sleep(READ_LATENCY_S + float(np.asarray(nbytes).sum()) / 0.5e9)
        return super().read(peer, local, remote, nbytes, notif)


class TcpReads(LoopbackTransport):
    """READs move 20 MB/s (a READ emulated over TCP between GPUs, scaled to the toy
    model's regions); nothing else differs."""

    def read(self, peer, local, remote, nbytes, notif=None) -> XferHandle:  # type: ignore[no-untyped-def]
        time.sleep(float(np.asarray(nbytes).sum()) / 20e6)
        return super().read(peer, local, remote, nbytes, notif)


class LateReads(LoopbackTransport):
    """Every READ waits 3 ms before it starts, whatever it moves."""

    def read(self, peer, local, remote, nbytes, notif=None) -> XferHandle:  # type: ignore[no-untyped-def]
        time.sleep(3e-3)
        return super().read(peer, local, remote, nbytes, notif)


def costly_writes(w: World, per_desc_s: float) -> None:
    """P's WRITEs cost ``per_desc_s`` per descriptor (P's agents)."""
    for worker in w.workers:
        agent = worker.transport
        real = agent.write

        def write(peer, local, remote, nbytes, notif=None, real=real):  # type: ignore[no-untyped-def]
            time.sleep(per_desc_s * len(nbytes))
            return real(peer, local, remote, nbytes, notif)

        agent.write = write  # type: ignore[method-assign]


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
        assert out.mover == "push" and "auto: push, priced pull" in out.reason, out.reason
        (found,) = w.consumers[0].pair_costs.values()
        assert found.read is not None and found.write is not None and found.nbytes > 0
        assert found.read.round_s > READ_LATENCY_S * 0.9 > found.write.round_s
        assert load(w, "b").mover == "push"
        assert len(w.consumers[0].pair_costs) == 1  # measured once per P epoch
    finally:
        w.close()


def test_a_read_at_tcp_speed_is_never_chosen() -> None:
    """However small the request: one 4-token load, whose one round would be cheaper
    pulled by price, is pushed all the same."""
    w = World(mode=Mode.AUTO, d_transport=TcpReads)
    try:
        out = load(w, "a", 4)
        assert out.mover == "push" and "never READ" in out.reason, out.reason
        (found,) = w.consumers[0].pair_costs.values()
        assert found.slow() == "READ"
        assert found.read is not None and found.read.byte_s * found.nbytes >= SLOW_NET_S
    finally:
        w.close()


def test_auto_pulls_where_both_directions_cost_the_same() -> None:
    w = World(mode=Mode.AUTO)
    try:
        out = load(w, "a")
        assert out.mover == "pull" and "auto: pull, priced pull" in out.reason, out.reason
        (found,) = w.consumers[0].pair_costs.values()
        assert found.slow() == ""
    finally:
        w.close()


def test_the_choice_is_per_request() -> None:
    """READs wait 3 ms each, P's WRITEs cost 10 µs a descriptor, nothing staged: a small
    request is pushed (one round each way, few descriptors), a request of thousands of
    runs pulled (one late READ beats thousands of costly WRITE descriptors), one pair."""
    w = World(mode=Mode.AUTO, d_transport=LateReads)
    try:
        costly_writes(w, 10e-6)
        w.consumers[0].staging = False
        small, big = load(w, "small", 4), load(w, "big", 250)
        assert small.descriptors < 200 < 1000 < big.descriptors, (small, big)
        assert small.mover == "push" and "auto: push, priced" in small.reason, small.reason
        assert big.mover == "pull" and "auto: pull, priced" in big.reason, big.reason
        assert len(w.consumers[0].pair_costs) == 1
    finally:
        w.close()


def test_a_staged_pull_counts_its_spans() -> None:
    w = World(mode=Mode.AUTO)
    try:
        out = load(w, "a", 200)
        assert out.mover == "pull" and out.staged_runs > 0
        assert 0 < out.descriptors < out.staged_runs, out
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


@pytest.mark.parametrize("mode", [Mode.PULL, Mode.PUSH])
def test_a_set_mode_measures_nothing(mode: Mode) -> None:
    w = World(mode=mode)
    try:
        out = load(w, "a")
        assert out.mover == mode.value and f"{mode.value} mode" in out.reason
        assert not w.consumers[0].pair_costs
    finally:
        w.close()


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
        probe = given[: 3 * PROBE_ROUNDS]  # the probe's READs come first
        assert all(b < a - 0.04 for a, b in itertools.pairwise(probe)), probe
        assert probe[0] <= PROBE_TIMEOUT_S
    finally:
        w.close()
