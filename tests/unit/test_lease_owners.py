"""A lease belongs to the D ranks that began it, and a push to one load: a duplicated
handle, a key holder's forged ``confirm``/``fail``/``renew`` or a replayed ``PushRuns``
never ends another D's lease early nor writes into reused blocks. Real Producer,
Consumers and ProducerWorkers over the loopback transport; P's engine overwrites its
blocks the moment they are freed."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from msgspec.structs import replace

from kvbridge.connector.consumer import Consumer, Mode
from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.movers.push_gather import PushLedger
from kvbridge.control.channel import Client
from kvbridge.control.lease import LeaseState
from kvbridge.control.messages import (
    LeaseOp,
    LeaseOpName,
    LeaseReply,
    PushRefused,
    PushRuns,
    tables_digest,
)
from kvbridge.errors import PlanError
from kvbridge.transport.loopback import LoopbackTransport
from tests.support.scenario import Side
from tests.unit.test_connector_loopback import SECRET, World, check_bytes
from tests.unit.test_lease_time import _resume, _until_begun


def second_d(w: World, engine: str) -> Consumer:
    """Another D instance (own memory, own transport) holding the same secret."""
    side = Side(w.d.spec, w.d.par, "block-major", 64)
    side.allocate(np.random.default_rng(3))
    c = Consumer(
        engine, side.spec, side.par, 0, side.layouts[0], list(side.bound(0).bases),
        LoopbackTransport(f"{engine}-0", w.fabric), SECRET, transfer_timeout_s=5.0,
    )  # fmt: skip
    c.side = side  # type: ignore[attr-defined]  # keeps its memory alive
    return c


def forged(
    h: TransferHandle, op: LeaseOpName, engine: str, epoch: str = "x", token: str = ""
) -> LeaseOp:
    """A key holder's lease op about ``h``'s request, claiming D rank 0 of ``engine``."""
    digest = tables_digest(h.block_tables, h.n_tokens)
    return LeaseOp(op, h.request_id, h.lease_id, digest, engine, 0, 1, epoch, token)


def call(w: World, op: LeaseOp) -> LeaseReply:
    client = Client(w.producer.endpoint, SECRET, 3.0)
    try:
        reply = client.call(op)
    finally:
        client.close()
    assert isinstance(reply, LeaseReply)
    return reply


def reuse_freed(w: World) -> list[str]:
    """P's engine reuses whatever was freed at once: every P byte overwritten."""
    freed = w.producer.freed()
    if freed:
        for bufs in w.p.bufs:
            for b in bufs:
                b[:] = 0xEE
    return [f.request_id for f in freed]


def stalled_load(w: World, rid: str):  # type: ignore[no-untyped-def]
    """D's load of ``rid`` begun at P, its READs held back → (handle, before, tables)."""
    for r in range(w.p.par.world):
        w.consumers[0].transport.stall(f"p{r}")  # type: ignore[attr-defined]
    before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
    handle, d_tabs = w.request(rid, 45)
    w.consumers[0].load(handle, d_tabs)
    _until_begun(w, rid, 0.0)
    return handle, before, d_tabs


def test_a_duplicated_handle_at_a_second_d_ends_nothing():
    """Case 1: the handle reaches a second D instance (another engine id, or the same
    engine id restarted) while the first reads. Its ``begin`` is refused as foreign, its
    ``fail`` (sent or forged) is refused, P frees nothing, the first D's bytes stand."""
    w = World(lease_s=30.0)
    others = [second_d(w, "D2"), second_d(w, "D")]  # the same engine id, another epoch
    try:
        handle, before, d_tabs = stalled_load(w, "dup")
        seconds = []
        for other in others:
            other.load(handle, [list(t) for t in d_tabs])
            seconds += _outcomes(other)
        fails = [call(w, forged(handle, "fail", "D2")), call(w, forged(handle, "fail", "D", "e2"))]
        freed = reuse_freed(w)  # P's engine reuses at once whatever was freed
        _resume(w)
        (out,) = w.wait()
        if out.ok:  # never with reused bytes
            check_bytes(w, before, 45, 0, d_tabs)
        assert freed == [] and out.ok and out.verified == "lease time", out
        assert all(not o.ok and "not this D's lease" in o.error for o in seconds), seconds
        assert [r.reason for r in fails] == ["other engine", "token required"]
        assert [f.reason for f in w.producer.freed(wait_for=1)] == [LeaseState.DONE]
        refused = w.producer.leases.refused
        assert refused["other engine"] >= 2 and refused["other epoch"] == 1, refused
    finally:
        for other in others:
            other.close()
        w.close()


def test_a_confirm_from_another_engine_id_does_not_free_blocks_mid_read():
    """Case 2: a key holder's ``confirm`` for the real D rank's request (another engine
    id; the same engine id without, with a made-up or with the real rank's token from
    another epoch) is refused and frees nothing; the real load reports correct bytes."""
    w = World(lease_s=30.0)
    try:
        handle, before, d_tabs = stalled_load(w, "mid")
        real = w.producer.leases._held["mid"].owners[0].token
        tries = {
            "other engine": forged(handle, "confirm", "X", token=real),
            "token required": forged(handle, "confirm", "D"),
            "unknown token": forged(handle, "confirm", "D", token="0" * 32),
            "other identity": forged(handle, "confirm", "D", "stolen", real),
        }
        replies = {why: call(w, op) for why, op in tries.items()}
        renew = call(w, forged(handle, "renew", "D", token="1" * 32))
        freed = reuse_freed(w)
        _resume(w)
        (out,) = w.wait()
        if out.ok:  # never with reused bytes
            check_bytes(w, before, 45, 0, d_tabs)
        assert freed == [] and out.ok, out
        assert {why: (r.state, r.reason) for why, r in replies.items()} == {
            why: ("foreign", why) for why in tries
        }
        assert (renew.state, renew.reason) == ("foreign", "unknown token")
        assert [f.reason for f in w.producer.freed(wait_for=1)] == [LeaseState.DONE]
        assert sum(w.producer.leases.refused.values()) == 4 + 1
    finally:
        w.close()


def test_a_replayed_push_after_the_load_ended_is_refused():
    """Case 3: a key holder replays D's ``PushRuns`` after the load ended, when D has
    given those blocks to another request: P refuses it (retired nonce) and writes
    nothing; a copy with a fresh nonce or a repeated part is refused too."""
    w = World(mode=Mode.PUSH)
    seen: list[PushRuns] = []
    ledger = w.workers[0].ledger
    admit = ledger.admit
    ledger.admit = lambda m: seen.append(m) or admit(m)  # type: ignore[method-assign,func-returns-value]
    try:
        handle, d_tabs = w.request("pushed", 45)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok and out.mover == "push", out
        assert seen and seen[-1].last and seen[-1].token and seen[-1].nonce
        for bufs in w.d.bufs:  # D's engine gives the blocks to another request
            for b in bufs:
                b[:] = 0x5A
        client = Client(w.workers[0].info.endpoint, SECRET, 3.0)
        try:
            replay = seen[-1]
            assert client.call(replay) == PushRefused("pushed", "retired nonce")
            fresh = replace(replay, nonce="f" * 32)
            assert client.call(fresh) == PushRefused("pushed", "unknown nonce")
        finally:
            client.close()
        time.sleep(0.05)
        assert all((b == 0x5A).all() for bufs in w.d.bufs for b in bufs)  # nothing written
        assert ledger.refused == {"retired nonce": 1, "unknown nonce": 1}
    finally:
        w.close()


def test_a_part_is_written_once_per_load():
    """The same message of a live load (same nonce and part) is written once."""
    w = World(mode=Mode.PUSH)
    try:
        ledger = w.workers[0].ledger
        msg = PushRuns("r", b"", b"", b"", b"", b"n", token="t", d_epoch="e", nonce="n1")
        msg = replace(msg, last=False, d_engine="D")
        assert ledger.admit(msg) == ""
        assert ledger.admit(msg) == "replayed"
        assert ledger.admit(replace(msg, part=1, last=True)) == ""
        assert ledger.admit(replace(msg, part=2)) == "retired nonce"
        other = replace(msg, token="t2", nonce="n2")  # another D rank of the request
        assert ledger.admit(other) == ""
        assert ledger.admit(replace(other, nonce="n3")) == "unknown nonce"
        assert ledger.admit(replace(msg, nonce="")) == "no nonce"
    finally:
        w.close()


def test_a_push_or_fence_of_one_engine_never_acts_on_anothers_load():
    """Another engine id (M) sending D's very ids (request, token, epoch, nonce, part)
    binds, writes and retires a load of its own: D's load carries on."""
    ledger = PushLedger()
    d = PushRuns("r", b"", b"", b"", b"", b"n", token="t", d_epoch="e", nonce="n1", last=False)
    d = replace(d, d_engine="D")
    m = replace(d, d_engine="M", last=True)
    assert ledger.admit(m) == ""  # M's load, its nonce retired
    ledger.fence("r", "M")
    assert ledger.admit(d) == ""
    assert ledger.admit(m) == "retired nonce"
    assert ledger.admit(replace(d, part=1, last=True)) == ""
    assert ledger.admit(d) == "retired nonce"
    assert ledger.refused == {"retired nonce": 2}


def test_a_load_refused_before_it_began_tells_p_at_once():
    """Bad D block tables: the load is refused in ``load`` and P frees the blocks now
    (a ``fail`` without a token: accepted since no rank began), not at lease expiry."""
    w = World(lease_s=30.0)
    try:
        handle, d_tabs = w.request("bad", 45)
        with pytest.raises(PlanError, match="D's block tables"):
            w.consumers[0].load(handle, [[-1, *t[1:]] for t in d_tabs])
        freed = w.producer.freed(wait_for=1, timeout_s=3.0)
        assert [(f.request_id, f.reason) for f in freed] == [("bad", LeaseState.DONE)]
    finally:
        w.close()


def test_a_tokenless_fail_cannot_end_a_lease_a_rank_began():
    w = World(lease_s=30.0)
    try:
        handle, before, d_tabs = stalled_load(w, "began")
        consumer = w.consumers[0]
        reply = call(w, forged(handle, "fail", "D", consumer.leases.epoch))  # its own identity
        freed = reuse_freed(w)
        _resume(w)
        (out,) = w.wait()
        if out.ok:  # never with reused bytes
            check_bytes(w, before, 45, 0, d_tabs)
        assert freed == [] and out.ok, out
        assert (reply.state, reply.reason) == ("foreign", "token required")
    finally:
        w.close()


def test_a_renew_in_flight_when_the_load_begins_is_no_false_refusal():
    """The renewer checked a queued load (no peer yet) and is about to send its
    token-less renew when a pool thread begins the load: the ``begin`` waits for that
    renew, so P never sees a token-less renew after the ``begin`` (no refusal counted)."""
    w = World(lease_s=30.0)
    consumer = w.consumers[0]
    renewing, began, renewed = threading.Event(), threading.Event(), threading.Event()
    get, op, renew = consumer.peers.get, consumer.leases.op, consumer.leases.renew

    def held_get(handle, since=None):  # type: ignore[no-untyped-def]
        renewing.wait(5.0)  # the handshake starts once the renewer is at the load
        return get(handle, since)

    def traced(job, name):  # type: ignore[no-untyped-def]
        if name == "begin":
            began.set()
        msg = op(job, name)
        if name == "renew" and not renewing.is_set():
            renewing.set()
            began.wait(5.0)
            time.sleep(0.2)  # the renewer descheduled between its check and its send
        return msg

    def renewed_once(peer, job):  # type: ignore[no-untyped-def]
        renew(peer, job)
        renewed.set()

    consumer.peers.get = held_get  # type: ignore[method-assign]
    consumer.leases.op = traced  # type: ignore[method-assign]
    consumer.leases.renew = renewed_once  # type: ignore[method-assign]
    try:
        _, before, d_tabs = stalled_load(w, "race")  # P holds the lease meanwhile
        assert renewed.wait(5.0)
        _resume(w)
        (out,) = _outcomes(consumer, timeout=10.0)
        assert renewing.is_set() and out.ok, out
        check_bytes(w, before, 45, 0, d_tabs)
        assert w.producer.leases.refused == {}
    finally:
        w.close()


def _outcomes(c: Consumer, count: int = 1, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    out: list = []
    end = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < end:
        out += c.poll()
        time.sleep(0.005)
    assert len(out) == count, out
    return out
