"""The rank-process harness: replies in rank order, and a rank that raises, exits or stays
silent gives a RankError naming it within the deadline, never a hang."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

import pytest

from refengine.processes import STOP_TIMEOUT_S, Failed, RankError, RankProcesses, serve
from tests.support.procs import rank_context


def _echo(conn: Connection, rank: int, boot_fails: bool = False) -> None:
    if boot_fails:
        conn.send(Failed(rank, "no memory for the cache"))
        return
    conn.send(("ready", rank))

    def handle(cmd: tuple[str, float]) -> object:
        what, arg = cmd
        if what == "raise":
            raise ValueError(f"bad value {arg}")
        if what == "sleep":
            time.sleep(arg)
        if what == "exit" and rank == 1:
            os._exit(3)
        return (rank, what)

    serve(conn, handle, rank)


CTX = rank_context()


def test_replies_come_one_per_rank_in_order() -> None:
    procs = RankProcesses(CTX, _echo, [(0,), (1,), (2,)])
    try:
        assert procs.boot == [("ready", 0), ("ready", 1), ("ready", 2)]
        assert procs.call(("hello", 0.0), 10) == [(0, "hello"), (1, "hello"), (2, "hello")]
        assert procs.call(("one", 0.0), 10, ranks=[2]) == [(2, "one")]
        with pytest.raises(RankError, match=r"rank 0 failed tuple: ValueError: bad value 7"):
            procs.call(("raise", 7), 10)
        assert procs.call(("still", 0.0), 10)[0] == (0, "still")  # a raising command is not fatal
    finally:
        procs.close()
    assert all(not p.is_alive() for p in procs.procs) and procs.pids == ()


def test_a_silent_rank_times_out_and_a_dead_rank_is_named() -> None:
    procs = RankProcesses(CTX, _echo, [(0,), (1,)])
    try:
        t0 = time.monotonic()
        with pytest.raises(RankError, match="rank 0 failed tuple: no answer within 1 s"):
            procs.call(("sleep", 30.0), 1.0)
        assert time.monotonic() - t0 < 3
        # both ranks are busy for 30 s: closing waits one stop timeout for all, not one each
        held, t0 = list(procs.procs), time.monotonic()
        procs.close()
        assert time.monotonic() - t0 < 2 * STOP_TIMEOUT_S - 1
        assert all(not p.is_alive() for p in held) and procs.pids == ()
    finally:
        procs.close()
    procs = RankProcesses(CTX, _echo, [(0,), (1,)])
    try:
        with pytest.raises(RankError, match=r"rank 1 failed tuple: process exited \(code 3\)"):
            procs.call(("exit", 0.0), 10)
    finally:
        procs.close()


def test_a_rank_failing_at_boot_stops_all() -> None:
    with pytest.raises(RankError, match="rank 1 failed boot: no memory for the cache"):
        RankProcesses(CTX, _echo, [(0,), (1, True)])


def test_a_busy_rank_answers_while_polling_and_after(monkeypatch) -> None:
    """``serve(busy_s=...)``: commands within the busy window are answered without a
    blocking poll; after it the rank blocks (``poll(POLL_S)``) and still answers."""
    import threading
    from multiprocessing import Pipe

    from refengine import processes

    monkeypatch.setattr(processes, "POLL_S", 0.05)
    here, there = Pipe()
    blocking: list[float | None] = []
    real_poll = type(there).poll

    def poll(self, timeout: float | None = 0.0) -> bool:
        if timeout:
            blocking.append(timeout)
        return real_poll(self, timeout)

    monkeypatch.setattr(type(there), "poll", poll)
    t = threading.Thread(target=serve, args=(there, lambda x: x * 2, 0, 2.0), daemon=True)
    t.start()
    here.send(1)
    assert here.recv() == 2
    time.sleep(0.1)  # well inside the busy window: no blocking poll
    here.send(2)
    assert here.recv() == 4
    assert not blocking
    time.sleep(2.2)  # past it: the rank blocks between polls
    here.send(3)
    assert here.recv() == 6
    assert blocking and set(blocking) == {0.05}
    here.send(processes.Stop())
    t.join(5)
    assert not t.is_alive()
