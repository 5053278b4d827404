"""P's half of push (``docs/faults.md``): which pushes a rank has written
(:class:`PushLedger`: the first push of (D engine, request, token, D epoch) binds D's
nonce, each part is written once, the ``last`` part or a fence retires the nonce), and
the gather of a staged push's source runs into a registered slot, written to D as a few
long spans (:class:`PushGather`; no free slot, or runs that do not fit one: direct).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvbridge.connector.movers.memory import LocalMemory
from kvbridge.connector.movers.spans import Chunk, chunks
from kvbridge.connector.movers.staging import StagingPool
from kvbridge.control.messages import PushRuns
from kvbridge.plan.runs import Runs
from kvbridge.transport.base import Region, Transport, XferHandle

KEPT = 65536
"""Loads and retired nonces remembered (oldest forgotten first)."""

Key = tuple[str, str, str, str]
"""(D engine id, request id, lease token, D epoch)."""


@dataclass(slots=True)
class _Bound:
    nonce: str
    parts: set[int] = field(default_factory=set)


class PushLedger:
    """Not thread-safe: the rank's side channel serves one message at a time."""

    def __init__(self) -> None:
        self._loads: OrderedDict[Key, _Bound] = OrderedDict()
        self._nonces: OrderedDict[tuple[str, str], Key] = OrderedDict()
        self._retired: OrderedDict[tuple[str, str], None] = OrderedDict()
        """Both by (D engine id, nonce)."""
        self.refused: Counter[str] = Counter()
        """Pushes refused, by reason (``PushRefused.reason``, and ``fenced``)."""

    def admit(self, msg: PushRuns) -> str:
        """Record ``msg`` as written → ""; or the reason it must not be (counted)."""
        key = (msg.d_engine, msg.request_id, msg.token, msg.d_epoch)
        why = self._why(msg, key)
        if why:
            self.refused[why] += 1
            return why
        bound = self._loads.get(key)
        if bound is None:
            bound = self._loads[key] = _Bound(msg.nonce)
            self._nonces[msg.d_engine, msg.nonce] = key
            _trim(self._loads)
            _trim(self._nonces)
        bound.parts.add(msg.part)
        if msg.last:
            self.retire(msg.d_engine, msg.nonce)
        return ""

    def retire(self, d_engine: str, nonce: str) -> None:
        self._retired[d_engine, nonce] = None
        _trim(self._retired)

    def fence(self, request_id: str, d_engine: str) -> None:
        """D ``d_engine`` fenced ``request_id`` after a failure: retire the nonces bound
        to its loads of it."""
        for key, bound in list(self._loads.items()):
            if key[:2] == (d_engine, request_id):
                self.retire(d_engine, bound.nonce)

    def _why(self, msg: PushRuns, key: Key) -> str:
        if not msg.nonce:
            return "no nonce"
        if (msg.d_engine, msg.nonce) in self._retired:
            return "retired nonce"
        bound, owner = self._loads.get(key), self._nonces.get((msg.d_engine, msg.nonce), key)
        if owner != key or (bound and bound.nonce != msg.nonce):
            return "unknown nonce"
        if bound is not None and msg.part in bound.parts:
            return "replayed"
        return ""


def _trim(d: OrderedDict) -> None:
    while len(d) > KEPT:
        d.popitem(last=False)


MIN_RUNS = 16
"""Fewer runs than this are written direct (nothing to gain)."""


def spans(dst: np.ndarray, src: np.ndarray, length: np.ndarray, slot_bytes: int) -> Chunk | None:
    """Runs whose destinations join into few contiguous spans (at most one per 4 runs),
    none overlapping, whose bytes fit a slot, as one round of :func:`.spans.chunks` keyed
    by destination: its spans are D's, its runs P's sources. None: write direct."""
    n = dst.shape[0]
    if n < MIN_RUNS or int(length.sum()) > slot_bytes:
        return None
    (chunk,) = chunks(Runs(dst, src, length), slot_bytes)
    if chunk.staged_bytes != int(length.sum()) or chunk.span_len.shape[0] * 4 > n:
        return None  # overlapping destinations, or too many spans to gain
    return chunk


class PushGather:
    """A P rank's staging slots for staged pushes and the copy into them.
    ``regions``: the rank's KV regions (the only memory a gather may read)."""

    def __init__(self, regions: list[Region], slots: int, slot_bytes: int):
        self.pool = StagingPool(slots, slot_bytes, regions[0].kind, regions[0].device)
        self.memory = LocalMemory(regions)
        self.gathered = 0
        """Staged pushes written from a slot."""
        self.direct = 0
        """Staged pushes written direct (no free slot, or runs that do not fit one)."""

    def write(
        self,
        transport: Transport,
        peer: str,
        src: np.ndarray,
        dst: np.ndarray,
        n: np.ndarray,
        notif: bytes,
    ) -> tuple[XferHandle, int | None, int]:
        """Gather and WRITE ``src`` → ``dst`` with ``notif`` → ``(handle, slot the WRITE
        reads from or None, descriptors posted)``; :meth:`release` the slot once it ended."""
        s, d, ln = (a.view(np.int64) for a in (src, dst, n))
        layout = spans(d, s, ln, self.pool.slot_bytes)
        slot = self.pool.take(0.0) if layout is not None else None
        if layout is None or slot is None:
            self.direct += 1
            return transport.write(peer, src, dst, n, notif), None, int(n.shape[0])
        try:
            c = layout
            self.memory.gather(c.run_dst, self.pool.view(slot), c.run_stage, c.run_len)
            stage = c.span_stage + np.int64(self.pool.region.addr + slot * self.pool.slot_bytes)
            local, remote, nbytes = (a.view(np.uint64) for a in (stage, c.span_src, c.span_len))
            handle = transport.write(peer, local, remote, nbytes, notif)
        except BaseException:
            self.pool.give_back(slot, True)  # nothing posted reads from it
            raise
        self.gathered += 1
        return handle, slot, int(layout.span_len.shape[0])

    def release(self, slot: int) -> None:
        """The WRITE reading from ``slot`` ended: the slot may be reused."""
        self.pool.give_back(slot, True)
