"""How an instance reaches its ranks: in this process (TP 1) or one process per rank.

Both answer :meth:`call` with one reply per rank, in rank order, and raise
:class:`EngineError` when a rank fails. After a failure of a process rank the ranks are
closed: a half-answered collective cannot be resumed.
"""

from __future__ import annotations

import multiprocessing
import random
import socket
from dataclasses import replace
from pathlib import Path

import torch

from refengine.comm import Comm
from refengine.errors import EngineError
from refengine.messages import Boot, Command, Regions, Reply, Stop
from refengine.processes import PRELOAD, RankError, RankProcesses
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
        ctx.set_forkserver_preload(PRELOAD)
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
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range. A port taken
    from the ephemeral range and released can be handed to any other socket (a UCX or
    ZeroMQ connection of a process starting meanwhile: a vLLM engine, another instance)
    before its user binds it, and that user then fails to start."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    lo, hi = max(1024, low - 12000), low
    if hi - lo < 1000:  # an ephemeral range that starts low: take a port above it
        lo, hi = 60000, 65000
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise EngineError("no free port below the ephemeral range")
