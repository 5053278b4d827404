"""Producer/Consumer over the side channel with the loopback transport, in one process."""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.consumer import Consumer, Mode, Outcome
from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.load import NO_TABLES, LoadState, _Load
from kvbridge.connector.producer import Producer, ProducerWorker
from kvbridge.control.channel import Client
from kvbridge.control.lease import LeaseState
from kvbridge.control.messages import ErrorReply, Handshake, Message, unseal
from kvbridge.control.security import Keys, secure_client
from kvbridge.errors import PeerError
from kvbridge.layout import build_layout
from kvbridge.layout.tensor import MemKind
from kvbridge.spec import Kind, ModelSpec, Parallel, attention, group_by_kind, mla
from kvbridge.transport.loopback import Fabric, LoopbackTransport
from tests.support.reference import expected_dest, fill_source
from tests.support.scenario import Side, random_tables
from tests.support.stalling import StallingLoopback

SECRET = b"test-secret"
LAYERS = [attention(0, 4, 16), attention(1, 4, 16, kind=Kind.SLIDING, window=9), mla(2, 24)]
SPEC = group_by_kind("toy", LAYERS, 16)


def sign(body: bytes, secret: bytes = SECRET) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest() + body


def raw_call(endpoint: str, frame: bytes) -> Message:
    sock = zmq.Context.instance().socket(zmq.REQ)
    secure_client(sock, Keys.from_secret(SECRET))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(endpoint)
    try:
        sock.send(frame)
        return unseal(sock.recv(), SECRET)
    finally:
        sock.close()


class World:
    spec: ModelSpec = SPEC  # a subclass making its own sides keeps the toy hybrid

    def __init__(
        self,
        lease_s: float = 30.0,
        p_tp: int = 2,
        d_tp: int = 1,
        timeout_s: float = 5.0,
        staging_bytes: int = 32 << 20,
        mode: Mode = Mode.PULL,
        p_keys: Keys | None = None,
        d_keys: Keys | None = None,
        memory: tuple[MemKind, MemKind] = (MemKind.HOST, MemKind.HOST),
        p_memory: Callable[[int], np.ndarray] | None = None,
        d_transport: type[LoopbackTransport] = StallingLoopback,
        layouts: tuple[str, str] = ("hnd", "block-major"),
        d_block: int = 8,
        spec: ModelSpec = SPEC,
    ):
        """``p_memory``: how P's regions are allocated (bytes → uint8 array; default numpy);
        ``layouts``: P's and D's; ``d_block``: D's block size (P's is 16); ``spec``: the
        model (a toy hybrid by default)."""
        self.rng = np.random.default_rng(7)
        self.spec = spec
        self.p = Side(spec, Parallel(p_tp), layouts[0], 32)
        self.d = Side(spec.with_block_sizes(d_block), Parallel(d_tp), layouts[1], 64)
        self.p.allocate(self.rng)
        if p_memory is not None:
            self.p.bufs = [[_moved(b, p_memory) for b in bufs] for bufs in self.p.bufs]
        self.d.allocate(self.rng)
        self.fabric = Fabric()
        self.producer = Producer("P", spec, self.p.par, SECRET, lease_s=lease_s, keys=p_keys)
        self.workers: list[ProducerWorker] = []
        for r in range(p_tp):
            agent = StallingLoopback(f"p{r}", self.fabric)
            bases = list(self.p.bound(r).bases)
            push = (SECRET, "127.0.0.1", timeout_s) if mode is not Mode.PULL else (None,)
            worker = ProducerWorker(
                r, self.p.layouts[r], bases, agent, *push, keys=p_keys, memory=memory[0]
            )  # type: ignore[arg-type,misc]
            self.workers.append(worker)
            self.producer.add_rank(worker.info)
        self.consumers = [
            Consumer(
                "D",
                self.d.spec,
                self.d.par,
                r,
                self.d.layouts[r],
                list(self.d.bound(r).bases),
                d_transport(f"d{r}", self.fabric),
                SECRET,
                transfer_timeout_s=timeout_s,
                staging_bytes=staging_bytes,
                mode=mode,
                keys=d_keys,
                memory=memory[1],
            )
            for r in range(d_tp)
        ]

    def request(self, rid: str, n: int) -> tuple[TransferHandle, list[list[int]]]:
        p_tabs = random_tables(self.spec, n, 32, self.rng)
        for r in range(self.p.par.world):
            fill_source(self.spec, self.p.par, r, self.p.layouts[r], self.p.bufs[r], n, p_tabs)
        d_tabs = random_tables(self.d.spec, n, 64, self.rng)
        return self.producer.prefill_done(rid, p_tabs, n), d_tabs

    def wait(self, count: int = 1, timeout: float = 10) -> list[Outcome]:
        out: list[Outcome] = []
        end = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < end:
            for c in self.consumers:
                out += c.poll()
            time.sleep(0.005)
        assert len(out) == count, out
        return out

    def close(self) -> None:
        for c in self.consumers:
            c.close()
        for w in self.workers:
            w.close()
        self.producer.close()


def _moved(buf: np.ndarray, alloc: Callable[[int], np.ndarray]) -> np.ndarray:
    out = alloc(buf.nbytes)
    out[:] = buf
    return out


@pytest.fixture
def world():
    w = World()
    yield w
    w.close()


def check_bytes(w: World, before, n, cached, d_tabs):
    for r in range(w.d.par.world):
        want = expected_dest(w.d.spec, w.d.par, r, w.d.layouts[r], before[r], n, cached, d_tabs)
        for got, exp in zip(w.d.bufs[r], want, strict=True):
            assert np.array_equal(got, exp)


def test_pull_is_byte_exact_and_frees_p_blocks_once(world):
    before = [[b.copy() for b in bufs] for bufs in world.d.bufs]
    handle, d_tabs = world.request("r1", 45)
    handle = TransferHandle.from_bytes(handle.to_bytes())  # as the router forwards it
    world.consumers[0].load(handle, d_tabs)
    (out,) = world.wait()
    assert out.ok, out.error
    assert out.bytes > 0
    check_bytes(world, before, 45, 0, d_tabs)
    freed = world.producer.freed(wait_for=1)
    assert [(f.request_id, f.reason) for f in freed] == [("r1", LeaseState.DONE)]
    assert world.producer.freed() == []


class _Interrupt(BaseException):
    """Not an Exception: what no load's failure path catches."""


def test_an_interrupt_between_begin_and_the_copy_frees_ps_channel(world, monkeypatch):
    d = world.consumers[0]
    d.inline = False  # both loads begin on the one channel a worker's begin takes
    plan = d.plan
    began = threading.Event()

    def interrupted(peer, job):
        monkeypatch.setattr(d, "plan", plan)  # once
        began.set()
        raise _Interrupt

    monkeypatch.setattr(d, "plan", interrupted)
    failed_handle, tabs = world.request("r1", 45)
    d.load(failed_handle, tabs)
    assert began.wait(5)  # r1's begin sent, then its worker interrupted
    (failed,) = world.wait(timeout=5)  # r1 ends as a failure: the engine does not wait on it
    assert not failed.ok and failed.request_id == "r1"
    assert failed.error == "TransferFailed: load interrupted by _Interrupt", failed.error
    assert d.pending() == 0
    peer = d.peers.known(failed_handle)
    assert peer is not None
    deadline = time.monotonic() + 5
    while peer.users and time.monotonic() < deadline:  # released with the outcome's fence
        time.sleep(0.01)
    assert peer.users == 0
    before = [[b.copy() for b in bufs] for bufs in world.d.bufs]
    handle, d_tabs = world.request("r2", 45)
    d.load(handle, d_tabs)
    (out,) = world.wait(timeout=5)  # not stuck behind r1's untaken answer
    assert out.ok and out.request_id == "r2", out.error
    check_bytes(world, before, 45, 0, d_tabs)
    closing = threading.Thread(target=d.close, daemon=True)  # r1's lease call ends too
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "D's close waits on P's channel r1 left locked"


def test_a_load_moves_one_way_only(world):
    handle, _ = world.request("m", 45)
    order = [LoadState.HANDSHAKE, LoadState.TRANSFER, LoadState.VERIFY, LoadState.DONE]
    for skip in range(len(order)):  # no state may be skipped, none left backwards
        job = _Load(handle, NO_TABLES, 0)
        for to in order[:skip]:
            job.move(to)
        for wrong in [LoadState.QUEUED, LoadState.FAILED, *order[skip + 1 :]]:
            with pytest.raises(AssertionError):
                job.move(wrong)
    job = _Load(handle, NO_TABLES, 0)
    for to in order:
        job.move(to)
    for wrong in (LoadState.FAILED, LoadState.QUEUED):  # a done load stays done
        with pytest.raises(AssertionError):
            job.move(wrong)


def test_partial_and_full_prefix_hit(world):
    h1, d1 = world.request("a", 60)
    h2, d2 = world.request("b", 60)
    world.consumers[0].load(h1, d1, cached=0)
    world.consumers[0].load(h2, d2, cached=24)
    outs = {o.request_id: o for o in world.wait(2)}
    assert outs["a"].ok and outs["b"].ok
    assert outs["b"].bytes < outs["a"].bytes
    h3, d3 = world.request("c", 60)
    world.consumers[0].load(h3, d3, cached=60)
    (out,) = world.wait()
    assert out.ok and out.bytes == 0
    assert {f.request_id for f in world.producer.freed(wait_for=3)} == {"a", "b", "c"}


def test_lapsed_lease_is_reported_failed_never_successful():
    w = World(lease_s=0.3)
    try:
        handle, d_tabs = w.request("late", 30)
        time.sleep(0.5)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert not out.ok and "LeaseExpired" in out.error
        assert out.failed_blocks[0] == d_tabs[0]
        assert [f.reason for f in w.producer.freed()] == [LeaseState.EXPIRED]
    finally:
        w.close()


def test_a_silent_p_fails_the_load_within_the_consumers_timeout():
    w = World(timeout_s=0.5)
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts CURVE sessions, never answers
    keys = Keys.from_secret(SECRET)
    silent.curve_secretkey, silent.curve_publickey = keys.server_secret, keys.server_public
    silent.curve_server = True
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        handle, d_tabs = w.request("h", 30)
        ghost = msgspec.structs.replace(
            handle, engine_id="ghost", endpoint=f"tcp://127.0.0.1:{port}"
        )
        t0 = time.monotonic()
        w.consumers[0].load(ghost, d_tabs)
        (out,) = w.wait(timeout=4)
        took = time.monotonic() - t0
        assert not out.ok and "no reply within 500 ms" in out.error, out.error
        assert took < 3, took  # the handshake waited the consumer's 0.5 s, not 5 s
    finally:
        silent.close()
        w.close()


def test_abort_frees_once_and_d_fails(world):
    handle, d_tabs = world.request("x", 30)
    assert world.producer.abort("x")
    assert not world.producer.abort("x")
    assert [f.reason for f in world.producer.freed()] == [LeaseState.ABORTED]
    world.consumers[0].load(handle, d_tabs)
    (out,) = world.wait()
    assert not out.ok


def test_handle_with_foreign_block_ids_transfers_nothing(world):
    before = [b.copy() for b in world.d.bufs[0]]
    handle, d_tabs = world.request("h", 40)
    forged = msgspec.structs.replace(handle, block_tables=[[0, 1, 2], [3, 4, 5]])
    world.consumers[0].load(forged, d_tabs)
    (out,) = world.wait()
    assert not out.ok and "does not match" in out.error
    assert all(np.array_equal(a, b) for a, b in zip(before, world.d.bufs[0], strict=True))
    out_of_range = msgspec.structs.replace(handle, block_tables=[[0, 1, 99], [3, 4, 5]])
    world.consumers[0].load(out_of_range, d_tabs)
    (out,) = world.wait()
    assert not out.ok


def test_wrong_secret_and_version_are_refused_and_p_keeps_serving(world):
    outsider = Client(world.producer.endpoint, b"wrong", timeout_s=10)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="CURVE handshake failed"):
        outsider.call(Handshake(1, "intruder"))  # its keys are not allowed: no session
    assert time.monotonic() - t0 < 2.0  # told at once, not after the timeout
    bad = Client(world.producer.endpoint, b"wrong", timeout_s=2, keys=Keys.from_secret(SECRET))
    with pytest.raises(PeerError, match="authentication failed"):
        bad.call(Handshake(1, "intruder"))  # a session, but frames signed with another secret
    good = Client(world.producer.endpoint, SECRET, timeout_s=2)
    with pytest.raises(PeerError, match="protocol version 99"):
        good.call(Handshake(99, "old"))
    reply = raw_call(world.producer.endpoint, sign(b"\x93garbage"))
    assert isinstance(reply, ErrorReply) and "malformed" in reply.message
    handle, d_tabs = world.request("after", 20)
    world.consumers[0].load(handle, d_tabs)
    assert world.wait()[0].ok


@settings(max_examples=60, deadline=None)
@given(body=st.binary(max_size=300), signed=st.booleans())
def test_hostile_frames_get_an_error_reply_and_p_keeps_serving(body, signed):
    w = _shared_world()
    reply = raw_call(w.producer.endpoint, sign(body) if signed else body)
    assert isinstance(reply, ErrorReply)


def test_oversized_frame_is_refused_unread(world):
    reply = raw_call(world.producer.endpoint, sign(b"x" * (9 << 20)))
    assert isinstance(reply, ErrorReply) and "exceeds" in reply.message
    handle, d_tabs = world.request("still", 20)
    world.consumers[0].load(handle, d_tabs)
    assert world.wait()[0].ok


_WORLD: list[World] = []


def _shared_world() -> World:
    if not _WORLD:
        _WORLD.append(World())
    return _WORLD[0]


def teardown_module() -> None:
    for w in _WORLD:
        w.close()


def test_restarted_p_instance_is_re_handshaken(world):
    handle, d_tabs = world.request("first", 20)
    world.consumers[0].load(handle, d_tabs)
    assert world.wait()[0].ok
    # P restarts: same engine id, new memory, new agents, new side channel and epoch
    world.producer.close()
    world.p = Side(SPEC, Parallel(2), "nhd", 32)
    world.p.allocate(world.rng)
    world.producer = Producer("P", SPEC, world.p.par, SECRET)
    for r in range(2):
        agent = LoopbackTransport(f"p{r}-restarted", world.fabric)
        bases = list(world.p.bound(r).bases)
        world.producer.add_rank(ProducerWorker(r, world.p.layouts[r], bases, agent).info)
    before = [[b.copy() for b in bufs] for bufs in world.d.bufs]
    handle, d_tabs = world.request("second", 33)
    assert handle.epoch != world.consumers[0].peers.known(handle).epoch
    world.consumers[0].load(handle, d_tabs)
    out = world.wait()[0]
    assert out.ok, out.error
    check_bytes(world, before, 33, 0, d_tabs)


def test_p_with_another_model_is_refused(world):
    other = group_by_kind("other", [attention(0, 4, 16), attention(1, 4, 16), mla(2, 32)], 16)
    producer = Producer("P2", other, Parallel(1), SECRET)
    try:
        agent = LoopbackTransport("other-p0", world.fabric)
        lay = build_layout(other, Parallel(1), 0, "nhd", 8)
        bufs = [np.zeros(n, np.uint8) for n in lay.regions]
        producer.add_rank(ProducerWorker(0, lay, [b.ctypes.data for b in bufs], agent).info)
        handle = producer.prefill_done("x", [[0, 1]], 20)
        world.consumers[0].load(handle, [[0, 1, 2], [3, 4, 5]])
        (out,) = world.wait()
        assert not out.ok and "IncompatibleError" in out.error and "differs" in out.error
    finally:
        producer.close()


def test_p_serving_another_model_of_the_same_shapes_is_refused(world):
    """Same KV shapes (same compat hash), another model id: no byte moves."""
    before = [b.copy() for b in world.d.bufs[0]]
    producer = Producer("P3", SPEC, world.p.par, SECRET, model_id="qwen3-tiny")
    try:
        for r in range(world.p.par.world):
            agent = LoopbackTransport(f"p3-{r}", world.fabric)
            bases = list(world.p.bound(r).bases)
            producer.add_rank(ProducerWorker(r, world.p.layouts[r], bases, agent).info)
        handle = producer.prefill_done("m", random_tables(SPEC, 40, 32, world.rng), 40)
        world.consumers[0].load(handle, random_tables(world.d.spec, 40, 64, world.rng))
        (out,) = world.wait()
        assert not out.ok and "IncompatibleError" in out.error, out.error
        assert "'qwen3-tiny'" in out.error and "model" in out.error
        assert all(np.array_equal(a, b) for a, b in zip(before, world.d.bufs[0], strict=True))
    finally:
        producer.close()


def test_many_small_runs_are_staged_byte_exact():
    """HND TP 2 → block-major TP 1 with blocks 32 → 8: ~1,700 small runs. The cost model
    stages them: a few spans posted, the rest scattered on D; bytes equal the reference.
    Without a staging area the same request posts every run."""
    w = World()
    try:
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("s", 200)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok, out.error
        assert out.staged_runs > 1000 and out.descriptors < out.staged_runs // 10
        check_bytes(w, before, 200, 0, d_tabs)
    finally:
        w.close()
    w = World(staging_bytes=0)
    try:
        handle, d_tabs = w.request("d", 200)
        w.consumers[0].load(handle, d_tabs)
        (direct,) = w.wait()
        assert direct.ok and direct.staged_runs == 0 and direct.descriptors > 1000
    finally:
        w.close()


class SlowPeers(LoopbackTransport):
    """A transport whose first connection to a peer takes ``delay`` seconds (NIXL's
    first UCX connection has been seen to take 31 s on this machine)."""

    delay = 2.5

    def add_peer(self, metadata: bytes) -> str:
        time.sleep(self.delay)
        return super().add_peer(metadata)


def test_leases_are_renewed_while_the_handshake_is_slow():
    """Lease 2 s, handshake 5 s (two P ranks): the renewer keeps the lease (through a channel to the
    handle's endpoint, the peer being unknown yet) and the load lands byte-exact."""
    w = World(lease_s=2.0)
    try:
        slow = Consumer(
            "D-slow",
            w.d.spec,
            w.d.par,
            0,
            w.d.layouts[0],
            list(w.d.bound(0).bases),
            SlowPeers("d-slow", w.fabric),
            SECRET,
        )
        try:
            before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
            handle, d_tabs = w.request("slow", 50)
            slow.load(handle, d_tabs)
            end = time.monotonic() + 10
            out = []
            while not out and time.monotonic() < end:
                out = slow.poll()
                time.sleep(0.01)
            assert len(out) == 1 and out[0].ok, out
            assert out[0].stages["handshake"] > 4.0
            check_bytes(w, before, 50, 0, d_tabs)
        finally:
            slow.close()
    finally:
        w.close()


_FIRST_REQUEST = """
import sys, time
import numpy as np
from kvbridge.api import (
    Consumer, Parallel, Producer, ProducerWorker, build_layout, load_model, make_transport,
)
spec = load_model("llama-3.1-8b").spec.with_block_sizes(16)
lay = build_layout(spec, Parallel(1), 0, "hnd", 8)
mem = [[np.zeros(n, np.uint8) for n in lay.regions] for _ in "pd"]
p_at, d_at = ([int(b.ctypes.data) for b in m] for m in mem)
worker = ProducerWorker(0, lay, p_at, make_transport("loopback", "P0"))
producer = Producer("P", spec, Parallel(1), b"s", lease_s=30)
producer.add_rank(worker.info)
consumer = Consumer("D", spec, Parallel(1), 0, lay, d_at, make_transport("loopback", "D0"), b"s")
before = set(sys.modules)
handle = producer.prefill_done("r0", [[0, 1]], 32)
consumer.load(handle, [[2, 3]], 0)
out, end = [], time.monotonic() + 20
while not out and time.monotonic() < end:
    out = consumer.poll()
    time.sleep(0.001)
assert out and out[0].ok, out
print(sorted(set(sys.modules) - before))
consumer.close()
worker.close()
producer.close()
"""


def test_a_new_pairs_first_request_imports_no_module() -> None:
    """Handshake, geometry, lease and transfer of a new pair's first request import
    nothing: an import is file reads, each waiting for the GIL in a busy engine process
    (what ``kvbridge bench vllm``'s ``first_stages_ms`` showed); a fresh interpreter."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _FIRST_REQUEST], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
