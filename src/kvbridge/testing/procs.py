"""P and D instances as real processes (one per rank) talking over NIXL, for tests
and benchmarks. The parent holds the P coordinator (:class:`Producer`); every rank
process runs :func:`_rank_main` and obeys commands sent over a pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvbridge.connector.producer import Producer
from kvbridge.errors import TransportError
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.testing.netns import enter, in_netns


@dataclass(frozen=True)
class RankSpec:
    side: str
    spec: ModelSpec
    par: Parallel
    rank: int
    layout: str
    num_blocks: int
    secret: bytes
    lease_s: float = 30.0
    timeout_s: float = 10.0
    mode: str = "pull"
    netns: str = ""
    """Network namespace the rank runs in ("" : this one), a simulated host."""
    host: str = "127.0.0.1"
    """Address the rank's side channel binds and advertises (P, push)."""


class RankProc:
    """One rank process; :meth:`call` sends a command and waits for its answer."""

    def __init__(self, ctx: Any, rs: RankSpec):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_main, args=(child, rs), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *cmd: Any, timeout: float = 60.0) -> Any:
        self.conn.send(cmd)
        return self.answer(cmd[0], timeout)

    def answer(self, what: str, timeout: float) -> Any:
        end = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() > end:
                raise TransportError(
                    f"rank process {self.proc.pid} gave no answer to {what!r} "
                    f"(exit code {self.proc.exitcode})"
                )
        kind, value = self.conn.recv()
        if kind == "error":
            raise TransportError(f"rank process failed: {value}")
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Instance:
    """``par.world`` rank processes of one side; P also gets its coordinator here."""

    def __init__(
        self,
        side: str,
        spec: ModelSpec,
        par: Parallel,
        layout: str,
        num_blocks: int,
        secret: bytes,
        lease_s: float = 30.0,
        timeout_s: float = 10.0,
        mode: str = "pull",
        netns: str = "",
        host: str = "127.0.0.1",
    ):
        """``netns``/``host``: the namespace (simulated host) every rank and, for P, the
        coordinator's side channel live in, and the address they bind."""
        ctx = mp.get_context("spawn")
        self.netns, self.host = netns, host
        self.side, self.spec, self.par = side, spec, par
        self.producer: Producer | None = None
        self.ranks: list[RankProc] = []
        try:
            self._start(ctx, layout, num_blocks, secret, lease_s, timeout_s, mode)
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        ctx: Any,
        layout: str,
        num_blocks: int,
        secret: bytes,
        lease_s: float,
        timeout_s: float,
        mode: str,
    ) -> None:
        spec, par, side = self.spec, self.par, self.side
        self.ranks = [
            RankProc(
                ctx,
                RankSpec(
                    side, spec, par, r, layout, num_blocks, secret, lease_s, timeout_s, mode,
                    self.netns, self.host,
                ),
            )
            for r in range(par.world)
        ]  # fmt: skip
        if side == "P":
            self.producer = in_netns(
                self.netns,
                lambda: Producer(
                    f"P-{uuid.uuid4().hex[:6]}", spec, par, secret, lease_s, host=self.host
                ),
            )
            for rp in self.ranks:
                self.producer.add_rank(rp.call("info"))
        else:
            for rp in self.ranks:
                rp.call("info")

    def broadcast(self, *cmd: Any, timeout: float = 60.0) -> list[Any]:
        for rp in self.ranks:
            rp.conn.send(cmd)
        return [rp.answer(cmd[0], timeout) for rp in self.ranks]

    def close(self) -> None:
        for rp in self.ranks:
            rp.stop()
        if self.producer is not None:
            self.producer.close()


def _rank_main(conn: Connection, rs: RankSpec) -> None:
    if rs.netns:
        enter(rs.netns)  # before NIXL/UCX load: UCX reads the interfaces when it loads
    from kvbridge.testing.rank_worker import RankWorker

    worker = RankWorker(rs)
    parent = os.getppid()
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    return  # the parent died: leave
                continue
            cmd = conn.recv()
            if cmd[0] == "exit":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", worker.handle(cmd)))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        worker.close()
        time.sleep(0)
