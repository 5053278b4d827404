"""Forged and stale handles, many engine ids, a black-hole endpoint: D's peer state stays
bounded, a working link to P survives, and loads to other peers go on."""

from __future__ import annotations

import os
import socket
import time

import msgspec

from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.producer import Producer, ProducerWorker
from kvbridge.testing.scenario import random_tables
from kvbridge.transport.loopback import LoopbackTransport
from tests.unit.test_connector_loopback import SECRET, SPEC, World


def forged(h: TransferHandle, **fields: object) -> TransferHandle:
    return msgspec.structs.replace(h, **fields)


def dead_endpoint() -> str:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_forged_handle_does_not_sever_a_working_link():
    w = World(timeout_s=0.5)
    try:
        c = w.consumers[0]
        handle, d_tabs = w.request("ok1", 30)
        c.load(handle, d_tabs)
        assert w.wait()[0].ok
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
        c = w.consumers[0]
        handle, d_tabs = w.request("ok", 30)
        c.load(handle, d_tabs)
        assert w.wait()[0].ok
        fds = open_fds()
        n = 2000
        for i in range(n):
            c.load(forged(handle, request_id=f"x{i}", engine_id=f"e{i}"), d_tabs)
        outs = w.wait(n, timeout=120)
        assert not any(o.ok for o in outs)
        assert len(c.peers) == 1
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
        assert out.ok and out.request_id == "ok" and time.monotonic() - t0 < 1.0
        (out,) = w.wait(timeout=5)
        assert out.request_id == "hole" and not out.ok
    finally:
        hole.close()
        w.close()
