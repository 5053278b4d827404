"""What a rank process of :mod:`tests.support.procs` does with each typed command."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.connector.consumer import Consumer, Mode, Outcome
from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.producer import ProducerWorker
from kvbridge.control.messages import RankInfo
from kvbridge.transport import make_transport
from tests.support.reference import expected_dest, fill_source


@dataclass(frozen=True, slots=True)
class Info:
    """Start the rank's connector endpoint; P replies its :class:`RankInfo`, D None."""


@dataclass(frozen=True, slots=True)
class Fill:
    """P: write the reference pattern for ``n`` tokens into ``tables``."""

    n: int
    tables: list[list[int]]


@dataclass(frozen=True, slots=True)
class Scribble:
    """Overwrite all memory with 0xAB (an engine reusing its blocks)."""


@dataclass(frozen=True, slots=True)
class Changed:
    """Reply: bytes that differ from :class:`Scribble`'s pattern (a late write)."""


@dataclass(frozen=True, slots=True)
class Load:
    """D: load ``handle`` into ``tables``; ``snap``: keep a copy of memory first."""

    handle: bytes
    tables: list[list[int]]
    cached: int = 0
    snap: bool = True


@dataclass(frozen=True, slots=True)
class Wait:
    """D: reply ``{request id: Outcome}`` for those of ``ids`` done within ``timeout``."""

    ids: list[str]
    timeout: float


@dataclass(frozen=True, slots=True)
class Verify:
    """D: reply the count of bytes differing from the reference (whole memory if a
    snapshot was taken, or if ``scribbled``: memory was all 0xAB before the load)."""

    rid: str
    n: int
    cached: int
    tables: list[list[int]]
    scribbled: bool = False


class RankWorker:
    def __init__(self, rs: Any) -> None:
        self.rs = rs
        self.layout = rs.side.rank_layout(rs.spec, rs.rank)
        rng = np.random.default_rng(rs.rank + (100 if rs.role == "D" else 0))
        self.bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in self.layout.regions]
        self.bases = [int(b.ctypes.data) for b in self.bufs]
        self.transport = make_transport("nixl", f"{rs.role}{rs.rank}-{time.monotonic_ns()}")
        self.consumer: Consumer | None = None
        self.producer: ProducerWorker | None = None
        self.snapshots: dict[str, list[np.ndarray]] = {}
        self.outcomes: dict[str, Outcome] = {}
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Info: self.info,
            Fill: self.fill,
            Scribble: self.scribble,
            Changed: self.changed,
            Load: self.load,
            Wait: self.wait,
            Verify: self.verify,
        }

    def handle(self, cmd: Any) -> Any:
        return self._handlers[type(cmd)](cmd)

    def info(self, _: Info) -> RankInfo | None:
        rs = self.rs
        if rs.role == "P":
            self.producer = ProducerWorker(
                rs.rank, self.layout, self.bases, self.transport, rs.secret, rs.host
            )
            return self.producer.info
        self.consumer = Consumer(
            "D",
            rs.spec,
            rs.side.parallel,
            rs.rank,
            self.layout,
            self.bases,
            self.transport,
            rs.secret,
            transfer_timeout_s=rs.timeout_s,
            mode=Mode(rs.mode),
        )
        return None

    def fill(self, cmd: Fill) -> None:
        rs = self.rs
        fill_source(rs.spec, rs.side.parallel, rs.rank, self.layout, self.bufs, cmd.n, cmd.tables)

    def scribble(self, _: Scribble) -> None:
        for b in self.bufs:
            b[:] = 0xAB

    def changed(self, _: Changed) -> int:
        return sum(int((b != 0xAB).sum()) for b in self.bufs)

    def load(self, cmd: Load) -> None:
        assert self.consumer is not None
        h = TransferHandle.from_bytes(cmd.handle)
        if cmd.snap:
            self.snapshots[h.request_id] = [b.copy() for b in self.bufs]
        self.consumer.load(h, cmd.tables, cmd.cached)

    def wait(self, cmd: Wait) -> dict[str, Outcome]:
        assert self.consumer is not None
        end = time.monotonic() + cmd.timeout
        while any(i not in self.outcomes for i in cmd.ids) and time.monotonic() < end:
            for o in self.consumer.poll():
                self.outcomes[o.request_id] = o
            time.sleep(0.002)
        return {i: self.outcomes.pop(i) for i in cmd.ids if i in self.outcomes}

    def verify(self, cmd: Verify) -> int:
        rs = self.rs
        before = self.snapshots.pop(cmd.rid, None)
        if cmd.scribbled:
            before = [np.full_like(b, 0xAB) for b in self.bufs]
        base = before if before is not None else self.bufs
        par, n, cached = rs.side.parallel, cmd.n, cmd.cached
        want = expected_dest(rs.spec, par, rs.rank, self.layout, base, n, cached, cmd.tables)
        return sum(int((g != w).sum()) for g, w in zip(self.bufs, want, strict=True))

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.close()
        self.transport.close()
