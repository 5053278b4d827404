"""P and D instances as real processes (one per rank) talking over NIXL, for tests and
benchmarks, on the rank-process harness (``refengine/processes.py``). The parent holds the
P coordinator (:class:`Producer`); each rank process runs a
:class:`~tests.support.rank_worker.RankWorker` that answers the typed commands of
``rank_worker.py`` (``Fill``, ``Load``, ``Wait``, ``Verify``, …).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvbridge.connector.producer import Producer
from kvbridge.layout.side import SideConfig
from kvbridge.spec.model import ModelSpec
from refengine.netns import enter, in_netns
from refengine.processes import PRELOAD, RankProcesses, serve
from tests.support.rank_worker import Info


@dataclass(frozen=True)
class RankSpec:
    """What one test rank needs: its role (``"P"``/``"D"``), the model (block sizes as
    the side keeps them), the side's shape, its global rank and connector settings."""

    role: str
    spec: ModelSpec
    side: SideConfig
    rank: int
    secret: bytes
    lease_s: float = 30.0
    timeout_s: float = 10.0
    mode: str = "pull"
    host: str = "127.0.0.1"
    """Address the rank's side channel binds and advertises (P, push)."""


class Instance:
    """``side.world`` rank processes of one role; P also gets its coordinator here.

    ``call(cmd)`` sends a command to every rank and returns one reply per rank;
    ``procs.pids`` are the rank processes (for the fault tests' signals)."""

    def __init__(
        self,
        role: str,
        spec: ModelSpec,
        side: SideConfig,
        secret: bytes,
        lease_s: float = 30.0,
        timeout_s: float = 10.0,
        mode: str = "pull",
        host: str = "127.0.0.1",
    ):
        self.role, self.side, self.spec, self.par = role, side, spec, side.parallel
        self.host = host
        self.producer: Producer | None = None
        ranks = [
            (RankSpec(role, spec, side, r, secret, lease_s, timeout_s, mode, host),)
            for r in range(side.world)
        ]
        self.procs = RankProcesses(rank_context(), _rank_main, ranks, f"{role}-rank")
        try:
            if role == "P":
                self.producer = in_netns(
                    side.netns,
                    lambda: Producer(
                        f"P-{uuid.uuid4().hex[:6]}", spec, self.par, secret, lease_s, host=host
                    ),
                )
            for info in self.call(Info()):
                if self.producer is not None:
                    self.producer.add_rank(info)
        except BaseException:
            self.close()
            raise

    def call(self, cmd: Any, timeout: float = 60.0) -> list[Any]:
        return self.procs.call(cmd, timeout)

    def close(self) -> None:
        self.procs.close()
        if self.producer is not None:
            self.producer.close()


def rank_context() -> Any:
    """Rank processes forked from a server that imported torch, numpy and the connector
    once (as ``refengine.ranks`` does): a spawned rank spent ~1.8 s importing them. NIXL
    is not among them: UCX must load after a rank entered its network namespace."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, "tests.support.rank_worker"])
    return ctx


def _rank_main(conn: Connection, rs: RankSpec) -> None:
    if rs.side.netns:
        enter(rs.side.netns)  # before NIXL/UCX load: UCX reads the interfaces when it loads
    from tests.support.rank_worker import RankWorker

    try:
        worker = RankWorker(rs)
    except Exception as e:
        from refengine.processes import Failed

        conn.send(Failed(rs.rank, f"{type(e).__name__}: {e}"))
        return
    conn.send("ready")
    try:
        serve(conn, worker.handle, rs.rank)
    finally:
        worker.close()


def killed(pid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL ``pid`` and wait until it has exited (a zombie, or reaped): a READ posted
    right after the signal may otherwise still copy from its memory and succeed."""
    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "\nState:\tZ" in f.read():
                    return
        except FileNotFoundError:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} still running {timeout_s} s after SIGKILL")
