"""Forged and stale handles, many engine ids, a black-hole endpoint: D's peer state stays
bounded, a working link to P survives, and loads to other peers go on."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
import zmq

from kvbridge.connector.consumer import Consumer, Mode
from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.producer import Producer, ProducerWorker
from kvbridge.control.channel import Client, Server
from kvbridge.control.messages import (
    MAX_FRAME,
    ErrorReply,
    LeaseOp,
    LeaseReply,
    PushRuns,
    seal,
    unseal,
)
from kvbridge.control.security import Keys, secure_client
from kvbridge.errors import PeerError, PlanError, TransportError
from kvbridge.transport.loopback import LoopbackTransport
from tests.support.scenario import random_tables
from tests.unit.test_connector_loopback import SECRET, SPEC, World, raw_call


def forged(h: TransferHandle, **fields: object) -> TransferHandle:
    return msgspec.structs.replace(h, **fields)


def dead_endpoint() -> str:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def warm(w: World) -> tuple[Consumer, TransferHandle, list[list[int]]]:
    """D rank 0 after one good load from P (the peer cached), and that load's handle."""
    c = w.consumers[0]
    handle, d_tabs = w.request("ok1", 30)
    c.load(handle, d_tabs)
    assert w.wait()[0].ok
    return c, handle, d_tabs


def test_a_forged_handle_does_not_sever_a_working_link():
    w = World(timeout_s=0.5)
    try:
        c, handle, d_tabs = warm(w)
        for i, bad in enumerate(
            [
                forged(handle, request_id="f1", epoch="0" * 16, endpoint=dead_endpoint()),
                forged(handle, request_id="f2", epoch="0" * 16),  # live endpoint, wrong epoch
                forged(handle, request_id="f3", engine_id="other"),  # P is not "other"
            ]
        ):
            c.load(bad, d_tabs)
            (out,) = w.wait()
            assert not out.ok, (i, out)
        assert "stale or forged" in out.error, out.error
        handle, d_tabs = w.request("ok2", 30)
        c.load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok, out.error
        assert len(c.peers) == 1
    finally:
        w.close()


def test_thousands_of_engine_ids_leave_peers_and_fds_bounded():
    w = World(timeout_s=0.5)
    try:
        c, handle, d_tabs = warm(w)
        fds = open_fds()
        n = 2000
        for i in range(n):
            c.load(forged(handle, request_id=f"x{i}", engine_id=f"e{i}"), d_tabs)
        outs = w.wait(n, timeout=120)
        assert not any(o.ok for o in outs)
        assert len(c.peers) == 1
        # ZMQ closes a socket's connections on its I/O threads, after close() returned
        # (P's accepted ones when D's side is gone): a leak stays, a lag does not
        end = time.monotonic() + 20
        while open_fds() - fds >= 16 and time.monotonic() < end:
            time.sleep(0.1)
        assert open_fds() - fds < 16, (fds, open_fds())
    finally:
        w.close()


def test_peers_beyond_the_limit_are_evicted_and_come_back():
    """Three P instances over the same memory, D keeps at most two: each load lands,
    the least recently used idle peer is dropped (its transport peers too) and a later
    load to it handshakes again."""
    w = World(timeout_s=2.0)
    producers = []
    try:
        for k in range(3):
            prod = Producer(f"P{k}", SPEC, w.p.par, SECRET)
            for r in range(w.p.par.world):
                agent = LoopbackTransport(f"p{k}-{r}", w.fabric)
                bases = list(w.p.bound(r).bases)
                prod.add_rank(ProducerWorker(r, w.p.layouts[r], bases, agent).info)
            producers.append(prod)
        c = w.consumers[0]
        c.peers.max_peers = 2
        for i, k in enumerate([0, 1, 2, 0, 2, 1]):
            tabs = random_tables(SPEC, 20, 32, w.rng)
            handle = producers[k].prefill_done(f"r{i}", tabs, 20)
            c.load(handle, random_tables(w.d.spec, 20, 64, w.rng))
            (out,) = w.wait()
            assert out.ok, out.error
            assert len(c.peers) <= 2
            t = c.transport
            assert isinstance(t, LoopbackTransport) and len(t.peers) <= 2 * w.p.par.world
    finally:
        for prod in producers:
            prod.close()
        w.close()


def test_a_black_hole_endpoint_does_not_stall_other_loads():
    w = World(timeout_s=3.0)
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # accepts the connection, never answers a frame
    try:
        c = w.consumers[0]
        handle, d_tabs = w.request("ok", 30)
        port = hole.getsockname()[1]
        c.load(
            forged(handle, request_id="hole", engine_id="hole", endpoint=f"tcp://127.0.0.1:{port}"),
            d_tabs,
        )
        time.sleep(0.1)
        t0 = time.monotonic()
        c.load(handle, d_tabs)
        (out,) = w.wait(timeout=2.5)
        # the black hole holds its load for 3 s; this one does not wait for it
        assert out.ok and out.request_id == "ok" and time.monotonic() - t0 < 2.0
        (out,) = w.wait(timeout=5)
        assert out.request_id == "hole" and not out.ok
    finally:
        hole.close()
        w.close()


BAD_IDS = [0.9, "3", True, None, 2**64, 2**63, -1, 10**6]


def test_block_tables_are_integers_in_range_nothing_coerced():
    w = World()
    try:
        c = w.consumers[0]
        handle, d_tabs = w.request("t", 20)
        for bad in BAD_IDS:
            tabs = [[bad, *t[1:]] for t in d_tabs]
            with pytest.raises(PlanError, match="D's block tables: table 0"):
                c.load(handle, tabs)
            p_tabs = [[bad, *t[1:]] for t in handle.block_tables]
            with pytest.raises(PlanError, match="P's block tables: table 0"):
                w.producer.prefill_done(f"p{bad!r}", p_tabs, 20)
        for shape in ([], d_tabs[:1], "ab", [np.zeros(3, np.float32), d_tabs[1]]):
            with pytest.raises(PlanError, match="D's block tables"):
                c.load(handle, shape)
        with pytest.raises(PlanError, match="cached tokens"):
            c.load(handle, d_tabs, cached=-1)
        assert c.pending() == 0  # each refusal told P (a tokenless fail): its lease ended
        assert [f.request_id for f in w.producer.freed(wait_for=1)] == ["t"]
        handle, d_tabs = w.request("t2", 20)
        c.load(handle, [np.asarray(t, np.int32) for t in d_tabs])  # numpy ids are fine
        assert w.wait()[0].ok
    finally:
        w.close()


def test_malformed_push_and_envelopes_get_a_typed_reply():
    w = World(mode=Mode.PUSH)
    try:
        ep = w.workers[0].server
        assert ep is not None
        frame = seal(PushRuns("r", b"x", b"1234567", b"1234567", b"1234567", b"n"), SECRET)
        reply = raw_call(ep.endpoint, frame)
        assert isinstance(reply, ErrorReply) and reply.kind == "PeerError"
        assert "multiples of 8" in reply.message
        sock = zmq.Context.instance().socket(zmq.DEALER)
        secure_client(sock, Keys.from_secret(SECRET))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.connect(w.producer.endpoint)
        try:
            sock.send_multipart([b"a", b"b", b"c"])  # not a REQ envelope
            empty, body = sock.recv_multipart()
        finally:
            sock.close()
        reply = unseal(body, SECRET)
        assert empty == b"" and isinstance(reply, ErrorReply) and "envelope" in reply.message
    finally:
        w.close()


def test_a_frame_over_the_limit_is_refused_before_it_is_sent():
    client = Client(dead_endpoint(), SECRET, timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="exceeds"):
        client.call(ErrorReply("x", "y" * (MAX_FRAME + 1)))
    assert time.monotonic() - t0 < 1.0
    client.close()


def test_a_restarted_p_reusing_its_agent_names_keeps_working():
    """P restarts (new epoch) with the same NIXL agent names: D handshakes the new epoch,
    and dropping the old peer must not remove the names the new one now uses."""
    w = World()
    try:
        c, handle, d_tabs = warm(w)
        w.producer.close()
        for wk in w.workers:
            wk.close()
        w.producer = Producer("P", SPEC, w.p.par, SECRET)  # new epoch, same engine id
        for r in range(w.p.par.world):
            old = w.fabric.agents.pop(f"p{r}")
            assert isinstance(old, LoopbackTransport)
            agent = LoopbackTransport(f"p{r}", w.fabric)  # the same name again
            bases = list(w.p.bound(r).bases)
            w.producer.add_rank(ProducerWorker(r, w.p.layouts[r], bases, agent).info)
        for i in range(2):
            handle, d_tabs = w.request(f"again{i}", 33)
            c.load(handle, d_tabs)
            (out,) = w.wait()
            assert out.ok, out.error
    finally:
        w.close()


def test_calls_queued_behind_a_timed_out_call_fail_at_once():
    """A P that stops answering: three loads' calls to it take turns on one channel; the
    two that waited fail as soon as the first times out (one timeout, not three); a call
    made after that tries again and, P answering again, succeeds."""
    answering = threading.Event()

    def handler(msg: object) -> LeaseReply:
        answering.wait(10)
        return LeaseReply("held", 1.0)

    server = Server(handler, SECRET)
    client = Client(server.endpoint, SECRET, timeout_s=1.0)
    op = LeaseOp("renew", "r", "l", "digest", "D", 0, 1)

    def call() -> str:
        try:
            client.call(op)
            return "ok"
        except TransportError as e:
            return str(e)

    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            errors = list(pool.map(lambda _: call(), range(3)))
        took = time.monotonic() - t0
        assert sum("no reply within 1000 ms" in e for e in errors) == 3, errors
        assert sum("while this one waited" in e for e in errors) == 2, errors
        assert took < 2.0, took  # three turns of 1 s each without the rule
        answering.set()
        assert call() == "ok"
    finally:
        answering.set()
        client.close()
        server.close()


def load_from_hung_p(
    rids: list[str],
) -> tuple[World, list[str], TransferHandle, list[list[int]], float]:
    """A World (1.5 s timeout), loads ``rids`` for a "P" that accepts connections but never
    answers (hung or dead), and waits for their outcomes; the World (close it), their
    errors, a good handle with its D tables, and the seconds the failures took."""
    w = World(timeout_s=1.5)
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    try:
        handle, d_tabs = w.request("ok", 30)
        end = f"tcp://127.0.0.1:{hole.getsockname()[1]}"
        t0 = time.monotonic()
        for rid in rids:
            hung = forged(handle, request_id=rid, engine_id="hung", endpoint=end)
            w.consumers[0].load(hung, d_tabs)
        outs = w.wait(len(rids), timeout=8)
        took = time.monotonic() - t0
        assert sorted(o.request_id for o in outs) == sorted(rids)
        assert not any(o.ok for o in outs)
        assert all("no reply within 1500 ms" in (o.error or "") for o in outs)
        return w, [o.error or "" for o in outs], handle, d_tabs, took
    except BaseException:
        w.close()
        raise
    finally:
        hole.close()


def test_loads_waiting_for_a_handshake_with_a_dead_p_fail_with_it():
    """Two loads for a hung P: the second waits for the first one's handshake and fails
    when it does, within one timeout rather than two; D then still loads from a live P."""
    w, errors, handle, d_tabs, took = load_from_hung_p(["hung-1", "hung-2"])
    try:
        assert sum("while this load waited" in e for e in errors) == 1
        assert took < 2.6, took  # two turns of 1.5 s without the rule
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait(timeout=5)
        assert out.ok and out.request_id == "ok"
    finally:
        w.close()


def test_loads_queued_for_a_dead_p_fail_within_one_timeout():
    """Five loads for a hung P, more than D's two workers: those still in the queue when
    the handshake timed out fail at once too (one timeout, not three)."""
    w, _, _, _, took = load_from_hung_p([f"q{i}" for i in range(5)])
    w.close()
    assert took < 2.6, took


def test_p_ranks_describing_a_group_in_different_blocks_are_refused():
    """D plans every P rank with one block size per group (P's scheduler refuses ranks
    that differ): a P whose rank 1 says blocks of half the size fails the load with a
    PeerError naming both, and D's blocks stay as they were."""
    w = World()
    try:
        info = w.producer.ranks[1]
        halved = [max(b // 2, 1) for b in info.block_sizes]
        w.producer.ranks[1] = msgspec.structs.replace(info, block_sizes=halved)
        before = [b.copy() for b in w.d.bufs[0]]
        handle, d_tabs = w.request("r", 20)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert not out.ok and "PeerError" in (out.error or "")
        assert f"{sorted({tuple(info.block_sizes), tuple(halved)})}" in (out.error or "")
        assert all(np.array_equal(a, b) for a, b in zip(before, w.d.bufs[0], strict=True))
    finally:
        w.close()
