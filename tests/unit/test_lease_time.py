"""D counts a load done without a second round trip when its last byte landed within
half the lease time P granted at ``begin``; otherwise it asks P. Transfers are held
back with the loopback transport's stall, so the times are the test's."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from kvbridge.control.lease import LeaseState
from tests.unit.test_connector_loopback import World, check_bytes


def slow_load(w: World, rid: str, n: int, land_after: float, abort_after: float = -1.0):
    """Load ``rid`` with every READ held back ``land_after`` s (P's abort at
    ``abort_after``, if ≥ 0); → (outcome, D's buffers before, D's tables)."""
    d = w.consumers[0].transport
    for r in range(w.p.par.world):
        d.stall(f"p{r}")  # type: ignore[attr-defined]
    before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
    handle, d_tabs = w.request(rid, n)
    w.consumers[0].load(handle, d_tabs)
    if abort_after >= 0:
        _until_begun(w, rid, abort_after)
        assert w.producer.abort(rid)
        assert w.producer.freed() == []  # D's rank began and has not reported
    timer = threading.Timer(max(land_after - max(abort_after, 0), 0), _resume, (w,))
    timer.start()
    try:
        (out,) = w.wait(timeout=land_after + 10)
    finally:
        timer.join()
    return out, before, d_tabs


@contextlib.contextmanager
def world(**kw: float) -> Iterator[World]:
    w = World(**kw)
    try:
        yield w
    finally:
        w.close()


def _until_begun(w: World, rid: str, at_least: float) -> None:
    """Wait ``at_least`` seconds and until P has D's ``begin`` for ``rid`` (≤ 5 s)."""
    end = time.monotonic() + 5.0
    time.sleep(at_least)
    while not w.producer.leases._held[rid].owners:
        assert time.monotonic() < end, "D's begin did not reach P within 5 s"
        time.sleep(0.01)


def _resume(w: World) -> None:
    for r in range(w.p.par.world):
        w.consumers[0].transport.resume(f"p{r}")  # type: ignore[attr-defined]


def test_a_fast_load_is_done_on_lease_time_and_p_frees_after_the_confirm():
    with world() as w:
        handle, d_tabs = w.request("fast", 45)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok and out.verified == "lease time", out
        assert [f.reason for f in w.producer.freed(wait_for=1)] == [LeaseState.DONE]


def test_p_aborting_while_d_reads_keeps_the_blocks_until_d_reports():
    with world(lease_s=30.0) as w:
        out, before, d_tabs = slow_load(w, "x", 45, land_after=0.6, abort_after=0.3)
        assert out.ok and out.verified == "lease time", out
        check_bytes(w, before, 45, 0, d_tabs)
        assert [f.reason for f in w.producer.freed(wait_for=1)] == [LeaseState.ABORTED]


def test_a_load_slower_than_half_the_lease_asks_p():
    with world(lease_s=2.0) as w:
        out, before, d_tabs = slow_load(w, "slow", 45, land_after=1.2)
        assert out.ok and out.verified == "at P", out
        check_bytes(w, before, 45, 0, d_tabs)


def test_a_lease_that_lapses_during_the_transfer_fails_the_load():
    with world(lease_s=0.6) as w:
        out, _, d_tabs = slow_load(w, "lapsed", 45, land_after=0.9)
        assert not out.ok and "LeaseExpired" in out.error and "at confirm" in out.error, out
        assert out.failed_blocks[0] == d_tabs[0]
        assert [f.reason for f in w.producer.freed()] == [LeaseState.EXPIRED]


def test_confirms_queued_behind_one_that_timed_out_fail_at_once(caplog):
    """Two loads done on lease time, then P stops answering: their confirms, queued on
    D's one reporting thread, fail within one side-channel timeout, not one each (P frees
    the blocks at lease expiry instead)."""
    w = World(timeout_s=1.0)
    table, hang = w.producer.leases, threading.Event()
    on_op = table.on_op

    def stops_at_confirm(op):  # P's side channel stalls on the first confirm
        if op.op == "confirm":
            hang.wait(10)
        return on_op(op)

    table.on_op = stops_at_confirm  # type: ignore[method-assign]
    d = w.consumers[0].transport
    try:
        for r in range(w.p.par.world):
            d.stall(f"p{r}")  # type: ignore[attr-defined]
        for rid in ("a", "b"):
            handle, d_tabs = w.request(rid, 45)
            w.consumers[0].load(handle, d_tabs)
        for rid in ("a", "b"):
            _until_begun(w, rid, 0.0)  # both begins answered before any confirm
        _resume(w)
        outs = w.wait(2)
        assert all(o.ok and o.verified == "lease time" for o in outs), outs
        end = time.monotonic() + 5
        while len(_failed_confirms(caplog)) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        first, second = _failed_confirms(caplog)
        assert "no reply within 1000 ms" in first.getMessage()
        assert "while this one waited" in second.getMessage()
        assert second.created - first.created < 0.5  # at once, not a second timeout
    finally:
        hang.set()
        w.close()


def _failed_confirms(caplog) -> list:
    return [r for r in caplog.records if r.getMessage().startswith("confirming")]
