"""NIXL transport between real processes (spawned), on loopback.

The test process is the reader D (one module-wide agent); owners P run in spawned
processes that register a buffer of seeded random bytes, send their metadata over a
pipe, forward the notifications they receive and answer "dump" requests. Every wait is
bounded, and every owner that is stopped (not killed) must exit with code 0.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvbridge.errors import PeerError, TransferTimeout, TransportError
from kvbridge.transport.base import Region, XferState
from kvbridge.transport.nixl import NixlTransport
from kvbridge.transport.nixl_meta import seal, unseal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KIB = 1024
MIB = 1024 * KIB
P_BYTES = 24 * MIB  # owner buffer: [0, READ_AREA) is read, [READ_AREA, P_BYTES) written
READ_AREA = 16 * MIB
WAIT_S = 10.0  # deadline of one transfer or one pipe message, seconds


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` reproducible random bytes."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _owner_main(conn: Connection, name: str, seed: int) -> None:
    """P: serve ``pattern(P_BYTES, seed)`` until told to stop (runs in a child)."""
    buf = pattern(P_BYTES, seed)
    with NixlTransport(name) as transport:
        metadata = transport.register([Region(buf.ctypes.data, buf.nbytes)])
        conn.send(("ready", metadata, buf.ctypes.data))
        while True:
            notes = transport.notifications()
            if notes:
                conn.send(("notif", notes))
            if not conn.poll(0.005):
                continue
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "dump":
                offset, nbytes = args
                conn.send(("dump", buf[offset : offset + nbytes].tobytes()))
    conn.send(("bye",))
    conn.close()


class Owner:
    """Parent-side handle of a spawned owner process."""

    def __init__(self, name: str, seed: int) -> None:
        self.name, self.seed = name, seed
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner_main, args=(child, name, seed), daemon=True)
        self.proc.start()
        assert self.proc.pid is not None
        self.pid: int = self.proc.pid
        child.close()
        _, self.metadata, self.base = self.expect("ready", 60.0)

    def expect(self, kind: str, timeout_s: float = WAIT_S) -> tuple[Any, ...]:
        """Next message of ``kind``; others are dropped. Fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                raise AssertionError(f"owner {self.name!r} sent no {kind!r} in {timeout_s} s")
            msg = self.conn.recv()
            if msg[0] == kind:
                return tuple(msg)

    def dump(self, offset: int, nbytes: int) -> np.ndarray:
        self.conn.send(("dump", offset, nbytes))
        return np.frombuffer(self.expect("dump")[1], dtype=np.uint8)

    def stop(self) -> None:
        """Ask the owner to close its agent and exit; it must exit with code 0."""
        self.conn.send(("stop",))
        self.expect("bye")
        self.proc.join(WAIT_S)
        assert self.proc.exitcode == 0, f"owner {self.name!r} exit code {self.proc.exitcode}"

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL
        self.proc.join(WAIT_S)
        assert self.proc.exitcode == -9


class Reader:
    """The test process's agent and its registered ``P_BYTES`` buffer."""

    def __init__(self) -> None:
        self.buf = np.zeros(P_BYTES, dtype=np.uint8)
        self.t = NixlTransport("D")
        self.metadata = self.t.register([Region(self.buf.ctypes.data, self.buf.nbytes)])

    def addr(self, offsets: np.ndarray) -> np.ndarray:
        return offsets.astype(np.uint64) + np.uint64(self.buf.ctypes.data)


@pytest.fixture(scope="module")
def reader() -> Iterator[Reader]:
    r = Reader()
    yield r
    r.t.close()
    r.t.close()  # idempotent


@pytest.fixture(scope="module")
def owner(reader: Reader) -> Iterator[Owner]:
    p = Owner("P", seed=1)
    assert reader.t.add_peer(p.metadata) == "P"
    yield p
    p.stop()


def shuffled_runs(total: int, run: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(source offsets, destination offsets) of ``total // run`` runs, both shuffled."""
    rng = np.random.default_rng(seed)
    count = total // run
    return rng.permutation(count) * run, rng.permutation(count) * run


def read_and_check(
    reader: Reader, p: Owner, src: np.ndarray, dst: np.ndarray, size: np.ndarray
) -> None:
    """READ ``size[i]`` bytes from P offset ``src[i]`` to D offset ``dst[i]``; compare all."""
    reader.buf[:] = 0
    handle = reader.t.read(
        p.name, reader.addr(dst), src.astype(np.uint64) + np.uint64(p.base), size.astype(np.uint64)
    )
    reader.t.wait(handle, WAIT_S)
    assert reader.t.poll(handle) is XferState.DONE
    expected = np.zeros(P_BYTES, dtype=np.uint8)
    source = pattern(P_BYTES, p.seed)
    if np.all(size == size[0]):
        n = int(size[0])
        expected[: len(dst) * n].reshape(-1, n)[dst // n] = source[: len(src) * n].reshape(-1, n)[
            src // n
        ]
    else:
        for s, d, n in zip(src.tolist(), dst.tolist(), size.tolist(), strict=True):
            expected[d : d + n] = source[s : s + n]
    assert np.array_equal(reader.buf, expected)


@pytest.mark.parametrize("run", [1000, 4 * KIB, 64 * KIB, MIB])
def test_read_shuffled_runs_is_byte_exact(reader: Reader, owner: Owner, run: int) -> None:
    src, dst = shuffled_runs(READ_AREA, run, seed=run)
    read_and_check(reader, owner, src, dst, np.full(len(src), run))


def test_read_mixed_run_sizes(reader: Reader, owner: Owner) -> None:
    rng = np.random.default_rng(7)
    size = rng.choice([1, 7, 4096, 4097, 65536, 300_000], size=200)
    size = size[np.cumsum(size) <= READ_AREA]
    starts = np.concatenate([[0], np.cumsum(size)[:-1]])
    order = rng.permutation(len(size))
    dst = np.concatenate([[0], np.cumsum(size[order])[:-1]])  # packed in shuffled order
    read_and_check(reader, owner, starts[order], dst, size[order])


def test_write_with_notification(reader: Reader, owner: Owner) -> None:
    area = P_BYTES - READ_AREA
    reader.buf[:area] = pattern(area, seed=99)
    src, dst = shuffled_runs(area, 64 * KIB, seed=3)
    handle = reader.t.write(
        "P",
        reader.addr(src),
        dst.astype(np.uint64) + np.uint64(owner.base + READ_AREA),
        np.full(len(src), 64 * KIB, np.uint64),
        notif=b"kv-done:req-42",
    )
    reader.t.wait(handle, WAIT_S)
    assert owner.expect("notif")[1] == [("D", b"kv-done:req-42")]
    expected = np.empty(area, np.uint8)
    expected.reshape(-1, 64 * KIB)[dst // (64 * KIB)] = reader.buf[:area].reshape(-1, 64 * KIB)[
        src // (64 * KIB)
    ]
    assert np.array_equal(owner.dump(READ_AREA, area), expected)


def test_empty_write_still_notifies(reader: Reader, owner: Owner) -> None:
    none = np.zeros(0, np.uint64)
    handle = reader.t.write("P", none, none, none, notif=b"nothing-to-move")
    assert reader.t.poll(handle) is XferState.DONE
    assert owner.expect("notif")[1] == [("D", b"nothing-to-move")]


def test_run_outside_registered_memory_is_refused(reader: Reader, owner: Owner) -> None:
    reader.buf[:] = 0
    local = reader.addr(np.array([0, 4096, 8192]))
    remote = np.array([0, 4096, P_BYTES - 100], np.uint64) + np.uint64(owner.base)
    size = np.full(3, 4096, np.uint64)
    with pytest.raises(TransportError, match="NIXL_ERR_NOT_FOUND"):
        reader.t.read("P", local, remote, size)  # last run leaves P's buffer by 3996 B
    stray = np.zeros(4096, np.uint8)  # never registered
    with pytest.raises(TransportError, match="NIXL_ERR_NOT_FOUND"):
        reader.t.read("P", np.array([stray.ctypes.data], np.uint64), remote[:1], size[:1])
    with pytest.raises(TransportError, match="unknown peer"):
        reader.t.read("nobody", local, remote, size)
    with pytest.raises(TransportError, match="equal lengths"):
        reader.t.read("P", local, remote[:2], size)
    with pytest.raises(TransportError, match="negative"):
        reader.t.read("P", np.array([-1]), remote[:1], size[:1])
    assert not reader.buf.any() and not stray.any()  # nothing was copied


def _damaged(metadata: bytes) -> list[Any]:
    flipped = bytearray(metadata)
    flipped[len(flipped) // 2] ^= 0x01
    _, blob, table = unseal(metadata)
    unknown_kind = table.copy()
    unknown_kind[:, 2] = 7
    return [
        b"",
        b"garbage",
        os.urandom(600),
        metadata[:-1],
        metadata[: len(metadata) // 2],
        metadata + b"\0",
        bytes(flipped),
        blob,  # NIXL's raw metadata without kvbridge's envelope
        seal("P-bogus", b"not NIXL metadata at all", table),
        seal("P-bogus", blob[: len(blob) // 2], table),
        seal("P-alias", blob, table),  # envelope name and NIXL name disagree
        seal("P", blob, unknown_kind),  # a memory kind this side does not know
        metadata.decode("latin-1"),
    ]


def test_bad_metadata_raises_peer_error(reader: Reader, owner: Owner) -> None:
    for bad in _damaged(owner.metadata):
        with pytest.raises(PeerError):
            reader.t.add_peer(bad)
    with pytest.raises(PeerError, match="own name"):
        reader.t.add_peer(reader.metadata)
    assert reader.t.add_peer(owner.metadata) == "P"  # same metadata: no-op
    assert reader.t.peers() == ["P"]
    src, dst = shuffled_runs(MIB, 4 * KIB, seed=11)
    read_and_check(reader, owner, src, dst, np.full(len(src), 4 * KIB))


def test_peer_killed_mid_transfer_fails_in_time(reader: Reader, owner: Owner) -> None:
    victim = Owner("P-kill", seed=21)
    assert reader.t.add_peer(victim.metadata) == "P-kill"
    src, dst = shuffled_runs(READ_AREA, 4 * KIB, seed=5)
    args = (reader.addr(dst), src.astype(np.uint64) + np.uint64(victim.base))
    size = np.full(len(src), 4 * KIB, np.uint64)
    first_done, outcome = threading.Event(), dict[str, Any]()

    def pull() -> None:
        reads = 0
        try:
            while reads < 10_000:
                reader.t.wait(reader.t.read("P-kill", *args, size), timeout_s=3.0)
                reads += 1
                first_done.set()
        except TransportError as exc:  # TransferTimeout is one too
            outcome["error"], outcome["reads"] = exc, reads

    worker = threading.Thread(target=pull, daemon=True)
    worker.start()
    assert first_done.wait(WAIT_S), "no read finished before the kill"
    killed_at = time.monotonic()
    victim.kill()
    worker.join(WAIT_S)
    assert not worker.is_alive(), "reader hung after its peer died"
    assert isinstance(outcome.get("error"), TransportError | TransferTimeout), outcome
    assert time.monotonic() - killed_at < WAIT_S
    reader.t.remove_peer("P-kill")
    assert reader.t.peers() == ["P"]
    src, dst = shuffled_runs(MIB, 64 * KIB, seed=12)  # the reader still works
    read_and_check(reader, owner, src, dst, np.full(len(src), 64 * KIB))


def test_stalled_peer_times_out_then_recovers(reader: Reader) -> None:
    stalled = Owner("P-stall", seed=41)
    assert reader.t.add_peer(stalled.metadata) == "P-stall"
    src, dst = shuffled_runs(MIB, 64 * KIB, seed=14)
    size = np.full(len(src), 64 * KIB)
    remote = src.astype(np.uint64) + np.uint64(stalled.base)
    os.kill(stalled.pid, signal.SIGSTOP)  # it cannot answer the connection setup
    try:
        handle = reader.t.read("P-stall", reader.addr(dst), remote, size, notif=b"lost")
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            reader.t.wait(handle, timeout_s=0.5)
        assert time.monotonic() - start < 2.0
        with pytest.raises(TransportError, match="released"):
            reader.t.poll(handle)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    read_and_check(reader, stalled, src, dst, size)
    reader.t.remove_peer("P-stall")
    stalled.stop()


def test_restarted_peer_can_be_added_again(reader: Reader) -> None:
    first = Owner("P-r", seed=31)
    assert reader.t.add_peer(first.metadata) == "P-r"
    src, dst = shuffled_runs(4 * MIB, 64 * KIB, seed=13)
    size = np.full(len(src), 64 * KIB)
    read_and_check(reader, first, src, dst, size)
    first.stop()
    second = Owner("P-r", seed=32)  # same name, new process, different bytes
    assert second.metadata != first.metadata
    assert reader.t.add_peer(second.metadata) == "P-r"  # replaces the stale entry
    read_and_check(reader, second, src, dst, size)
    reader.t.remove_peer("P-r")
    reader.t.remove_peer("P-r")  # unknown now: ignored
    with pytest.raises(TransportError, match="unknown peer"):
        reader.t.read("P-r", reader.addr(dst), src.astype(np.uint64), size.astype(np.uint64))
    assert reader.t.add_peer(second.metadata) == "P-r"
    read_and_check(reader, second, src, dst, size)
    reader.t.remove_peer("P-r")
    second.stop()


def test_closed_transport_refuses_work() -> None:
    t = NixlTransport("D-closed", progress_delay_us=5000)
    buf = np.zeros(4096, np.uint8)
    t.register([Region(buf.ctypes.data, buf.nbytes)])
    t.close()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.metadata()
    with pytest.raises(TransportError, match="> 0"):
        NixlTransport("D-spin", progress_delay_us=0)


def test_an_agent_with_ucx_worker_threads_reads_exactly(owner: Owner, monkeypatch) -> None:
    """``KVBRIDGE_UCX_THREADS`` (UCX's ``num_threads``): the descriptors of one READ
    spread over worker threads land byte for byte; a count out of range is refused."""
    monkeypatch.setenv("KVBRIDGE_UCX_THREADS", "2")
    buf = np.zeros(8 * MIB, np.uint8)
    with NixlTransport("D-threads") as t:
        assert t.threads == 2
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        assert t.add_peer(owner.metadata) == owner.name
        rng = np.random.default_rng(11)
        n = 2048  # 4 KiB runs, shuffled on both sides
        src = rng.permutation(READ_AREA // (4 * KIB))[:n].astype(np.uint64) * np.uint64(4 * KIB)
        dst = rng.permutation(8 * MIB // (4 * KIB))[:n].astype(np.uint64) * np.uint64(4 * KIB)
        size = np.full(n, 4 * KIB, np.uint64)
        local = dst + np.uint64(buf.ctypes.data)
        t.wait(t.read(owner.name, local, src + np.uint64(owner.base), size), WAIT_S)
        source = pattern(P_BYTES, owner.seed)
        want = np.zeros_like(buf)
        for s_, d_ in zip(src.tolist(), dst.tolist(), strict=True):
            want[d_ : d_ + 4 * KIB] = source[s_ : s_ + 4 * KIB]
        assert np.array_equal(buf, want)
    for bad in (-1, 65):
        with pytest.raises(TransportError, match="UCX worker threads"):
            NixlTransport("D-bad-threads", threads=bad)


def test_memory_kinds_travel_in_the_metadata_and_device_memory_needs_a_gpu(
    reader: Reader, owner: Owner
) -> None:
    """The envelope names every region's kind and device; this machine has no GPU, so the
    agent moves host memory only and says so when handed device memory."""
    from kvbridge.layout.tensor import MemKind
    from kvbridge.transport import nixl as nixl_mod
    from kvbridge.transport.memory import cuda_available

    assert nixl_mod.NIXL_BUILD in ("nixl_cu12", "nixl_cu13")
    name, _, table = unseal(owner.metadata)
    assert name == "P" and table.shape == (1, 4)
    assert table[0, 1] == P_BYTES and table[0, 2] == 0 and table[0, 3] == 0  # host, device 0
    if cuda_available():
        pytest.skip("this machine has a GPU: device memory is covered by make gpu-check")
    assert reader.t.kinds == frozenset({MemKind.HOST})
    spare = np.zeros(4096, np.uint8)
    with pytest.raises(TransportError, match="moves host memory, not the device region"):
        reader.t.register([Region(spare.ctypes.data, spare.nbytes, MemKind.DEVICE, 0)])
