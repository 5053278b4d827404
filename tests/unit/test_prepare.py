"""``Consumer.prepare``: a P instance connected before its first request (handshake, the
kernel mover's mapping and geometry, the fast channel, a throwaway plan), so that first
load starts on the caller's thread like a warm one; errors typed in the future, and the
consumer serving on after them."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvbridge.connector.consumer import Consumer
from kvbridge.connector.load import Mode
from kvbridge.connector.movers.choice import PROBE_ROUNDS
from kvbridge.connector.producer import Producer
from kvbridge.errors import PeerError, TransportError
from tests.unit.test_connector_loopback import SECRET, World, check_bytes
from tests.unit.test_kernel_mover import ShmPool, _landed, load_one, shm

__all__ = ["shm"]  # the fixture, used by name


def test_a_prepared_pairs_first_load_starts_inline_with_its_bytes_moving(
    shm: ShmPool,
) -> None:
    w = World(p_memory=shm)
    try:
        d = w.consumers[0]
        assert d.kernel is not None
        d.kernel.overlap = True  # as on a GPU
        epoch = d.prepare(w.producer.endpoint, "P").result(timeout=10)
        assert epoch == w.producer.epoch
        assert d.prepare(w.producer.endpoint, "P").result(timeout=10) == epoch  # no-op
        assert len(d.peers) == 1
        peer = d.peers.known(w.request("probe", 8)[0])
        assert peer is not None and peer.users == 0 and d.kernel.ready(peer)
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("r1", 45)
        d.load(handle, d_tabs)
        assert _landed(w, before, 45, d_tabs)  # the very first load, copied inline
        (out,) = w.wait()
        assert out.ok and out.mover == "kernel", out.error
        assert {"handoff", "launch"} <= out.stages.keys()
        check_bytes(w, before, 45, 0, d_tabs)
    finally:
        w.close()


def test_an_unprepared_pairs_first_load_goes_to_a_worker(shm: ShmPool) -> None:
    w = World(p_memory=shm)
    try:
        out = load_one(w, "r1")
        assert "handoff" not in out.stages and out.mover == "kernel"
    finally:
        w.close()


def test_preparing_another_engine_or_a_dead_endpoint_fails_typed_and_d_serves_on(
    shm: ShmPool,
) -> None:
    w = World(p_memory=shm, timeout_s=1.0)
    try:
        d = w.consumers[0]
        with pytest.raises(PeerError, match="stale or forged"):
            d.prepare(w.producer.endpoint, "not-P").result(timeout=10)
        with pytest.raises(TransportError):
            d.prepare("tcp://127.0.0.1:9", "P").result(timeout=10)
        assert len(d.peers) == 0
        load_one(w, "r1")
    finally:
        w.close()


def test_prepares_run_on_their_own_thread_and_loads_never_wait_behind_them(
    shm: ShmPool,
) -> None:
    """Two prepares of dead endpoints (each waits out its 2 s timeout) do not hold the
    load workers: a load of a prepared P meanwhile starts inline and a worker takes it
    over at once."""
    w = World(p_memory=shm, timeout_s=2.0)
    try:
        d = w.consumers[0]
        d.prepare(w.producer.endpoint, "P").result(timeout=10)
        dead = [d.prepare(f"tcp://127.0.0.1:{port}", f"P{port}") for port in (9, 11)]
        out = load_one(w, "r1")
        assert out.stages["handoff"] < 0.5, out.stages
        for f in dead:
            with pytest.raises(TransportError):
                f.result(timeout=10)
    finally:
        w.close()


def test_preparing_again_after_p_restarted_replaces_the_cached_peer(shm: ShmPool) -> None:
    w = World(p_memory=shm)
    try:
        d = w.consumers[0]
        assert d.prepare(w.producer.endpoint, "P").result(timeout=10) == w.producer.epoch
        w.producer.epoch = "restarted"
        old = d.peers.known(w.request("before", 8)[0])
        assert d.prepare(w.producer.endpoint, "P").result(timeout=10) == "restarted"
        assert old is not None and old.users == 0 and not d.peers._stale  # dropped
        handle = w.request("r1", 45)[0]
        peer = d.peers.ready(handle)
        assert peer is not None and peer.epoch == "restarted"
        assert peer.fast is not None and peer.fast._sock is not None  # connected ahead
        d.peers.done(peer)
        out = load_one(w, "r2")
        assert "handoff" in out.stages  # the restarted P's first load starts inline
    finally:
        w.close()


def test_only_a_target_may_leave_the_epoch_open_a_handle_may_not(shm: ShmPool) -> None:
    """A handle without epoch is stale or forged: it takes no cached peer and fails its
    handshake (only :meth:`Consumer.prepare`'s target means "whichever P answers")."""
    w = World(p_memory=shm)
    try:
        d = w.consumers[0]
        load_one(w, "r1")
        handle = w.request("r2", 45)[0]
        blank = msgspec.structs.replace(handle, epoch="")
        assert d.peers.ready(blank) is None
        with pytest.raises(PeerError, match="stale or forged"):
            d.peers.get(blank)
    finally:
        w.close()


def counted_reads(d: Consumer) -> list[str]:
    """The peer of every READ ``d`` posts from now on."""
    reads: list[str] = []
    real = d.transport.read

    def read(peer, *a, **k):  # type: ignore[no-untyped-def]
        reads.append(peer)
        return real(peer, *a, **k)

    d.transport.read = read  # type: ignore[method-assign]
    return reads


def test_a_pair_served_over_nixl_gets_its_connections_made_ahead() -> None:
    """P's memory not mapped here (loads pull over NIXL): prepare READs once from each
    source rank (P serves no push channel in pull mode), into a staging slot, never a
    KV block (D's bytes unchanged); the first load is byte-exact and pulls."""
    w = World()
    try:
        d = w.consumers[0]
        reads = counted_reads(d)
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        d.prepare(w.producer.endpoint, "P").result(timeout=10)
        peer = d.peers.known(w.request("probe", 8)[0])
        assert peer is not None and sorted(reads) == sorted(peer.agents.values())
        assert all(np.array_equal(a, b) for a, b in zip(w.d.bufs[0], before[0], strict=True))
        out = load_one(w, "r1")
        assert out.mover == "pull" and "handoff" in out.stages
    finally:
        w.close()


def test_auto_measures_the_direction_in_prepare_not_in_the_first_load(monkeypatch) -> None:
    from kvbridge.connector.movers import registry as movers

    w = World(mode=Mode.AUTO)
    try:
        d = w.consumers[0]
        d.prepare(w.producer.endpoint, "P").result(timeout=10)
        assert len(d.pair_costs) == 1
        calls = []
        monkeypatch.setattr(movers, "measure", lambda *a: calls.append(a))
        out = load_one(w, "r1")
        assert "priced pull" in out.reason and not calls, out.reason
    finally:
        w.close()


def test_push_mode_prepares_with_the_probe_both_ways_and_keeps_no_direction() -> None:
    """Push: P's WRITEs are what loads use, so prepare runs the probe (READs and P's
    WRITEs into a staging slot) against every source rank; only AUTO keeps its result."""
    w = World(mode=Mode.PUSH)
    try:
        d = w.consumers[0]
        reads = counted_reads(d)
        d.prepare(w.producer.endpoint, "P").result(timeout=10)
        peer = d.peers.known(w.request("probe", 8)[0])
        assert peer is not None and not d.pair_costs
        rounds = 3 * PROBE_ROUNDS  # three READs a round (one run, many, one long)
        assert sorted(reads) == sorted(list(peer.agents.values()) * rounds)
        assert load_one(w, "r1").mover == "push"
    finally:
        w.close()


@pytest.mark.parametrize("mode", [Mode.PULL, Mode.PUSH, Mode.AUTO])
def test_a_stalled_p_costs_prepare_one_staging_slot_at_most_and_no_failure(mode: Mode) -> None:
    """Both P ranks' transfers stall: the first rank's warm-up times out, prepare stops
    there (logged) and still returns the epoch; at most one slot stays out of the pool
    (a READ may yet land in it), AUTO keeps no direction, and once P moves again a load
    goes through."""
    w = World(mode=mode, timeout_s=1.0)
    try:
        d = w.consumers[0]
        assert d.stager is not None
        for agent in ("p0", "p1"):
            d.transport.stall(agent)  # type: ignore[attr-defined]
        assert d.prepare(w.producer.endpoint, "P").result(timeout=30) == w.producer.epoch
        assert d.stager.pool.quarantined <= 1 and not d.pair_costs
        for agent in ("p0", "p1"):
            d.transport.resume(agent)  # type: ignore[attr-defined]
        load_one(w, "r1")
    finally:
        w.close()


def test_auto_loads_do_not_wait_behind_a_prepares_measurement(monkeypatch) -> None:
    """Prepare measures outside the lock loads read the pair costs under: a load of a P
    measured already takes its usual time while a prepare measures 2 s."""
    import time

    from kvbridge.connector import prepare as prepare_module
    from kvbridge.connector.movers.choice import PairCosts

    w = World(mode=Mode.AUTO)
    try:
        d = w.consumers[0]
        load_one(w, "warm")  # measured with this P

        def slow(*_):  # type: ignore[no-untyped-def]
            time.sleep(2.0)
            return PairCosts(note="slow")

        monkeypatch.setattr(prepare_module, "measure", slow)
        running = d.prepare(w.producer.endpoint, "P")
        time.sleep(0.3)
        t0 = time.monotonic()
        load_one(w, "r1")
        assert time.monotonic() - t0 < 1.5
        running.result(timeout=10)
    finally:
        w.close()


def test_preparing_p_prepares_the_instances_of_its_own_it_names(shm: ShmPool) -> None:
    """A vLLM P's park is a P instance of its own (``P.park``): P names it at the
    handshake, and D prepares it with P, so its first parked load needs no handshake; a
    name that is not one of P's own (``Q``) is not followed, one that fails is logged
    and P is prepared all the same, and only the first 4 named are followed."""
    w = World(p_memory=shm, timeout_s=1.0)
    names = ("P.park", "Q", "P.x", "P.y")
    made = {n: Producer(n, w.spec, w.p.par, SECRET) for n in names}
    try:
        for prod in made.values():
            for info in w.producer.ranks.values():
                prod.add_rank(info)
        dead = ("P.dead", "tcp://127.0.0.1:9")  # a companion that fails: logged only
        named = [(n, made[n].endpoint) for n in ("Q", "P.park", "P.x", "P.y")]
        w.producer.companions = [named[0], dead, *named[1:]]  # P.y is the 5th
        d = w.consumers[0]
        assert d.prepare(w.producer.endpoint, "P").result(timeout=20) == w.producer.epoch
        handle = made["P.park"].prefill_done("r1", [[1], [2, 3]], 20)
        assert len(d.peers) == 3 and d.peers.ready(handle) is not None  # P, P.park, P.x
        d.peers.done(d.peers.ready(handle))
        for n in ("Q", "P.y"):
            assert d.peers.known(made[n].prefill_done("r2", [[1], [2, 3]], 20)) is None
    finally:
        w.close()
        for prod in made.values():
            prod.close()
