"""How an instance reaches its ranks: in this process (TP 1) or one process per rank.

Both answer :meth:`call` with one reply per rank, in rank order, and raise
:class:`EngineError` when a rank fails. After a failure of a process rank the ranks are
closed: a half-answered collective cannot be resumed.
"""

from __future__ import annotations

import multiprocessing
import socket
from dataclasses import replace

import torch

from refengine.comm import Comm
from refengine.errors import EngineError
from refengine.messages import Boot, Command, Regions, Reply, Stop
from refengine.processes import RankError, RankProcesses
from refengine.worker import RankEngine, worker_main

BOOT_TIMEOUT_S = 120.0


class LocalRanks:
    """TP 1 in the caller's process: its cache is this process's memory."""

    in_process = True
    pids: tuple[int, ...] = ()

    def __init__(self, boot: Boot) -> None:
        if boot.side.world != 1:
            raise EngineError(f"in-process ranks need TP 1 and PP 1, got {boot.side}")
        self.engine = RankEngine(boot, Comm())
        self.regions = [self.engine.regions()]

    def call(self, cmd: Command) -> list[Reply]:
        if isinstance(cmd, Stop):
            return []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matmuls: more threads only wait for each other
        try:
            return [self.engine.handle(cmd)]
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        self.engine.close()


class ProcessRanks:
    """``boot.side.world`` worker processes in one gloo group on 127.0.0.1, on the
    rank-process harness (``refengine/processes.py``).

    Workers come from a forkserver that imported torch once: as safe as ``spawn``
    (the caller is never forked) and ~20× faster to start on a small machine. After a
    rank fails the instance is closed: a half-answered collective cannot be resumed.
    """

    in_process = False

    def __init__(self, boot: Boot, timeout_s: float) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "refengine.worker"])
        port = free_port()
        self.timeout_s = timeout_s
        boots = [(replace(boot, rank=r, port=port),) for r in range(boot.side.world)]
        try:
            self.procs = RankProcesses(ctx, worker_main, boots, boot_timeout_s=BOOT_TIMEOUT_S)
        except RankError as e:
            raise EngineError(str(e)) from None
        self.regions = [r for r in self.procs.boot if isinstance(r, Regions)]

    @property
    def pids(self) -> tuple[int, ...]:
        return self.procs.pids

    def call(self, cmd: Command) -> list[Reply]:
        if not self.procs.conns:
            raise EngineError("the ranks are closed (after close() or a failed rank)")
        try:
            return self.procs.call(cmd, self.timeout_s)
        except RankError as e:
            self.close()
            raise EngineError(str(e)) from None

    def close(self) -> None:
        self.procs.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
