"""AUTO mode: D measures each direction's costs with each P epoch once (a round, a
descriptor, a byte) and prices every request both ways (:mod:`kvbridge.connector.movers.choice`).
D transports whose READs are slow in one way or another stand in for the pairs that
differ; bytes stay byte-exact whichever way a request goes."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np
import pytest

from kvbridge.connector.load import Mode
from kvbridge.connector.movers.choice import PROBE_ROUNDS, PROBE_TIMEOUT_S
from kvbridge.errors import TransferTimeout
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
        assert found.read is not None and found.write is not None and found.at > 0
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
        assert found.never == "READ"
    finally:
        w.close()


def test_auto_pulls_where_both_directions_cost_the_same() -> None:
    w = World(mode=Mode.AUTO)
    try:
        out = load(w, "a")
        assert out.mover == "pull" and "auto: pull, priced pull" in out.reason, out.reason
        (found,) = w.consumers[0].pair_costs.values()
        assert found.never == ""
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


def test_direct_loads_teach_the_direction_they_took() -> None:
    """Nothing staged, thousands of small runs: a pulled load moves READ's descriptor
    cost and leaves WRITE's; a pushed one (READ at TCP speed) the other way round."""
    for transport, went in ((LoopbackTransport, "pull"), (TcpReads, "push")):
        w = World(mode=Mode.AUTO, d_transport=transport)
        try:
            w.consumers[0].staging = False
            load(w, "warm", 4)
            (before,) = w.consumers[0].pair_costs.values()
            out = load(w, "big", 250)
            assert out.mover == went and out.descriptors > 1000, out
            (after,) = w.consumers[0].pair_costs.values()
            taught, kept = ("read", "write") if went == "pull" else ("write", "read")
            assert getattr(after, kept) == getattr(before, kept)
            assert getattr(after, taught).desc_s != getattr(before, taught).desc_s
        finally:
            w.close()


def test_the_stager_stages_by_the_pairs_measured_link() -> None:
    """The same request, the pair's READ descriptor made dear or cheap: staged in the
    one, direct in the other (the stager weighs the pair's link, not its own guess)."""
    w = World(mode=Mode.AUTO)
    try:
        d = w.consumers[0]
        load(w, "warm", 4)
        ((key, found),) = d.pair_costs.items()
        assert found.read is not None
        got = []
        for desc_s in (1e-4, 1e-8):
            d.pair_costs[key] = replace(found, read=replace(found.read, desc_s=desc_s))
            out = load(w, f"r{desc_s}", 200)
            assert out.mover == "pull", out.reason
            got.append(out.staged_runs)
        assert got[0] > 0 and got[1] == 0, got
    finally:
        w.close()


def test_a_probe_gives_its_staging_slot_back() -> None:
    w = World(mode=Mode.AUTO)
    try:
        stager = w.consumers[0].stager
        assert stager is not None
        free = stager.pool._free.qsize()
        load(w, "a")
        assert w.consumers[0].pair_costs and stager.pool._free.qsize() == free
        assert stager.pool.quarantined == 0
    finally:
        w.close()


def fail_probe_writes(w: World, refuse: bool) -> None:
    """P's ranks answer the probe's WRITEs with ``PushRefused`` (``refuse``: their
    ledger's, before anything is posted) or with an error after posting (a WRITE still
    running when P gave up on it); loads' pushes go as before."""
    for worker in w.workers:
        admit, write, agent = worker.ledger.admit, worker._write, worker.transport

        def admitted(msg, admit=admit):  # type: ignore[no-untyped-def]
            return "replayed" if refuse and msg.request_id.startswith("probe:") else admit(msg)

        def kept(msg, peer, src, dst, n, write=write, agent=agent):  # type: ignore[no-untyped-def]
            if msg.request_id.startswith("probe:"):
                agent.write(peer, src, dst, n, msg.notif)
                raise TransferTimeout("the probe's WRITE is still running")
            return write(msg, peer, src, dst, n)

        worker.ledger.admit = admitted  # type: ignore[method-assign]
        worker._write = kept  # type: ignore[method-assign]


@pytest.mark.parametrize("refuse", [True, False])
def test_a_probe_p_refused_gives_its_slot_back_one_p_failed_keeps_it(refuse: bool) -> None:
    """P refused the probe's WRITE before posting it: nothing can land in the slot, it
    goes back. P failed after posting it: the WRITE may still land, the slot stays out.
    Either way the load pulls, saying why."""
    w = World(mode=Mode.AUTO)
    try:
        fail_probe_writes(w, refuse)
        stager = w.consumers[0].stager
        assert stager is not None
        free = stager.pool._free.qsize()
        out = load(w, "a")
        assert stager.pool.quarantined == (0 if refuse else 1)
        assert stager.pool._free.qsize() == free - stager.pool.quarantined
        said = "probe refused" if refuse else "probe failed"
        assert out.mover == "pull" and said in out.reason, out.reason
    finally:
        w.close()


def test_a_failed_probe_is_measured_again_later_and_nobody_waits_for_a_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No free slot at the first load: it pulls, saying why; once ``PROBE_RETRY_S`` has
    passed, a load measures again (and pushes: READs are slow). Meanwhile loads of the
    pair being measured pull at once instead of waiting for the probe."""
    from kvbridge.connector.movers import choice, registry

    w = World(mode=Mode.AUTO, d_transport=SlowReads)
    try:
        d = w.consumers[0]
        assert d.stager is not None
        pool = d.stager.pool
        held = []
        while (s := pool.take(0.0)) is not None:
            held.append(s)
        monkeypatch.setattr(choice, "PROBE_TIMEOUT_S", 0.2)  # the wait for a slot
        first = load(w, "a")
        assert first.mover == "pull" and "no free staging slot" in first.reason, first.reason
        for s in held:
            pool.give_back(s, True)
        assert load(w, "b").mover == "pull"  # kept for PROBE_RETRY_S
        monkeypatch.setattr(registry, "PROBE_RETRY_S", 0.0)
        ((key, _),) = d.pair_costs.items()
        d.pair_costs[key] = choice.PairCosts(note=registry.MEASURING)  # as while probing
        busy = load(w, "c")
        assert busy.mover == "pull" and registry.MEASURING in busy.reason, busy.reason
        d.pair_costs[key] = choice.PairCosts(note="no free staging slot", at=1.0)
        assert load(w, "d").mover == "push"  # measured again
    finally:
        w.close()


def test_a_probe_that_cannot_succeed_is_not_made_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cause that does not pass (P serves no push channel, no staging slot at all, a
    region too small): the pair pulls for good, without probing on every load."""
    from kvbridge.connector.movers import choice, registry

    w = World(mode=Mode.AUTO, d_transport=SlowReads)
    try:
        d = w.consumers[0]
        monkeypatch.setattr(registry, "PROBE_RETRY_S", 0.0)
        calls = []
        real = registry.measure

        def counted(*args: object) -> choice.PairCosts:
            calls.append(1)
            return real(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(registry, "measure", counted)
        assert load(w, "a").mover == "push"  # measured: READs are slow
        ((key, _),) = d.pair_costs.items()
        d.pair_costs[key] = choice.PairCosts(note="P rank 0 serves no push channel")
        for rid in ("b", "c"):
            out = load(w, rid)
            assert out.mover == "pull" and "serves no push channel" in out.reason, out.reason
        assert len(calls) == 1
        d.pair_costs[key] = choice.PairCosts(note="no free staging slot", at=1.0)
        assert load(w, "d").mover == "push" and len(calls) == 2  # a passing cause: again
    finally:
        w.close()
