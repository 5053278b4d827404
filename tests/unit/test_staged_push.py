"""Staged push over the loopback transport: D's slot, P's gather, the fence.

P TP 1 → D TP 2 in NHD cuts every token row of K and V in two: ~430 runs of 64 B per
D rank for 200 tokens. Staged, P gathers them into its own slot and writes one span per
round into D's slot; D scatters. Bytes must equal the reference and a direct push.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.consumer import Consumer, Mode
from kvbridge.connector.movers import copies
from kvbridge.connector.movers.copies import copy_equal
from kvbridge.connector.movers.memory import LocalMemory
from kvbridge.connector.movers.push_gather import spans
from kvbridge.connector.producer import Producer, ProducerWorker
from kvbridge.control import messages
from kvbridge.control.channel import Client
from kvbridge.control.messages import PushRefused, PushRuns, seal, unseal
from kvbridge.errors import PeerError, TransportError
from kvbridge.layout.tensor import MemKind
from kvbridge.spec import Parallel
from kvbridge.transport.base import Region
from kvbridge.transport.loopback import Fabric, LoopbackTransport
from tests.support.scenario import Side
from tests.support.stalling import StallingLoopback
from tests.unit.test_connector_loopback import SECRET, SPEC, World, check_bytes

SCRIBBLE = 0xAB
N = 200


class HeadSplit(World):
    """P TP 1 → D TP 2, NHD on both sides, push mode (the World helper's methods)."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        staging_bytes: int = 32 << 20,
        push_slots: int = 2,
        memory: MemKind = MemKind.HOST,
    ):
        self.rng = np.random.default_rng(7)
        self.p = Side(SPEC, Parallel(1), "nhd", 32)
        self.d = Side(SPEC, Parallel(2), "nhd", 64)
        self.p.allocate(self.rng)
        self.d.allocate(self.rng)
        self.fabric = Fabric()
        self.producer = Producer("P", SPEC, self.p.par, SECRET)
        agent = StallingLoopback("p0", self.fabric)
        bases = list(self.p.bound(0).bases)
        lay = self.p.layouts[0]
        worker = ProducerWorker(
            0,
            lay,
            bases,
            agent,
            SECRET,
            "127.0.0.1",
            timeout_s,
            push_slots=push_slots,
            memory=memory,
        )
        self.workers = [worker]
        self.producer.add_rank(worker.info)
        self.consumers = [
            Consumer(
                "D",
                self.d.spec,
                self.d.par,
                r,
                self.d.layouts[r],
                list(self.d.bound(r).bases),
                LoopbackTransport(f"d{r}", self.fabric),
                SECRET,
                transfer_timeout_s=timeout_s,
                staging_bytes=staging_bytes,
                mode=Mode.PUSH,
                memory=memory,
            )
            for r in range(2)
        ]
        for c in self.consumers:  # the choice, not the timing of a loaded machine
            if c.stager is not None:
                c.stager.costs.link = replace(c.stager.costs.link, desc_s=1e-4)

    def load(self, rid: str, n: int = N) -> tuple[list[list[np.ndarray]], list[list[int]]]:
        before = [[b.copy() for b in bufs] for bufs in self.d.bufs]
        handle, d_tabs = self.request(rid, n)
        for c in self.consumers:
            c.load(handle, d_tabs)
        return before, d_tabs


def test_staged_push_is_byte_exact_and_equals_a_direct_push() -> None:
    w = HeadSplit()
    try:
        before, d_tabs = w.load("s")
        outs = w.wait(2)
        assert all(o.ok for o in outs), outs
        assert all(o.staged_runs > 300 and o.descriptors < 10 for o in outs), outs
        check_bytes(w, before, N, 0, d_tabs)
        gather = w.workers[0].gather
        assert gather is not None and gather.gathered >= 2 and gather.direct == 0
        assert all(c.stager and c.stager.pool._free.qsize() == 2 for c in w.consumers)
        staged = [[b.copy() for b in bufs] for bufs in w.d.bufs]
    finally:
        w.close()
    w = HeadSplit(staging_bytes=0)  # same seed: same tables, same bytes, pushed direct
    try:
        w.load("s")
        outs = w.wait(2)
        assert all(o.ok and o.staged_runs == 0 and o.descriptors > 300 for o in outs), outs
        for got, want in zip(w.d.bufs, staged, strict=True):
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        w.close()


def test_rounds_when_the_request_exceeds_a_slot() -> None:
    """D slots of 16 KiB: the request goes in several rounds, still byte-exact."""
    w = HeadSplit(staging_bytes=32 << 10)
    try:
        before, d_tabs = w.load("r")
        outs = w.wait(2)
        assert all(o.ok and o.staged_runs > 300 for o in outs), outs
        assert all(o.descriptors >= 3 for o in outs), outs  # a span per round: 36 KB, 3 rounds
        check_bytes(w, before, N, 0, d_tabs)
    finally:
        w.close()


def test_a_copy_failing_mid_rounds_answers_the_call_in_flight() -> None:
    """Several rounds; D0's first scatter fails while P writes its next round: that load
    fails (and D1's, if P already fenced the request), the call in flight is answered
    (the P rank's channel is free again: the fence and the next load go through it), and
    the next load is byte-exact."""
    w = HeadSplit(staging_bytes=32 << 10)
    try:
        stager = w.consumers[0].stager
        assert stager is not None
        real, seen = stager.memory.scatter, []

        def scatter(*args):  # type: ignore[no-untyped-def]
            seen.append(1)
            if len(seen) == 1:
                raise TransportError("copy failed")
            return real(*args)

        stager.memory.scatter = scatter  # type: ignore[method-assign]
        w.load("bad")
        outs = w.wait(2)
        assert any(not o.ok and "copy failed" in o.error for o in outs), outs  # D0
        assert all(o.ok or "copy failed" in o.error or "fenced" in o.error for o in outs), outs
        before, d_tabs = w.load("good")
        outs = w.wait(2)
        assert all(o.ok and o.staged_runs > 300 for o in outs), outs
        check_bytes(w, before, N, 0, d_tabs)
    finally:
        w.close()


def test_a_staged_loads_nonce_is_retired_after_its_last_round() -> None:
    """Each D rank's rounds carry one nonce, ``last`` only on its final round; replaying
    that round (or an earlier one) once the load ended is refused as a retired nonce."""
    w = HeadSplit(staging_bytes=32 << 10)
    seen: list[PushRuns] = []
    ledger = w.workers[0].ledger
    admit = ledger.admit
    ledger.admit = lambda m: seen.append(m) or admit(m)  # type: ignore[method-assign,func-returns-value]
    try:
        w.load("n")
        assert all(o.ok and o.staged_runs > 300 for o in w.wait(2))
        client = Client(w.workers[0].info.endpoint, SECRET, 3.0)
        try:
            for nonce in {m.nonce for m in seen}:
                mine = [m for m in seen if m.nonce == nonce]
                assert len(mine) >= 3 and all(m.staged for m in mine)
                assert [m.last for m in mine] == [False] * (len(mine) - 1) + [True]
                for replay in (mine[-1], mine[0]):
                    assert client.call(replay) == PushRefused("n", "retired nonce")
        finally:
            client.close()
        assert ledger.refused == {"retired nonce": 4}
    finally:
        w.close()


def test_p_without_a_free_slot_writes_direct_byte_exact() -> None:
    w = HeadSplit(push_slots=1)
    try:
        gather = w.workers[0].gather
        assert gather is not None
        held = gather.pool.take(0.1)  # every P slot busy (a write still running)
        assert held is not None
        before, d_tabs = w.load("busy")
        outs = w.wait(2)
        assert all(o.ok and o.staged_runs > 300 and o.descriptors > 300 for o in outs)
        assert gather.gathered == 0 and gather.direct >= 2
        check_bytes(w, before, N, 0, d_tabs)
        gather.pool.give_back(held, True)
        before, d_tabs = w.load("free")
        assert all(o.ok and o.descriptors < 10 for o in w.wait(2))
        assert gather.gathered >= 2
        check_bytes(w, before, N, 0, d_tabs)
    finally:
        w.close()


def test_a_stalled_p_holds_ds_slot_until_its_write_ended() -> None:
    """P's writes to both D ranks stall past the 0.3 s deadline: each D rank holds its
    failure, and its slot, until P says the write ended; P holds its own slot as long.
    Resumed, the late bytes land in D's slot only; D's blocks, reused after the report,
    see none. Then a next request stages byte-exact again."""
    w = HeadSplit(timeout_s=0.3)
    try:
        p = w.workers[0]
        assert isinstance(p.transport, StallingLoopback) and p.gather is not None
        p.transport.stall("d0")
        p.transport.stall("d1")
        w.load("late")
        time.sleep(1.2)
        assert all(c.poll() == [] and c.fence.held() == 1 for c in w.consumers)
        assert all(c.stager and c.stager.pool._free.qsize() == 1 for c in w.consumers)
        # P serves one push at a time: a D rank whose call timed out while P waited on the
        # other's write may never have reached P; every push P took holds its slot
        assert p.gather.pool._free.qsize() <= 1
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        p.transport.resume("d0")
        p.transport.resume("d1")
        outs = w.wait(2, timeout=5)
        assert all(not o.ok and o.stages["fence"] > 0.8 and o.staged_runs == 0 for o in outs)
        for got, was in zip(w.d.bufs, before, strict=True):  # landed in the slots only
            assert all(np.array_equal(a, b) for a, b in zip(got, was, strict=True))
        assert all(c.stager and c.stager.pool._free.qsize() == 2 for c in w.consumers)
        assert p.gather.pool._free.qsize() == 2
        for bufs in w.d.bufs:
            for b in bufs:
                b[:] = SCRIBBLE  # the engine reuses the blocks
        time.sleep(0.2)
        assert all(bool((b == SCRIBBLE).all()) for bufs in w.d.bufs for b in bufs)
        before, d_tabs = w.load("after")
        assert all(o.ok and o.staged_runs > 300 for o in w.wait(2))
        check_bytes(w, before, N, 0, d_tabs)
    finally:
        w.close()


def test_push_staging_off_pushes_direct() -> None:
    w = HeadSplit()
    try:
        for c in w.consumers:
            c.staging = False
        before, d_tabs = w.load("off")
        assert all(o.ok and o.staged_runs == 0 and o.descriptors > 300 for o in w.wait(2))
        check_bytes(w, before, N, 0, d_tabs)
    finally:
        w.close()


def test_the_staged_flag_needs_the_new_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag travels; a D of the previous protocol version is refused, typed."""
    msg = PushRuns("r", b"a", b"", b"", b"", b"n", staged=True)
    got = unseal(seal(msg, SECRET), SECRET)
    assert isinstance(got, PushRuns) and got.staged
    assert messages.PROTOCOL_VERSION >= 5
    monkeypatch.setattr("kvbridge.connector.peers.PROTOCOL_VERSION", 4)
    w = HeadSplit()
    try:
        w.load("old")
        outs = w.wait(2)
        assert all(not o.ok and "IncompatibleError" in o.error for o in outs), outs
    finally:
        w.close()


def test_p_gathers_only_runs_whose_destinations_join() -> None:
    n = np.full(32, 64, np.int64)
    src = np.arange(32, dtype=np.int64) * 1000 + 7
    joined = spans(np.arange(32, dtype=np.int64)[::-1] * 64 + 4096, src, n, 1 << 20)
    assert joined is not None and joined.span_len.tolist() == [2048]
    assert joined.span_src.tolist() == [4096]  # D's destination
    assert joined.run_dst.tolist() == src[::-1].tolist()  # P's sources, in D's order
    assert joined.run_stage.tolist() == (np.arange(32) * 64).tolist()
    assert spans(np.arange(32, dtype=np.int64) * 128, src, n, 1 << 20) is None  # gaps
    assert spans(np.arange(32, dtype=np.int64) * 64, src, n, 1024) is None  # over a slot
    overlapping = np.arange(32, dtype=np.int64) * 32
    assert spans(overlapping, src, n, 1 << 20) is None


def test_gather_refuses_a_source_outside_local_memory() -> None:
    buf = np.zeros(256, np.uint8)
    mem = LocalMemory([Region(int(buf.ctypes.data), 256)])
    one = np.array([1], np.int64)
    with pytest.raises(TransportError, match="lies in no region"):
        mem.gather(one * (int(buf.ctypes.data) + 250), np.zeros(64, np.uint8), one * 0, one * 8)


@settings(max_examples=150, deadline=None)
@given(
    size=st.sampled_from([1, 8, 24, 64, 1024]),
    pieces=st.lists(
        st.tuples(st.integers(1, 40), st.integers(-3, 3), st.integers(-2, 2)),
        min_size=1,
        max_size=8,
    ),
    seed=st.integers(0, 1000),
    view_s=st.sampled_from([1e-12, copies.VIEW_S, 1.0]),
)
def test_copy_equal_matches_a_loop_on_progressions(size, pieces, seed, view_s) -> None:
    """Runs in arithmetic progressions (strided path) or not (gather-scatter) copy as a
    plain loop does; destinations disjoint, sources anywhere. ``view_s``: what a strided
    view is taken to cost (tiny: progressions go strided; large: everything gathers)."""
    rng = np.random.default_rng(seed)
    s_off: list[int] = []
    for count, s_step, _ in pieces:
        start = int(rng.integers(0, 64)) * size
        s_off += [max(start + i * s_step * size, 0) for i in range(count)]
    k = len(s_off)
    d_slots = np.arange(k, dtype=np.int64)
    if pieces[0][2] < 0:
        d_slots = d_slots[::-1].copy()
    elif pieces[0][2] > 0:
        d_slots = rng.permutation(d_slots)
    gap = size * (1 + abs(pieces[0][2]))
    d_off = d_slots * gap
    src = rng.integers(0, 256, max(s_off) + size, dtype=np.uint8)
    dst, want = np.zeros(k * gap, np.uint8), np.zeros(k * gap, np.uint8)
    s = np.array(s_off, np.int64)
    with mock.patch.object(copies, "VIEW_S", view_s):
        copy_equal(dst, d_off, src, s, size)
    for a, b in zip(d_off.tolist(), s_off, strict=True):
        want[a : a + size] = src[b : b + size]
    assert np.array_equal(dst, want)


def test_a_round_whose_second_ask_fails_answers_the_first() -> None:
    """Rank 1's channel refuses the ask after rank 0's was sent: rank 0's call is
    answered before the failure goes on (its client would otherwise stay locked: the
    next push to it would wait for ever; ``test_pd_processes``'s killed P rank, push)."""
    from types import SimpleNamespace

    from kvbridge.connector.movers.push import Part, StagedPush, push_staged
    from kvbridge.connector.movers.spans import Chunk

    answered: list[int] = []

    class Pusher:
        def notif(self, src: int) -> str:
            return f"n{src}"

        def ask(self, src, runs, notif, part, staged):  # type: ignore[no-untyped-def]
            if src == 1:
                raise TransportError("rank 1's channel is down")
            return lambda: answered.append(src) or 1

    zero, n = np.zeros(1, np.int64), np.full(1, 64, np.int64)
    chunk = Chunk(zero, zero, n, zero, zero, n)
    pool = SimpleNamespace(
        region=SimpleNamespace(addr=0), slot_bytes=1 << 20, view=lambda s: np.zeros(1 << 20)
    )
    stager = SimpleNamespace(pool=pool, memory=SimpleNamespace(scatter=lambda *a: None))
    plan = StagedPush(0, [[Part(0, chunk, 0), Part(1, chunk, 64)]], frozenset({0, 1}))
    with pytest.raises(TransportError, match="down"):
        push_staged(stager, Pusher(), plan, lambda want: None)  # type: ignore[arg-type]
    assert answered == [0]


def test_a_direct_push_asks_every_p_rank_before_it_awaits_an_answer() -> None:
    """Each P rank answers only once the other was asked too: a D that awaited one
    rank's answer before asking the next would wait out the 5 s here (one round trip for
    the ranks, not one per rank)."""
    w = World(mode=Mode.PUSH)  # P TP 2 → D TP 1: both P ranks write
    try:
        asked = [threading.Event(), threading.Event()]
        waited: list[bool] = []

        def answering(rank: int, real: Any) -> Any:
            def handle(msg: messages.Message) -> messages.Message:
                if isinstance(msg, PushRuns):
                    asked[rank].set()
                    waited.append(asked[1 - rank].wait(5))
                return real(msg)

            return handle

        w.consumers[0].staging = False  # direct: each rank's runs in one message
        for rank, wk in enumerate(w.workers):
            assert wk.server is not None
            wk.server.handler = answering(rank, wk.server.handler)
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("r", 45)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok and out.mover == "push" and out.staged_runs == 0, (out.mover, out.error)
        assert waited == [True, True]
        check_bytes(w, before, 45, 0, d_tabs)
    finally:
        w.close()


def test_a_rank_failing_a_direct_push_leaves_no_other_ranks_channel_waiting() -> None:
    """P rank 0 fails the push: the load fails, typed; rank 1's answer is taken all the
    same (its channel serves the next load, which lands byte-exact)."""
    w = World(mode=Mode.PUSH)
    try:
        w.consumers[0].staging = False
        wk = w.workers[0]
        assert wk.server is not None
        real, failed = wk.server.handler, []

        def refusing(msg: messages.Message) -> messages.Message:
            if isinstance(msg, PushRuns) and not failed:
                failed.append(msg.request_id)
                raise PeerError("rank 0 cannot write now")
            return real(msg)

        wk.server.handler = refusing
        handle, d_tabs = w.request("bad", 45)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert not out.ok and "rank 0 cannot write now" in out.error, out.error
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("good", 45)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok and out.staged_runs == 0, out.error
        check_bytes(w, before, 45, 0, d_tabs)
    finally:  # a channel left waiting would hang the close: fail instead
        closing = threading.Thread(target=w.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "closing waits on a P rank's channel left locked"
