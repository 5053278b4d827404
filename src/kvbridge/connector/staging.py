"""Staged pulls: many small runs read as a few long source spans into a registered
staging area on D, then scattered to their destinations by a local copy.

A block-size change on a layout that keeps K transposed (vLLM's CPU cache) cuts every
element row of K into its own run: a 768-token request of a tiny Llama is ~12,000 runs
of 128 bytes, and the transport pays per descriptor. On P those runs are mostly
contiguous (a P block's rows follow each other), so sorted by source they join into a
span per P block or longer; D reads the spans, then numpy moves each run from the
staging slot to its block in one vectorised copy per run length.

Safety: a staging slot whose READ is still running at the deadline is not reused
until that READ ended (the consumer's fence gives it back, see
:mod:`kvbridge.connector.fence`): a late byte lands there, not in a block D's engine
may have handed to another request. Scatter happens only after the READ of that chunk
completed, before the request is reported.

Whether a request is staged is the cost model's call (:class:`CostModel`): the copy's
costs are measured when the consumer starts, the per-descriptor cost of the transport
is learned from the direct transfers it times.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvbridge.connector.spans import Chunk, Regions, chunks
from kvbridge.errors import TransportError
from kvbridge.plan.runs import Runs
from kvbridge.transport.base import Region, Transport, XferHandle

DESC_COST_S = 2e-6
"""Initial per-descriptor cost (NIXL on these machines: 1.4–5 µs); learned after."""
TRANSFER_S_PER_B = 0.25e-9
"""Transfer time per byte (~4 GB/s: NIXL between processes here moves 3–6 GB/s): what a
gap read into a staging span costs."""
MAX_GAP = 64 << 10
"""Longest gap a staged span reads over, whatever the per-descriptor cost."""
ROUND_TRIP_S = 1e-4
"""Fixed cost of one more transfer round (post, wait) per staged chunk."""
PROGRESSION_S = 3e-6
"""Cost of one strided copy (a progression of runs) besides its bytes."""


class LocalMemory:
    """Writable numpy views of local regions, addressed by absolute address."""

    def __init__(self, regions: list[Region]):
        order = sorted(regions, key=lambda r: r.addr)
        self.bases = np.array([r.addr for r in order], dtype=np.int64)
        self.ends = self.bases + np.array([r.nbytes for r in order], dtype=np.int64)
        self.views = [
            np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.addr)) for r in order
        ]

    def scatter(
        self, dst: np.ndarray, src: np.ndarray, src_off: np.ndarray, length: np.ndarray
    ) -> None:
        """Copy ``src[src_off[i] : src_off[i] + length[i]]`` to absolute address ``dst[i]``
        (each destination inside one region, checked)."""
        reg = np.searchsorted(self.bases, dst, side="right") - 1
        if (reg < 0).any() or (dst + length > self.ends[np.maximum(reg, 0)]).any():
            raise TransportError("staged scatter: a destination run leaves local memory")
        for r in np.unique(reg):
            m = reg == r
            d_off, s_off, ln = dst[m] - self.bases[r], src_off[m], length[m]
            for size in np.unique(ln):
                k = ln == size
                copy_equal(self.views[r], d_off[k], src, s_off[k], int(size))

    def gather(
        self, src: np.ndarray, dst: np.ndarray, dst_off: np.ndarray, length: np.ndarray
    ) -> None:
        """Copy absolute address ``src[i]`` (``length[i]`` bytes, inside one region,
        checked) to ``dst[dst_off[i] : dst_off[i] + length[i]]``: :meth:`scatter` reversed."""
        reg = np.searchsorted(self.bases, src, side="right") - 1
        if (reg < 0).any() or (src + length > self.ends[np.maximum(reg, 0)]).any():
            raise TransportError("staged gather: a source run leaves local memory")
        for r in np.unique(reg):
            m = reg == r
            s_off, d_off, ln = src[m] - self.bases[r], dst_off[m], length[m]
            for size in np.unique(ln):
                k = ln == size
                copy_equal(dst, d_off[k], self.views[r], s_off[k], int(size))


def copy_equal(
    dv: np.ndarray, d_off: np.ndarray, sv: np.ndarray, s_off: np.ndarray, size: int
) -> None:
    """``dv[d_off[i] : +size] = sv[s_off[i] : +size]`` for all i (uint8 arrays)."""
    if d_off.shape[0] == 0:
        return
    _inside(dv, d_off, size)
    _inside(sv, s_off, size)
    if d_off.shape[0] <= 16 or size >= 1 << 16:  # few or long runs: slices
        for a, b in zip(d_off.tolist(), s_off.tolist(), strict=True):
            dv[a : a + size] = sv[b : b + size]
        return
    if _strided(dv, d_off, sv, s_off, size):
        return
    w = 8
    while w > 1 and (size % w or (d_off % w).any() or (s_off % w).any()):
        w //= 2
    dt = np.dtype(f"u{w}") if w > 1 else np.dtype(np.uint8)
    dw, sw = dv.view(dt) if w > 1 else dv, sv.view(dt) if w > 1 else sv
    step = np.arange(size // w, dtype=np.int64)
    dw[(d_off // w)[:, None] + step] = sw[(s_off // w)[:, None] + step]


def _inside(v: np.ndarray, off: np.ndarray, size: int) -> None:
    if int(off.min()) < 0 or int(off.max()) + size > v.shape[0]:
        raise TransportError(f"copy of {size} B runs outside a {v.shape[0]} B buffer")


def _strided(
    dv: np.ndarray, d_off: np.ndarray, sv: np.ndarray, s_off: np.ndarray, size: int
) -> bool:
    """Copy runs that form arithmetic progressions on both sides (a block's rows, sorted)
    as 2-D strided views, at memcpy speed; False (nothing copied) if the runs form too
    many progressions (then the caller's gather-scatter is cheaper)."""
    n = d_off.shape[0]
    dd, ds = np.diff(d_off), np.diff(s_off)
    cut = _cuts(dd, ds)
    if cut.shape[0] * 8 > n:
        return False
    ends = np.append(cut, n - 1).tolist()  # progression k: diffs [cut[k-1], ends[k])
    d_l, s_l, dd_l, ds_l = d_off.tolist(), s_off.tolist(), dd.tolist(), ds.tolist()
    i = 0
    for end in ends:
        if i > end:
            continue
        m = end - i + 1 if i < end else 1
        if m == 1 or abs(dd_l[i]) < size:  # one run, or destinations that overlap
            for a, b in zip(d_l[i : i + m], s_l[i : i + m], strict=True):
                dv[a : a + size] = sv[b : b + size]
        else:
            rows = as_strided(dv[d_l[i] :], (m, size), (dd_l[i], 1))
            rows[...] = as_strided(sv[s_l[i] :], (m, size), (ds_l[i], 1))
        i += m
    return True


def _cuts(dd: np.ndarray, ds: np.ndarray) -> np.ndarray:
    """Where the step between consecutive runs changes, on either side."""
    return np.flatnonzero((dd[1:] != dd[:-1]) | (ds[1:] != ds[:-1])) + 1


def progressions(d_off: np.ndarray, s_off: np.ndarray) -> int:
    """About how many strided copies :func:`copy_equal` makes of these runs (in order)."""
    if d_off.shape[0] < 3:
        return int(d_off.shape[0])
    return int(_cuts(np.diff(d_off), np.diff(s_off)).shape[0]) + 1


class CostModel:
    """Direct: ``runs · c_desc``. Staged: ``spans · c_desc + rounds · round trip +
    scatter(runs, bytes)``; the scatter's per-run and per-byte costs are measured at
    start-up, ``c_desc`` from the direct transfers the consumer timed."""

    def __init__(self) -> None:
        self.c_desc = DESC_COST_S
        self.per_run, self.per_byte = _measure_scatter()
        self.per_byte_strided = _measure_strided()
        self._lock = threading.Lock()

    def staged_wins(
        self,
        runs: int,
        spans: int,
        nbytes: int,
        rounds: int,
        copies: int = 1,
        strides: int | None = None,
        extra: int = 0,
    ) -> bool:
        """``copies``: local copies of every byte (a staged push: P's gather and D's
        scatter, 2); ``strides``: progressions the copies make (:func:`progressions`),
        if known: few (one per 8 runs at most) are copied as strided views; ``extra``:
        bytes the spans move beyond the runs' (the gaps they read over)."""
        direct = runs * self.c_desc
        staged = spans * self.c_desc + rounds * ROUND_TRIP_S + max(extra, 0) * TRANSFER_S_PER_B
        if strides is not None and strides * 8 <= runs:
            copy = strides * PROGRESSION_S + nbytes * self.per_byte_strided
        else:
            copy = runs * self.per_run + nbytes * self.per_byte
        return staged + copies * copy < direct

    def max_gap(self) -> int:
        """The gap whose bytes cost as much to move as one more descriptor."""
        return min(int(self.c_desc / TRANSFER_S_PER_B), MAX_GAP)

    def learn(self, descriptors: int, nbytes: int, seconds: float) -> None:
        """A direct transfer of small runs: what one descriptor cost (moving average)."""
        if descriptors < 256 or nbytes > descriptors * 4096:
            return  # bandwidth-bound: says little about the descriptor cost
        with self._lock:
            self.c_desc = 0.8 * self.c_desc + 0.2 * (seconds / descriptors)


def _measure_scatter() -> tuple[float, float]:
    """Seconds per run and per byte of :func:`copy_equal`, from two timed copies."""
    src = np.ones(1 << 20, np.uint8)
    dst = np.zeros(1 << 20, np.uint8)

    def timed(size: int) -> float:
        off = np.arange(0, 1 << 20, size, dtype=np.int64)
        shuffled = np.random.default_rng(0).permutation(off)  # no strided shortcut
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            copy_equal(dst, shuffled, src, off, size)
            best = min(best, time.perf_counter() - t0)
        return best

    small, big = timed(128), timed(8192)  # 8192 runs, 128 runs of the same 1 MiB
    per_run = max((small - big) / (8192 - 128), 0.0)
    per_byte = max((big - 128 * per_run) / (1 << 20), 0.0)
    return per_run, per_byte


def _measure_strided() -> float:
    """Seconds per byte of :func:`copy_equal` over one progression of 1 KiB runs."""
    src = np.ones(1 << 20, np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    off = np.arange(0, 1 << 20, 1024, dtype=np.int64)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        copy_equal(dst, off[::-1].copy(), src, off, 1024)
        best = min(best, time.perf_counter() - t0)
    return best / (1 << 20)


class StagingPool:
    """``slots`` staging slots of ``slot_bytes`` in one buffer, registered by the
    consumer with its transport. A slot whose READ may still land is not given back."""

    def __init__(self, slots: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.buf = np.zeros(slots * slot_bytes, np.uint8)
        self.region = Region(int(self.buf.ctypes.data), int(self.buf.nbytes))
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self._free.put(i)
        self.quarantined = 0

    def take(self, timeout_s: float) -> int | None:
        """A free slot, or None if none frees up within ``timeout_s`` (send direct)."""
        try:
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def give_back(self, slot: int, clean: bool) -> None:
        """Return ``slot``; ``clean=False`` (a READ into it may still land) keeps it out."""
        if clean:
            self._free.put(slot)
        else:
            self.quarantined += 1

    def view(self, slot: int) -> np.ndarray:
        return self.buf[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]


class Stager:
    """D's staged pulls: a slot pool registered with the consumer's transport, writable
    views of D's regions and the cost model that picks staged or direct per request."""

    def __init__(self, regions: list[Region], slots: int, slot_bytes: int):
        self.pool = StagingPool(slots, slot_bytes)
        self.memory = LocalMemory(regions)
        self.costs = CostModel()

    def choose(
        self, runs: dict[int, Runs], regions: dict[int, Regions] | None = None
    ) -> tuple[dict[int, list[Chunk]], int | None]:
        """Source ranks whose runs go through staging, and the slot they will use;
        ``({}, None)``: all direct (also when no slot frees up within 10 ms).
        ``regions``: each source rank's registered regions; spans may then read over
        gaps of up to :meth:`CostModel.max_gap` bytes inside one region."""
        out = {}
        for src, r in runs.items():
            if len(r) < 64 or r.nbytes > 16 * 1024 * len(r):
                continue  # few or long runs: direct, without sorting them
            try:
                chs = self.chunks(r, (regions or {}).get(src))
            except TransportError:  # a run longer than half a slot
                continue
            spans = sum(c.span_len.shape[0] for c in chs)
            extra = sum(c.staged_bytes for c in chs) - r.nbytes  # gaps (less overlaps)
            if self.costs.staged_wins(len(r), spans, r.nbytes, len(chs), extra=extra):
                out[src] = chs
        slot = self.pool.take(0.01) if out else None
        return (out, slot) if slot is not None else ({}, None)

    def chunks(self, runs: Runs, regions: Regions | None = None) -> list[Chunk]:
        """``runs`` in rounds for :meth:`pull`: each fits half a slot (the other half is
        being scattered meanwhile); spans read over gaps inside ``regions`` if given."""
        gap = self.costs.max_gap() if regions is not None else 0
        return chunks(runs, self.pool.slot_bytes // 2, gap, regions)

    def pull(
        self,
        transport: Transport,
        agents: dict[int, str],
        staged: dict[int, list[Chunk]],
        slot: int,
        deadline: float,
        live: list[XferHandle],
    ) -> tuple[int, int]:
        """READ each chunk's spans into one half of ``slot`` while the chunk before is
        scattered from the other half; ``(descriptors posted, runs moved)``. A READ
        still running at ``deadline`` (monotonic), or when anything fails, is appended to
        ``live`` and the slot is then not given back: the caller gives it back
        (:meth:`StagingPool.give_back`) once those READs ended."""
        base = self.pool.region.addr + slot * self.pool.slot_bytes
        half = self.pool.slot_bytes // 2
        todo = [(src, ch) for src, chs in staged.items() for ch in chs]
        if any(ch.staged_bytes > half for _, ch in todo):
            self.pool.give_back(slot, True)
            raise TransportError(f"a staged chunk exceeds half the {half * 2} B slot")
        pending: list[tuple[XferHandle, Chunk, int]] = []
        counts = [0, 0]

        def land() -> None:  # wait for the oldest READ, then scatter its chunk
            h, ch, at = pending[0]
            transport.wait_or_keep(h, max(deadline - time.monotonic(), 0.0))
            pending.pop(0)
            self.memory.scatter(ch.run_dst, self.pool.view(slot)[at:], ch.run_stage, ch.run_len)
            counts[0] += ch.span_len.shape[0]
            counts[1] += ch.run_len.shape[0]

        clean = False
        try:
            for i, (src, ch) in enumerate(todo):
                off = (i % 2) * half
                pending.append((_read(transport, agents[src], ch, base + off), ch, off))
                if len(pending) == 2:
                    land()
            while pending:
                land()
            clean = True
        finally:
            still = [h for h, _, _ in pending if not transport.ended(h)]
            live += still
            if clean or not still:
                self.pool.give_back(slot, True)
        return counts[0], counts[1]


def _read(transport: Transport, agent: str, ch: Chunk, at: int) -> XferHandle:
    """Post the READ of ``ch``'s spans to the slot area starting at address ``at``."""
    return transport.read(
        agent,
        (ch.span_stage + np.int64(at)).view(np.uint64),
        ch.span_src.view(np.uint64),
        ch.span_len.view(np.uint64),
    )
