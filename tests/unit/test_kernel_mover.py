"""The kernel mover: D maps P's regions (here shared through /dev/shm files, the CPU half
of CUDA IPC) and copies a request with one gather-scatter per run length. Byte-exact
against the element-wise reference; chosen only where P shares its memory, with the
reason in the outcome; hostile shares and stray runs refused before any byte moves."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from kvbridge.connector.movers import kernel as kernel_mover
from kvbridge.connector.movers.copies import by_length
from kvbridge.connector.movers.memory import Span
from kvbridge.control.lease import LeaseState
from kvbridge.control.messages import LeaseOp, tables_digest
from kvbridge.errors import TransportError
from kvbridge.layout.tensor import MemKind, Region
from kvbridge.transport.ipc import Opened, Share, export, node_id
from tests.unit.test_connector_loopback import World, check_bytes

HOST, DEVICE = MemKind.HOST, MemKind.DEVICE


class ShmPool:
    """uint8 arrays backed by files in /dev/shm (unlinked at close)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.maps: list[mmap.mmap] = []

    def __call__(self, nbytes: int) -> np.ndarray:
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvb-test-")
        self.paths.append(path)
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.maps.append(m)
        return np.frombuffer(m, dtype=np.uint8)

    def close(self) -> None:
        for p in self.paths:
            os.unlink(p)


@pytest.fixture
def shm() -> Iterator[ShmPool]:
    pool = ShmPool()
    yield pool
    pool.close()


def load_one(w: World, rid: str = "r1", n: int = 45):
    before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
    handle, d_tabs = w.request(rid, n)
    w.consumers[0].load(handle, d_tabs)
    (out,) = w.wait()
    assert out.ok, out.error
    check_bytes(w, before, n, 0, d_tabs)
    return out


def test_shared_p_memory_moves_by_kernel_byte_exact(shm: ShmPool) -> None:
    w = World(p_memory=shm)
    try:
        assert all(i.shares and i.node == node_id() for i in w.producer.ranks.values())
        out = load_one(w)
        assert (out.mover, out.reason) == ("kernel", "P's memory is mapped here (same node)")
        assert 0 < out.descriptors <= 8  # copy calls: one per run length and P rank
        out2 = load_one(w, "r2", 70)  # the mapping is kept per P epoch
        assert out2.mover == "kernel"
    finally:
        w.close()


def remap(mover, peer) -> None:
    """What a load meeting another epoch of ``peer``'s P does to its mappings: retired
    (unmapped once idle), so the next load maps P's memory again, elsewhere."""
    from types import SimpleNamespace

    real = mover._open

    def refused(p, src):
        raise TransportError("that epoch's memory is gone")

    mover._open = refused
    try:
        for src in sorted(peer.geometry.links):
            with pytest.raises(TransportError):
                mover._acquire(SimpleNamespace(engine_id=peer.engine_id, epoch="old"), src)
    finally:
        mover._open = real


def test_memory_mapped_again_gets_a_new_geometry_and_stale_offsets_copy_nothing(
    shm: ShmPool,
) -> None:
    """A geometry over mapped memory holds for that mapping only: after P's memory was
    mapped again (a load met another epoch of that P) the next load plans over the new
    offsets, byte-exact; a plan over offsets that no longer hold is refused before any byte
    moves."""
    w = World(p_memory=shm)
    try:
        load_one(w)
        c = w.consumers[0]
        assert c.kernel is not None
        handle, d_tabs = w.request("r2", 45)
        peer = c.peers.get(handle)
        before, why = c.kernel.geometry(peer)
        assert before is not None and why == ""
        assert c.kernel.geometry(peer)[0] is before  # kept while the mapping holds
        holes = [mmap.mmap(-1, 4096 * (k + 1)) for k in range(8)]  # may land elsewhere
        remap(c.kernel, peer)
        plan = before.geometry.plan(handle.n_tokens, handle.block_tables, d_tabs, 0)
        d_before = [b.copy() for b in w.d.bufs[0]]
        with pytest.raises(TransportError, match="mapped again since this load was planned"):
            stale = replace(before, bases={src: (-1,) for src in plan.runs})
            c.kernel.launch(peer, plan.runs, stale)
        assert all(np.array_equal(a, b) for a, b in zip(d_before, w.d.bufs[0], strict=True))
        after, why = c.kernel.geometry(peer)
        assert after is not None and after is not before, why
        c.peers.done(peer)
        assert load_one(w, "r3", 70).mover == "kernel"  # byte-exact over the new mapping
        for h in holes:
            h.close()
    finally:
        w.close()


def test_unshared_p_memory_is_pulled_and_the_outcome_says_why() -> None:
    w = World()  # numpy memory: anonymous, no share
    try:
        out = load_one(w)
        assert out.mover == "pull" and "P rank 0 shares no memory" in out.reason
    finally:
        w.close()


def test_kernel_mover_on_device_memory_runs_the_device_path(
    shm: ShmPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVBRIDGE_DEVICE_ON_CPU", "1")
    w = World(p_memory=shm, memory=(DEVICE, DEVICE))
    try:
        assert load_one(w).mover == "kernel"
    finally:
        w.close()
    w = World(p_memory=shm, memory=(DEVICE, HOST))  # a host D cannot run P's kernel
    try:
        out = load_one(w)
        assert out.mover == "pull" and "keeps device memory, this rank host" in out.reason
    finally:
        w.close()


def test_kernel_mover_can_be_turned_off(shm: ShmPool) -> None:
    w = World(p_memory=shm)
    try:
        for c in w.consumers:
            c.kernel = None
        assert load_one(w).mover == "pull"
    finally:
        w.close()


def test_shares_are_found_only_for_shm_backed_memory(shm: ShmPool) -> None:
    backed = shm(3 * 4096)
    share = export(Region(int(backed.ctypes.data) + 4100, 5000))
    assert share is not None and share.way == "shm" and share.offset == 4100
    assert export(Region(int(np.zeros(8192, np.uint8).ctypes.data), 8192)) is None
    opened = Opened([share], HOST)
    try:
        backed[4100:4110] = np.arange(10, dtype=np.uint8)
        seen = np.ctypeslib.as_array((ctypes.c_uint8 * 10).from_address(opened.bases[0]))
        assert seen.tolist() == list(range(10))  # the same pages, mapped again
    finally:
        opened.close()


@pytest.mark.parametrize(
    "share",
    [
        Share("shm", b"/etc/passwd", 0, 64),
        Share("shm", b"/dev/shm/../etc/passwd", 0, 64),
        Share("shm", b"/dev/shm/kvb-no-such-file", 0, 64),
        Share("shm", b"/dev/shm/x", -4096, 64),
        Share("rdma", b"whatever", 0, 64),
        Share("cuda", b"short", 0, 64),
    ],
)
def test_hostile_shares_are_refused_typed(share: Share) -> None:
    with pytest.raises(TransportError):
        Opened([share], HOST)


def test_a_share_d_cannot_map_sends_the_load_over_the_transport(shm: ShmPool) -> None:
    import msgspec

    from kvbridge.control.messages import WireShare

    w = World(p_memory=shm)
    try:
        for r, info in list(w.producer.ranks.items()):
            bad = [WireShare("shm", b"/etc/shadow", 0, s.nbytes) for s in info.shares]
            w.producer.ranks[r] = msgspec.structs.replace(info, shares=bad)
        for rid in ("r1", "r2"):  # the refusal is remembered for the P epoch
            out = load_one(w, rid)
            assert out.mover == "pull", out
            assert "cannot be mapped here" in out.reason and "/etc/shadow" in out.reason
        assert not w.consumers[0].kernel._sources  # type: ignore[union-attr]
    finally:
        w.close()


def test_a_share_past_the_end_of_its_file_is_refused(shm: ShmPool) -> None:
    backed = shm(8192)
    share = export(Region(int(backed.ctypes.data), 8192))
    assert share is not None
    with pytest.raises(TransportError, match="the share ends at"):
        Opened([Share("shm", share.handle, 4096, 8192, share.ident)], HOST)  # would fault


def test_span_maps_names_to_offsets_and_refuses_stray_runs() -> None:
    a, b = np.zeros(4096, np.uint8), np.zeros(1024, np.uint8)
    regions = [Region(int(a.ctypes.data), 4096), Region(int(b.ctypes.data), 1024)]
    span = Span(regions, names=[1 << 20, 1 << 30])  # as P addresses them
    off = span.offsets(np.array([(1 << 20) + 8, (1 << 30) + 16]), np.array([8, 8]), "x")
    span.tensor[off[0] : off[0] + 8] = 1
    span.tensor[off[1] : off[1] + 8] = 2
    assert a[8:16].tolist() == [1] * 8 and b[16:24].tolist() == [2] * 8
    assert a.sum() == 8 and b.sum() == 16
    for addr, n in [((1 << 20) + 4090, 8), ((1 << 20) - 1, 2), ((1 << 30) + 1024, 1)]:
        with pytest.raises(TransportError, match="lies in no region"):
            span.offsets(np.array([addr]), np.array([n]), "x")
    for n in (0, 1 << 40):
        with pytest.raises(TransportError, match=rf"length {n} B is outside \(0, 2\^40\) B"):
            span.offsets(np.array([1 << 20]), np.array([n]), "x")


def test_span_bases_address_the_tensor_and_check_bounds_every_run() -> None:
    """A plan made over ``Span.bases`` (the kernel mover's geometry) addresses the
    tensor directly; :meth:`Span.check` refuses any run outside it, wherever it is."""
    a, b = np.zeros(4096, np.uint8), np.zeros(1024, np.uint8)
    span = Span([Region(int(b.ctypes.data), 1024), Region(int(a.ctypes.data), 4096)])
    top = span.tensor.shape[0]
    for base, arr in zip(span.bases, (b, a), strict=True):
        span.tensor[base + 5] = 7
        assert arr[5] == 7
    good = np.array([span.bases[0], span.bases[1] + 4088], np.int64)
    span.check(good, np.array([8, 8], np.int64), "x", (8, 8))
    rng = np.random.default_rng(1)
    for off, n in [(-1, 2), (top - 4, 5), (0, 0), (5, -3), (top, 1)]:
        offs, lens = rng.integers(0, top - 64, 300), np.full(300, 8)
        at = int(rng.integers(0, 300))
        offs[at], lens[at] = off, n
        with pytest.raises(TransportError, match=f"run {at} .* lies outside"):
            span.check(offs, lens, "x", (int(lens.min()), int(lens.max())))


def test_by_length_groups_runs_in_order() -> None:
    groups = by_length(np.array([8, 4, 8, 4, 2]))
    assert [(np.asarray(k).tolist(), n) for k, n in groups] == [([4], 2), ([1, 3], 4), ([0, 2], 8)]
    assert by_length(np.array([3, 3])) == [(slice(0, 2), 3)]


def test_equal_runs_cuts_joined_runs_into_one_length_byte_exact() -> None:
    from kvbridge.connector.movers.memory import equal_runs

    rng = np.random.default_rng(3)
    length = rng.choice([1024, 2048, 3072, 5120], size=40).astype(np.int64)
    s_off = np.concatenate(([0], np.cumsum(length)[:-1])) * 2  # gaps between sources
    d_off = rng.permutation(40) * 8192
    (d, s, size), *rest = equal_runs(d_off, s_off, length)
    assert not rest and size == 1024 and d.shape[0] == int(length.sum()) // 1024
    src = rng.integers(0, 256, int(s_off[-1] + length[-1]), dtype=np.uint8)
    got, want = np.zeros(40 * 8192, np.uint8), np.zeros(40 * 8192, np.uint8)
    for a, b in zip(d.tolist(), s.tolist(), strict=True):
        got[a : a + size] = src[b : b + size]
    for a, b, n in zip(d_off.tolist(), s_off.tolist(), length.tolist(), strict=True):
        want[a : a + n] = src[b : b + n]
    assert np.array_equal(got, want)
    odd = np.array([100, 300], np.int64)  # divisor 100 < 256 B: grouped by length instead
    assert [x[2] for x in equal_runs(np.array([0, 512]), np.array([0, 512]), odd)] == [100, 300]


def test_only_shared_file_mappings_are_offered() -> None:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvb-test-")
    try:
        os.ftruncate(fd, 8192)
        private = mmap.mmap(fd, 8192, flags=mmap.MAP_PRIVATE)
        arr = np.frombuffer(private, dtype=np.uint8)
        # P's writes to a private mapping are not the file's pages: D would read zeros
        assert export(Region(int(arr.ctypes.data), 8192)) is None
        del arr
        private.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_shares_that_do_not_fit_here_are_refused(shm: ShmPool, tmp_path) -> None:
    backed = shm(8192)
    share = export(Region(int(backed.ctypes.data), 8192))
    assert share is not None and share.ident != 0
    with pytest.raises(TransportError, match="'shm' share for device memory"):
        Opened([share], DEVICE) if _cuda() else _fake_gpu(share)
    other = Share("shm", share.handle, 0, 8192, share.ident ^ 1)  # same name, another file
    with pytest.raises(TransportError, match="not the file P shares"):
        Opened([other], HOST)
    os.makedirs("/dev/shm/kvb-test-dir", exist_ok=True)
    link = "/dev/shm/kvb-test-dir/x"
    try:
        with pytest.raises(TransportError, match="refused"):  # nothing below a subdirectory
            Opened([Share("shm", link.encode(), 0, 8192, share.ident)], HOST)
    finally:
        os.rmdir("/dev/shm/kvb-test-dir")
    with pytest.raises(TransportError, match="'cuda' share for host memory"):
        Opened([Share("cuda", bytes(64), 0, 8192)], HOST)


def _cuda() -> bool:
    from kvbridge.transport.memory import cuda_available

    return cuda_available()


def _fake_gpu(share: Share) -> None:
    from unittest import mock

    with mock.patch("kvbridge.transport.ipc.cuda_available", lambda: True):
        Opened([share], DEVICE)


def test_share_sizes_must_match_the_regions_at_the_handshake(shm: ShmPool) -> None:
    import msgspec

    from kvbridge.control.messages import rank_shares
    from kvbridge.errors import PeerError

    w = World(p_memory=shm)
    try:
        info = next(iter(w.producer.ranks.values()))
        assert len(rank_shares(info)) == len(info.regions)
        short = [msgspec.structs.replace(x, nbytes=x.nbytes - 1) for x in info.shares]
        with pytest.raises(PeerError, match="shares of"):
            rank_shares(msgspec.structs.replace(info, shares=short))
    finally:
        w.close()


def test_an_older_epochs_mapping_closes_once_no_copy_uses_it() -> None:
    from types import SimpleNamespace

    from kvbridge.connector.movers.kernel import KernelMover

    buf = np.zeros(4096, np.uint8)
    mover = KernelMover([Region(int(buf.ctypes.data), 4096)])
    closed: list[str] = []

    def fake_open(peer, src):
        if peer.epoch == "e3":
            raise TransportError("P rank 0's memory: refused")
        opened = SimpleNamespace(close=lambda: closed.append(peer.epoch))
        return opened, mover.dst

    mover._open = fake_open  # type: ignore[method-assign]
    e1 = mover._acquire(SimpleNamespace(engine_id="P", epoch="e1"), 0)  # a copy running
    e2 = mover._acquire(SimpleNamespace(engine_id="P", epoch="e2"), 0)  # P restarted
    assert closed == []  # e1 still in use
    mover._release(e1)
    assert closed == ["e1"]
    mover._release(e2)
    with pytest.raises(TransportError, match="refused"):  # P restarted again, unmappable
        mover._acquire(SimpleNamespace(engine_id="P", epoch="e3"), 0)
    assert closed == ["e1", "e2"]  # retired though the new epoch did not map
    mover.close()


def _landed(w: World, before, n: int, d_tabs) -> bool:
    try:
        check_bytes(w, before, n, 0, d_tabs)
    except AssertionError:
        return False
    return True


def hold_begin(w: World, monkeypatch, landed, at_most: float) -> list[bool]:
    """P holds each ``begin`` answer until ``landed()`` (D's bytes are there) or for
    ``at_most`` seconds; the list gets, per ``begin``, whether they had landed."""
    seen: list[bool] = []
    real = w.producer.leases.on_op

    def on_op(msg):
        if msg.op == "begin":
            end = time.monotonic() + at_most
            while not landed() and time.monotonic() < end:
                time.sleep(0.005)
            seen.append(landed())
        return real(msg)

    monkeypatch.setattr(w.producer.leases, "on_op", on_op)
    return seen


@pytest.mark.parametrize("kernel", [True, False])
def test_the_kernel_copy_runs_while_p_answers_begin_other_movers_wait(
    shm: ShmPool, kernel: bool, monkeypatch
) -> None:
    """The kernel mover reads P's memory in place and asks P nothing, so where its copies
    run asynchronously (``overlap``: a GPU; set here on the CPU, where the same code runs
    the copy synchronously) they do not wait for P's answer to ``begin`` (the lease round
    trip is off the critical path): P, holding its answer, sees D's bytes land. A mover
    that does ask P (pull here) starts only once P answered: P sees nothing land while
    it holds the answer."""
    w = World(p_memory=shm)
    try:
        for c in w.consumers:
            if not kernel:
                c.kernel = None
            elif c.kernel is not None:
                c.kernel.overlap = True
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("r1", 45)
        seen = hold_begin(w, monkeypatch, lambda: _landed(w, before, 45, d_tabs), 1.0)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok, out.error
        assert out.mover == ("kernel" if kernel else "pull")
        assert seen == [kernel]
        check_bytes(w, before, 45, 0, d_tabs)
        if kernel:  # the wait for P's answer lies inside the transfer: not added to it
            assert out.stages["lease"] <= out.stages["transfer"]
    finally:
        w.close()


@pytest.mark.parametrize("refusal", ["aborted", "lapsed", "another D began"])
def test_a_kernel_copy_made_before_p_refused_the_lease_fails_the_load(
    shm: ShmPool, refusal: str
) -> None:
    """Bytes the kernel mover copied while P answered count only if P answered "held":
    an aborted or lapsed lease, or one another D engine began, fails the load (its
    blocks reported for recompute), never reports it done."""
    w = World(p_memory=shm, lease_s=0.3 if refusal == "lapsed" else 30.0)
    try:
        for c in w.consumers:
            assert c.kernel is not None and not c.kernel.overlap  # host copies: synchronous
            c.kernel.overlap = True
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("r1", 45)
        if refusal == "aborted":
            assert w.producer.abort("r1")
        elif refusal == "lapsed":
            time.sleep(0.6)
        else:
            digest = tables_digest(handle.block_tables, handle.n_tokens)
            op = LeaseOp("begin", "r1", handle.lease_id, digest, "D-other", 0, 1, "e0", "")
            assert w.producer.leases.on_op(op).state == "held"
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert not out.ok
        want = {"aborted": "LeaseExpired", "lapsed": "LeaseExpired"}
        assert want.get(refusal, "not this D's lease") in out.error, out.error
        assert out.failed_blocks[0] == d_tabs[0]
        assert _landed(w, before, 45, d_tabs)  # the copy ran before P's answer came
    finally:
        w.close()


def test_host_kernel_copies_wait_for_p_and_a_failed_copy_still_takes_its_answer(
    shm: ShmPool, monkeypatch
) -> None:
    """On the host the kernel mover's copy is synchronous: it waits for P's "held" (the
    side channel stays locked until the answer is taken). A copy failing before its
    launch (here where the copies would overlap P's answer, as on a GPU) still takes
    P's answer, so its ``fail`` carries the token (P frees the blocks at once) and the
    next load to that P goes through."""
    w = World(p_memory=shm)
    try:
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("r1", 45)
        seen = hold_begin(w, monkeypatch, lambda: _landed(w, before, 45, d_tabs), 0.2)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok and out.mover == "kernel" and seen == [False], out.error
        monkeypatch.undo()

        def broken(*_):
            raise TransportError("copy refused")

        monkeypatch.setattr(kernel_mover, "copy_groups", broken)
        monkeypatch.setattr(w.consumers[0].kernel, "overlap", True)  # as on a GPU
        handle, d_tabs = w.request("r2", 45)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert not out.ok and "copy refused" in out.error
        freed = w.producer.freed(wait_for=2)
        assert {f.request_id: f.reason for f in freed}["r2"] == LeaseState.DONE
        monkeypatch.undo()
        load_one(w, "r3", 30)
    finally:
        w.close()


def test_divisor_is_the_gcd_of_what_runs_can_start_at() -> None:
    """Llama-style heads (8 × 128 bf16: 256 B a head, the smallest piece a run has):
    256 with aligned region bases; a base 8 B past alignment brings it to 8."""
    from benchmarks.plan_bench import bound_all
    from benchmarks.shapes import llama
    from kvbridge.plan import Bound, Geometry, Side
    from kvbridge.spec import Parallel

    spec = llama(2)
    for p_tp, d_tp in ((1, 1), (1, 2), (2, 1)):
        p_b = bound_all(spec, Parallel(p_tp), "nhd", 64, 1 << 30)
        d_b = bound_all(spec, Parallel(d_tp), "hnd", 64, 1 << 31)
        geom = Geometry(Side(spec, Parallel(p_tp), p_b), Side(spec, Parallel(d_tp), d_b), 0)
        assert {geom.divisor(src) for src in range(p_tp)} == {256}
        odd = [Bound(b.layout, tuple(a + 8 for a in b.bases)) for b in p_b]
        geom = Geometry(Side(spec, Parallel(p_tp), odd), Side(spec, Parallel(d_tp), d_b), 0)
        assert {geom.divisor(src) for src in range(p_tp)} == {8}
        assert geom.divisor(p_tp) == 1  # a rank that serves nothing
