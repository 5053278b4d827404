"""Processes forked from one process that imported a heavy module once.

The forkserver of :mod:`refengine.processes` is one per session, and its preload list is
set by whoever starts it first; processes that need vLLM (~6 s to import here) would each
import it again whenever another test started the server first. A :class:`Zygote` is
spawned once, imports ``module`` and forks every process from itself (it runs nothing
else, as a forkserver): ``start("target", *args)`` runs ``module.target(conn, *args)``
in a new process and returns the parent's end of its pipe; :func:`booted` waits for
processes' first reply. Each process answers with
:func:`refengine.processes.serve`; :func:`call` sends one command to several and reads
every reply within one deadline.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from refengine.processes import STOP_TIMEOUT_S, Failed, RankError, Stop


class Zygote:
    def __init__(self, module: str, boot_timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        # not daemonic: a daemonic process may not have children; it leaves when this
        # end of its pipe closes (this process gone)
        self.proc = ctx.Process(target=_zygote, args=(theirs, module), name="zygote")
        self.proc.start()
        theirs.close()
        self.children: list[Connection] = []
        """The parent's ends of the pipes of the processes started (stopped on close)."""
        try:
            reply = _answer(self.conn, -1, "boot", time.monotonic() + boot_timeout_s)
        except BaseException:
            self.close()  # a failed boot leaves no zygote behind
            raise
        assert reply == "ready", reply

    def start(self, target: str, *args: Any) -> Connection:
        """A new process running ``module.target(conn, *args)``; the parent's end of its
        pipe (its first reply: ``"ready"``, see :func:`booted`)."""
        # the pipe is made here and the child's end sent: a descriptor in flight (held
        # by multiprocessing's resource sharer until fetched) is then this process's, and
        # no sibling the zygote forks later can inherit the parent's end
        conn, theirs = mp.Pipe()
        try:
            self.conn.send((target, args, theirs))
            reply = _answer(self.conn, -1, f"start {target}", time.monotonic() + 30.0)
            assert reply == "started", reply
        except BaseException:
            conn.close()
            raise
        finally:
            theirs.close()
        self.children = [c for c in self.children if not c.closed] + [conn]
        return conn

    def close(self) -> None:
        """Stop the processes still running first (the zygote waits for its children
        before it leaves), then the zygote."""
        stop([c for c in self.children if not c.closed])
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.proc.join(STOP_TIMEOUT_S * 2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(STOP_TIMEOUT_S)
        self.conn.close()


def booted(conns: Sequence[Connection], timeout_s: float = 120.0) -> None:
    """Wait until every process of ``conns`` said it is ready (all boot at once)."""
    end = time.monotonic() + timeout_s
    for i, conn in enumerate(conns):
        reply = _answer(conn, i, "boot", end)
        if reply != "ready":
            raise RankError(i, "boot", f"answered {reply!r}")


def call(conns: Sequence[Connection], cmd: Any, timeout_s: float) -> list[Any]:
    """``cmd`` to every process of ``conns``; their replies, or the first one's
    :class:`RankError` (index in ``conns``) once every process answered or failed."""
    for conn in conns:
        conn.send(cmd)
    end = time.monotonic() + timeout_s
    replies, errors = [], []
    for i, conn in enumerate(conns):
        try:
            replies.append(_answer(conn, i, type(cmd).__name__, end))
        except RankError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    return replies


def stop(conns: Sequence[Connection]) -> None:
    """Ask each process to leave (the zygote reaps it) and close the pipes."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(Stop())
        conn.close()


def _answer(conn: Connection, index: int, what: str, end: float) -> Any:
    try:
        if not conn.poll(max(0.0, end - time.monotonic())):
            raise RankError(index, what, "no answer in time")
        reply = conn.recv()
    except (EOFError, OSError):
        raise RankError(index, what, "process exited") from None
    if isinstance(reply, Failed):
        raise RankError(index, what, reply.error)
    return reply


def _zygote(conn: Connection, module: str) -> None:
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        conn.send(Failed(-1, f"{type(e).__name__}: {e}"))
        return
    fork = mp.get_context("fork")
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        target, args, theirs = msg  # the child's end, fetched from the parent
        proc = fork.Process(target=_child, args=(getattr(mod, target), theirs, args, (conn,)))
        proc.daemon = True
        proc.start()
        theirs.close()  # before the reply: no later child inherits it
        conn.send("started")
        mp.active_children()  # reaps those that left
    end = time.monotonic() + STOP_TIMEOUT_S  # one deadline for all, then they are ended
    for proc in mp.active_children():
        proc.join(max(end - time.monotonic(), 0.0))
    for proc in mp.active_children():
        proc.kill()
        proc.join(STOP_TIMEOUT_S)


def _child(target: Any, conn: Connection, args: tuple, inherited: tuple) -> None:
    """``target(conn, *args)`` in a forked child, once it closed the zygote's channel it
    inherited: a parent closing its end of ``conn`` is an end of file here (no other
    process holds that end: the parent made the pipe), and the zygote's death one there."""
    for end in inherited:
        end.close()
    target(conn, *args)
