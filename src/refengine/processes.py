"""One harness for rank processes: the reference engine's ranks (``ranks.py``) and
the test ranks of :mod:`tests.support.procs` both run on it.

The parent starts one process per rank, ``target(conn, *args)``; a rank's first message
is its boot reply, then it answers typed commands with :func:`serve` until :class:`Stop`,
a closed pipe, or its parent's death. A command that raises is answered with
:class:`Failed`. Every wait of the parent is bounded; a rank that fails, exits or stays
silent past its deadline raises :class:`RankError` naming the rank and the command.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from kvbridge.api import KVBridgeError

POLL_S = 0.5
STOP_TIMEOUT_S = 5.0
PRELOAD = ["torch", "refengine.worker"]
"""What the forkserver of rank processes imports once (one server per process: whoever
starts it first sets the list; callers add their own modules to this one). Variables
read at those imports (libgomp's ``OMP_*``) come from the server's environment."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave :func:`serve` (no reply)."""


@dataclass(frozen=True, slots=True)
class Failed:
    rank: int
    error: str


class RankError(KVBridgeError):
    def __init__(self, rank: int, what: str, error: str) -> None:
        super().__init__(f"rank {rank} failed {what}: {error}")
        self.rank, self.what, self.error = rank, what, error


def serve(conn: Connection, handle: Callable[[Any], Any], rank: int, busy_s: float = 0.0) -> None:
    """Answer commands from ``conn`` with ``handle(cmd)`` (or :class:`Failed`).

    ``busy_s`` > 0: after each command the rank polls without sleeping (yielding the CPU
    between polls) for that long before it blocks, as vLLM's workers wait for their next
    step (vLLM 0.32, ``shm_broadcast.SpinCondition``: ``busy_loop_s`` = 1 s): a core that
    blocks goes idle, and the next command's host work then runs 2–4× slower
    (docs/performance.md, "Host time in a rank")."""
    parent = multiprocessing.parent_process()
    last = time.monotonic()
    while parent is None or parent.is_alive():
        if busy_s > 0 and time.monotonic() - last < busy_s:
            if not conn.poll(0):
                os.sched_yield()
                continue
        elif not conn.poll(POLL_S):
            continue
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(cmd, Stop):
            return
        try:
            reply = handle(cmd)
        except Exception as e:
            reply = Failed(rank, f"{type(e).__name__}: {e}")
        conn.send(reply)
        last = time.monotonic()


class RankProcesses:
    """``len(args)`` processes, rank ``r`` running ``target(conn, *args[r])``.

    ``boot``: each rank's first reply (waited for up to ``boot_timeout_s``); ``call``
    sends one command to every rank (or to ``ranks``) and returns one reply per rank, or
    raises the first rank's :class:`RankError` once every rank answered or failed."""

    def __init__(
        self,
        ctx: Any,
        target: Callable[..., None],
        args: Sequence[tuple[Any, ...]],
        name: str = "kvbridge-rank",
        boot_timeout_s: float = 120.0,
    ) -> None:
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        try:
            for rank, a in enumerate(args):
                mine, theirs = ctx.Pipe()
                env = dict(os.environ)  # a forkserver's child has the server's otherwise
                run = (env, target, theirs, *a)
                proc = ctx.Process(target=_in_env, args=run, name=f"{name}{rank}")
                proc.daemon = True
                proc.start()
                theirs.close()
                self.conns.append(mine)
                self.procs.append(proc)
            end = time.monotonic() + boot_timeout_s
            self.boot = [self.answer(r, "boot", boot_timeout_s, end) for r in range(len(args))]
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid or 0 for p in self.procs)

    def call(self, cmd: Any, timeout_s: float, ranks: Sequence[int] | None = None) -> list[Any]:
        chosen = range(len(self.conns)) if ranks is None else ranks
        if not self.conns:
            raise KVBridgeError("the rank processes are closed")
        for r in chosen:
            self.conns[r].send(cmd)
        end = time.monotonic() + timeout_s  # one deadline for all ranks
        replies, errors = [], []
        for r in chosen:  # every rank's reply is read, so the pipes stay in step
            try:
                replies.append(self.answer(r, type(cmd).__name__, timeout_s, end))
            except RankError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return replies

    def answer(self, rank: int, what: str, timeout_s: float, end: float | None = None) -> Any:
        """Rank ``rank``'s next reply by ``end`` (default: ``timeout_s`` from now);
        :class:`RankError` if it fails, exits or stays silent."""
        conn, proc = self.conns[rank], self.procs[rank]
        end = time.monotonic() + timeout_s if end is None else end
        try:
            while not conn.poll(min(0.1, max(0.0, end - time.monotonic()))):
                if not proc.is_alive() and not conn.poll(0):
                    raise RankError(rank, what, _exited(proc))
                if time.monotonic() >= end:
                    raise RankError(rank, what, f"no answer within {timeout_s:.0f} s")
            reply = conn.recv()
        except (EOFError, OSError):
            raise RankError(rank, what, _exited(proc)) from None
        if isinstance(reply, Failed):
            raise RankError(rank, what, reply.error)
        return reply

    def close(self) -> None:
        """Stop every rank: :class:`Stop`, then terminate, then kill."""
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(Stop())
        _join_all(self.procs)
        for step in (BaseProcess.terminate, BaseProcess.kill):
            alive = [p for p in self.procs if p.is_alive()]
            for proc in alive:
                step(proc)
            _join_all(alive)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def _in_env(env: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """``target(*args)`` in the caller's environment as it was when the rank started."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def _join_all(procs: Sequence[BaseProcess]) -> None:
    """Wait for ``procs`` to exit, one stop timeout for all (not one each: hung ranks)."""
    end = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))


def _exited(proc: BaseProcess) -> str:
    proc.join(1.0)  # reap it, so the exit code is known
    return f"process exited (code {proc.exitcode})"
