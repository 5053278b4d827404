"""The zygote of the vLLM PP tests (:mod:`tests.support.zygote`) leaves nothing behind:
closing it stops the processes it started that are still running, without waiting them
out, and a process whose pipe the parent closed leaves (an end of file reaches it)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from refengine.processes import STOP_TIMEOUT_S, serve
from tests.support.zygote import Zygote, booted, call


def pid_server(conn: Connection) -> None:
    """A zygote's process: answers every command with its process id."""
    conn.send("ready")
    serve(conn, lambda cmd: os.getpid(), 0)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, left for its parent to reap, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def gone(pids: list[int], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while any(running(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return not any(running(p) for p in pids)


def test_the_zygote_leaves_no_process_behind() -> None:
    """A process whose pipe the parent closed, no Stop sent, leaves; closing the zygote
    with two processes nobody stopped stops them first, instead of waiting for them to
    leave (they never would) until the zygote is killed. One zygote (it imports
    kvbridge: seconds)."""
    zygote = Zygote(__name__)
    try:
        conns = [zygote.start("pid_server") for _ in range(3)]
        booted(conns)
        pids = call(conns, "pid", 10.0)
        conns[0].close()
        assert gone(pids[:1], 15.0), pids  # a loaded machine: generous
        t0 = time.monotonic()
        zygote.close()
        assert time.monotonic() - t0 < STOP_TIMEOUT_S and not zygote.proc.is_alive()
        assert gone(pids, 5.0), pids
    finally:
        zygote.close()


def test_a_failed_boot_raises_its_error_and_leaves_no_zygote() -> None:
    before = set(mp.active_children())
    with pytest.raises(Exception) as got:
        Zygote("tests.support.no_such_module_here")
    assert not isinstance(got.value, AttributeError), got.value
    assert not set(mp.active_children()) - before
