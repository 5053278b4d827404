"""Staging: many small runs moved as a few long spans through a registered slot, then
copied to their destinations locally (pulled here: :meth:`Stager.pull`; pushed:
:mod:`.push`). A slot a transfer may still land in is reused only after the fence
(``docs/faults.md``); whether a source rank is staged is :class:`CostModel`'s call.
"""

from __future__ import annotations

import queue
import threading
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvbridge.connector.movers.copies import (
    VIEW_S,
    copy_equal,
    gather_scatter,
    gather_word,
    progressions,
)
from kvbridge.connector.movers.device_copies import copy_cost_probe
from kvbridge.connector.movers.memory import LocalMemory
from kvbridge.connector.movers.spans import Chunk, Regions, chunks, rounds
from kvbridge.errors import TransportError
from kvbridge.layout.tensor import MemKind
from kvbridge.plan.runs import Runs
from kvbridge.transport.base import Region, Transport, XferHandle
from kvbridge.transport.memory import torch_device

ROUND_TRIP_S, DESC_COST_S, TRANSFER_S_PER_B = 1e-4, 2e-6, 0.25e-9
"""Initial costs of a round (post, wait), a descriptor (NIXL here: 1.4–5 µs) and a byte
(~4 GB/s; NIXL between processes here: 3–14 GB/s), learned after."""
MAX_GAP = 64 << 10
"""Longest gap a staged span reads over, whatever the per-descriptor cost."""
MIN_DESC_S, MAX_DESC_S = 1e-8, 1e-4
MIN_BYTE_S, MAX_BYTE_S = 1e-12, 1e-7
"""What one learned sample may say (10 ns to 100 µs a descriptor, 1 TB/s to 10 MB/s a
byte): one stalled or one lucky transfer moves the estimate, it cannot throw it out."""
MIN_RUNS, MAX_AVG = 64, 16 << 10
"""A source rank's runs may be staged only if this many or more, of at most this many
bytes on average (fewer or longer: direct, without sorting them)."""


@dataclass(frozen=True, slots=True)
class Link:
    """One direction's costs, seconds: a round's fixed cost, one descriptor, one byte."""

    round_s: float
    desc_s: float
    byte_s: float

    def learned(self, descriptors: int, nbytes: int, seconds: float) -> Link:
        """This link after a timed direct transfer (one round): small runs (≤ 4 KiB
        on average, 256 or more) tell the descriptor's cost, long ones (≥ 64 KiB on
        average, 8 MiB or more) the byte's, each net of the other terms, as moving
        averages bounded per sample."""
        if descriptors <= 0 or seconds <= 0:
            return self
        left = seconds - self.round_s
        if descriptors >= 256 and nbytes <= descriptors * 4096:
            per = min(max((left - nbytes * self.byte_s) / descriptors, MIN_DESC_S), MAX_DESC_S)
            return replace(self, desc_s=0.8 * self.desc_s + 0.2 * per)
        if nbytes >= 8 << 20 and nbytes >= descriptors * (64 << 10):
            per = min(max((left - descriptors * self.desc_s) / nbytes, MIN_BYTE_S), MAX_BYTE_S)
            return replace(self, byte_s=0.8 * self.byte_s + 0.2 * per)
        return self

    def __str__(self) -> str:
        gbps = 1e-9 / self.byte_s if self.byte_s > 0 else float("inf")
        desc = f"{self.desc_s * 1e6:.2f} µs/desc"
        return f"{self.round_s * 1e6:.0f} µs/round, {desc}, {gbps:.2f} GB/s"


class CostModel:
    """Direct: ``runs · desc_s``. Staged: ``spans · desc_s + rounds · round_s + gap
    bytes · byte_s + local copies``. The copies' costs are measured at start-up (on
    ``device`` with torch kernels, :func:`.device_copies.copy_cost_probe`; None: numpy's);
    the transport's (:class:`Link`) are the pair's where D measured them
    (:mod:`.choice`), else :attr:`link`, learned from the direct transfers D times."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.link = Link(ROUND_TRIP_S, DESC_COST_S, TRANSFER_S_PER_B)
        self.on_device = device is not None
        if device is not None:
            self.per_run, self.per_byte = copy_cost_probe(device)
            self.whole_run, self.whole_byte = self.per_run, self.per_byte
            self.per_byte_strided = self.per_byte
        else:
            self.per_run, self.per_byte = _measure_scatter(whole=False)
            self.whole_run, self.whole_byte = _measure_scatter(whole=True)
            self.per_byte_strided = _measure_strided()
        self._lock = threading.Lock()

    def staged_wins(
        self,
        runs: int,
        spans: int,
        nbytes: int,
        rounds: int,
        copies: int = 1,
        shape: CopyShape = (None, False),
        extra: int = 0,
        link: Link | None = None,
        direct_rounds: int = 0,
    ) -> bool:
        """``copies``: local copies of every byte (pushed: P's gather and D's scatter);
        ``shape``: how they copy (:func:`copy_shape`); ``extra``: the gap bytes spans read
        over; ``link``: the pair's costs that way (None: :attr:`link`); ``direct_rounds``:
        the direct transfer's rounds staging spares (push to a sole rank: its own; else 0)."""
        t = link or self.link
        direct = runs * t.desc_s + direct_rounds * t.round_s
        staged = spans * t.desc_s + rounds * t.round_s + max(extra, 0) * t.byte_s
        views, whole = shape
        if views is not None:
            copy = views * VIEW_S + nbytes * self.per_byte_strided
        elif whole:
            copy = runs * self.whole_run + nbytes * self.whole_byte
        else:
            copy = runs * self.per_run + nbytes * self.per_byte
        return staged + copies * copy < direct

    def shape(self, chs: list[Chunk], push: bool) -> CopyShape:
        """How the chunks' copies go (:func:`copy_shape`; torch kernels on a device: one
        gather-scatter at the measured cost)."""
        shapes = [(None, False)] if self.on_device else [copy_shape(c, push) for c in chs]
        if all(v is not None for v, _ in shapes):  # all strided: their views
            return sum(v for v, _ in shapes if v is not None), False
        return None, all(w for v, w in shapes if v is None)  # whole words if all gather so

    def max_gap(self, link: Link | None = None) -> int:
        """The gap whose bytes cost as much to move as one more descriptor."""
        t = link or self.link
        return min(int(t.desc_s / t.byte_s), MAX_GAP)

    def learn(self, descriptors: int, nbytes: int, seconds: float) -> None:
        """A timed direct transfer (:meth:`Link.learned`)."""
        with self._lock:
            self.link = self.link.learned(descriptors, nbytes, seconds)


def _measure_scatter(whole: bool) -> tuple[float, float]:
    """Seconds per run and per byte of :func:`copy_equal`'s gather-scatter of runs in no
    order: ``whole``, a run one word, else 8-byte words (the slowest it gets)."""
    src = np.ones(1 << 20, np.uint8)
    dst = np.zeros(1 << 20, np.uint8)

    def timed(size: int) -> float:
        off = np.arange(0, (1 << 20) - size, size, dtype=np.int64)
        if not whole:
            off[1::2] += 8
        shuffled = np.random.default_rng(0).permutation(off)
        word = gather_word(shuffled, off, size)
        return _best(lambda: gather_scatter(dst, shuffled, src, off, size, word))

    small, big = timed(128), timed(8192)  # 8192 runs, 128 runs of the same 1 MiB
    per_run = max((small - big) / (8192 - 128), 0.0)
    per_byte = max((big - 128 * per_run) / (1 << 20), 0.0)
    return per_run, per_byte


def _measure_strided() -> float:
    """Seconds per byte of :func:`copy_equal` over one progression of 1 KiB runs."""
    src = np.ones(1 << 20, np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    off = np.arange(0, 1 << 20, 1024, dtype=np.int64)
    return _best(lambda: copy_equal(dst, off[::-1].copy(), src, off, 1024)) / (1 << 20)


def _best(copy: Callable[[], None]) -> float:
    return min(timeit.repeat(copy, number=1, repeat=3))  # the fastest of three, seconds


@dataclass(frozen=True, slots=True)
class Staging:
    """What the choice prices a staged round with (:func:`.choice.price`): the slots'
    bytes, the local copies' seconds per run and per byte."""

    slot_bytes: int
    per_run: float
    per_byte: float


class StagingPool:
    """``slots`` staging slots of ``slot_bytes`` in one buffer (registered by its owner),
    in memory of ``kind`` (device memory: a torch tensor on GPU ``device``)."""

    def __init__(self, slots: int, slot_bytes: int, kind: MemKind = MemKind.HOST, device: int = 0):
        self.slot_bytes = slot_bytes
        self.buf: Any
        if kind is MemKind.HOST:
            self.buf = np.zeros(slots * slot_bytes, np.uint8)
            addr = int(self.buf.ctypes.data)
        else:
            on = torch_device(kind, device)
            self.buf = torch.zeros(slots * slot_bytes, dtype=torch.uint8, device=on)
            addr = int(self.buf.data_ptr())
        self.region = Region(addr, slots * slot_bytes, kind, device)
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

    def view(self, slot: int) -> Any:
        """Slot ``slot``'s bytes: a numpy array (host memory) or a torch tensor."""
        return self.buf[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]


class Stager:
    """D's staging: a slot pool, writable access to D's ``regions`` and the cost model
    that picks staged or direct per source rank."""

    def __init__(self, regions: list[Region], slots: int, slot_bytes: int):
        self.pool = StagingPool(slots, slot_bytes, regions[0].kind, regions[0].device)
        self.memory = LocalMemory(regions)
        self.costs = CostModel(None if self.memory.host else self.memory.span.tensor.device)

    @property
    def priced(self) -> Staging:
        return Staging(self.pool.slot_bytes, self.costs.per_run, self.costs.per_byte)

    def choose(
        self,
        runs: dict[int, Runs],
        regions: dict[int, Regions] | None = None,
        push: bool = False,
        link: Link | None = None,
    ) -> tuple[dict[int, list[Chunk]], int | None]:
        """Source ranks whose runs go through staging, in chunks of half a slot, and the
        slot; ``({}, None)``: all direct (also when no slot frees up within 10 ms). Pulled
        (:meth:`chunks`): spans may read over gaps inside each source rank's ``regions``;
        ``push`` (:mod:`.push`): a chunk is one span, copied twice. ``link``: the pair's
        measured costs that way."""
        out = {}
        for src, r in runs.items():
            if len(r) < MIN_RUNS or r.nbytes > MAX_AVG * len(r):
                continue  # few or long runs: direct, without sorting them
            try:
                gaps = None if push else (regions or {}).get(src)  # pushed: no gap joins
                chs = self.chunks(r, gaps, None if push else link)
            except TransportError:  # a run longer than the chunk
                continue
            spans = len(chs) if push else sum(c.span_len.shape[0] for c in chs)
            extra = sum(c.staged_bytes for c in chs) - r.nbytes  # gaps read over
            shape = self.costs.shape(chs, push)
            copies = 2 if push else 1  # pushed: P's gather and D's scatter; pulled: D's
            spared_rounds = 1 if push and len(runs) == 1 else 0  # a sole rank's own round
            if self.costs.staged_wins(
                runs=len(r),
                spans=spans,
                nbytes=r.nbytes,
                rounds=len(chs),
                copies=copies,
                shape=shape,
                extra=extra,
                link=link,
                direct_rounds=spared_rounds,
            ):
                out[src] = chs
        slot = self.pool.take(0.01) if out else None
        return (out, slot) if slot is not None else ({}, None)

    def chunks(
        self, runs: Runs, regions: Regions | None = None, link: Link | None = None
    ) -> list[Chunk]:
        """``runs`` in rounds of half a slot for :meth:`pull` (spans read over gaps inside
        ``regions`` if given)."""
        gap = self.costs.max_gap(link) if regions is not None else 0
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
        scattered from the other half → ``(descriptors posted, runs moved)``. READs
        still running at ``deadline`` (monotonic) or a failure go to ``live``, and the
        slot is then the caller's to give back once they ended."""
        base = self.pool.region.addr + slot * self.pool.slot_bytes
        half = self.pool.slot_bytes // 2
        todo = [(src, ch) for src, chs in staged.items() for ch in chs]
        if any(ch.staged_bytes > half for _, ch in todo):
            self.pool.give_back(slot, True)
            raise TransportError(f"a staged chunk exceeds half the {half * 2} B slot")
        inflight: list[XferHandle] = []
        counts = [0, 0]

        def scatter(item: tuple[int, Chunk], at: int) -> None:
            ch = item[1]
            self.memory.scatter(ch.run_dst, self.pool.view(slot)[at:], ch.run_stage, ch.run_len)
            counts[0] += ch.span_len.shape[0]
            counts[1] += ch.run_len.shape[0]

        clean = False
        try:
            rounds(
                todo, half,
                lambda item, at: _read(transport, agents[item[0]], item[1], base + at),
                lambda h: transport.wait_or_keep(h, max(deadline - time.monotonic(), 0.0)),
                scatter, inflight,
            )  # fmt: skip
            clean = True
        finally:
            still = [h for h in inflight if not transport.ended(h)]
            live += still
            if clean or not still:
                self.pool.give_back(slot, True)
        return counts[0], counts[1]


def _read(transport: Transport, agent: str, ch: Chunk, at: int) -> XferHandle:
    """Post the READ of ``ch``'s spans to the slot area starting at address ``at``."""
    stage, src, n = (ch.span_stage + np.int64(at)), ch.span_src, ch.span_len
    return transport.read(agent, stage.view(np.uint64), src.view(np.uint64), n.view(np.uint64))


CopyShape = tuple[int | None, bool]
"""How a staged round's local copies go: ``(strided views, None if they gather-scatter;
whether the gather-scatter moves whole runs as words)``."""


def copy_shape(c: Chunk, push: bool) -> CopyShape:
    """How the chunk's scatter copies (and, pushed, P's gather too: the costlier)."""
    out = _one(c.run_dst, c.run_stage, c.run_len)
    if not push:
        return out
    (a, whole_a), (b, whole_b) = out, _one(c.span_stage, c.span_src, c.span_len)
    if a is None or b is None:  # a gather-scatter is the costlier
        return None, (a is not None or whole_a) and (b is not None or whole_b)
    return max(a, b), False


def _one(d_off: np.ndarray, s_off: np.ndarray, length: np.ndarray) -> CopyShape:
    size = int(length.sum()) // max(int(length.shape[0]), 1)
    views = progressions(d_off, s_off, size)
    uniform = bool((length == size).all())
    return views, views is None and uniform and gather_word(d_off, s_off, size) == size
