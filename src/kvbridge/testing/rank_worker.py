"""What a rank process of :mod:`kvbridge.testing.procs` does with each command."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvbridge.connector.consumer import Consumer, Mode, Outcome
from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.producer import ProducerWorker
from kvbridge.layout.build import build_layout
from kvbridge.testing.reference import expected_dest, fill_source
from kvbridge.transport.nixl import NixlTransport


class RankWorker:
    def __init__(self, rs: Any) -> None:
        self.rs = rs
        self.layout = build_layout(rs.spec, rs.par, rs.rank, rs.layout, rs.num_blocks)
        rng = np.random.default_rng(rs.rank + (100 if rs.side == "D" else 0))
        self.bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in self.layout.regions]
        self.bases = [int(b.ctypes.data) for b in self.bufs]
        self.transport = NixlTransport(f"{rs.side}{rs.rank}-{time.monotonic_ns()}")
        self.consumer: Consumer | None = None
        self.producer: ProducerWorker | None = None
        self.snapshots: dict[str, list[np.ndarray]] = {}
        self.outcomes: dict[str, Outcome] = {}

    def handle(self, cmd: tuple[Any, ...]) -> Any:
        return getattr(self, f"cmd_{cmd[0]}")(*cmd[1:])

    def cmd_info(self) -> Any:
        rs = self.rs
        if rs.side == "P":
            self.producer = ProducerWorker(
                rs.rank, self.layout, self.bases, self.transport, rs.secret, rs.host
            )
            return self.producer.info
        self.consumer = Consumer(
            "D",
            rs.spec,
            rs.par,
            rs.rank,
            self.layout,
            self.bases,
            self.transport,
            rs.secret,
            transfer_timeout_s=rs.timeout_s,
            mode=Mode(rs.mode),
        )
        return None

    def cmd_fill(self, n: int, tables: list[list[int]]) -> None:
        rs = self.rs
        fill_source(rs.spec, rs.par, rs.rank, self.layout, self.bufs, n, tables)

    def cmd_scribble(self) -> None:
        for b in self.bufs:
            b[:] = 0xAB

    def cmd_changed(self) -> int:
        """Bytes that differ from :meth:`cmd_scribble`'s pattern (a late write)."""
        return sum(int((b != 0xAB).sum()) for b in self.bufs)

    def cmd_load(self, handle: bytes, tables: list[list[int]], cached: int, snap: bool) -> None:
        assert self.consumer is not None
        h = TransferHandle.from_bytes(handle)
        if snap:
            self.snapshots[h.request_id] = [b.copy() for b in self.bufs]
        self.consumer.load(h, tables, cached)

    def cmd_wait(self, ids: list[str], timeout: float) -> dict[str, Outcome]:
        assert self.consumer is not None
        end = time.monotonic() + timeout
        while any(i not in self.outcomes for i in ids) and time.monotonic() < end:
            for o in self.consumer.poll():
                self.outcomes[o.request_id] = o
            time.sleep(0.002)
        return {i: self.outcomes.pop(i) for i in ids if i in self.outcomes}

    def cmd_verify(
        self, rid: str, n: int, cached: int, tables: list[list[int]], scribbled: bool = False
    ) -> int:
        """Bytes that differ from the reference (whole memory if a snapshot was taken, or
        if ``scribbled``: memory was all :meth:`cmd_scribble`'s pattern before the load)."""
        rs = self.rs
        before = self.snapshots.pop(rid, None)
        if scribbled:
            before = [np.full_like(b, 0xAB) for b in self.bufs]
        base = before if before is not None else self.bufs
        want = expected_dest(rs.spec, rs.par, rs.rank, self.layout, base, n, cached, tables)
        return sum(int((g != w).sum()) for g, w in zip(self.bufs, want, strict=True))

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.close()
        self.transport.close()
