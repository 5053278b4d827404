"""The kernel mover: within a node, D maps P's regions (``transport/ipc.py``) and copies a
request's runs with one gather-scatter per source rank, no NIXL descriptor and no staging
(``docs/gpu.md``). D plans in a geometry over the offsets of :class:`Span` tensors (P's
regions as mapped here, D's own), so runs need no per-run address lookup; every run is
bounds-checked first, and :meth:`Launched.finish` returns only once its copies ended.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbridge.connector.movers.device_copies import GridCopy, checked_copy, grid_copy
from kvbridge.connector.movers.memory import Span, equal_runs
from kvbridge.connector.peers import Peer
from kvbridge.control.messages import rank_shares
from kvbridge.errors import TransportError
from kvbridge.layout.tensor import Region, regions_at
from kvbridge.plan.geometry import Geometry
from kvbridge.plan.runs import Grid, Runs
from kvbridge.transport.ipc import Opened, node_id
from kvbridge.transport.memory import torch_device

MAX_GEOMETRIES = 64
"""P engines whose geometry over mapped memory is kept (as many as D keeps peers)."""
_MADE = itertools.count()


@dataclass(frozen=True, slots=True)
class Over:
    """A pair's geometry over the offsets of mapped memory, per P rank the offsets of its
    regions it was made over and a number dividing every offset and length of its runs
    (:meth:`Geometry.divisor`: the copies' word width)."""

    geometry: Geometry
    bases: dict[int, tuple[int, ...]]
    divisors: dict[int, int]


@dataclass(slots=True)
class _Mapped:
    """One P rank's regions mapped here, for one P epoch; ``users``: moves using it now.
    Unmapped once a newer epoch replaced it and no move uses it any more."""

    epoch: str
    opened: Opened
    span: Span
    made: int = field(default_factory=lambda: next(_MADE))
    """Which mapping this is (a geometry over its offsets holds for it only)."""
    users: int = 0
    retired: bool = False


class KernelMover:
    """D's kernel mover over its KV ``regions`` (one memory: host, or one GPU)."""

    name = "kernel"

    def __init__(self, regions: list[Region]):
        self.kind, self.device = regions[0].kind, regions[0].device
        self.dst = Span(regions)
        self.on = torch_device(self.kind, self.device)
        self.stream = torch.cuda.Stream(device=self.on) if self.on.type == "cuda" else None
        self.overlap = self.stream is not None
        """Take P's ``begin`` answer while the copies run (:meth:`Launched.finish`): where
        they run asynchronously (a GPU). Host copies are synchronous, and the side
        channel to P stays locked until its answer is taken: then it is taken first."""
        self._lock = threading.Lock()
        self._sources: dict[tuple[str, int], _Mapped] = {}
        self._failed: dict[tuple[str, int], tuple[str, TransportError]] = {}
        self._geometries: dict[str, tuple[tuple[int, ...], Over]] = {}
        """Per P engine id: (the mappings it was made over, geometry over their offsets)."""

    def geometry(self, peer: Peer) -> tuple[Over | None, str]:
        """The pair's geometry over the offsets of P's regions as mapped here now and of
        D's own, to plan a request in (made once per mapping of P's ranks); ``(None,
        why)`` if this mover cannot serve ``peer``."""
        sources = sorted(peer.geometry.links)
        why = self._cannot_serve(peer, sources)
        if why or peer.remake is None:
            return None, why
        held: list[_Mapped] = []
        src = -1
        try:
            for src in sources:
                held.append(self._acquire(peer, src))
            made = tuple(m.made for m in held)
            with self._lock:
                known = self._geometries.get(peer.engine_id)
            if known is not None and known[0] == made:
                return known[1], ""
            bases = {src: m.span.bases for src, m in zip(sources, held, strict=True)}
            geometry = peer.remake(bases, self.dst.bases)
            over = Over(geometry, bases, {src: geometry.divisor(src) for src in sources})
        except TransportError as exc:  # remembered per P epoch: over the transport
            return None, f"P rank {src}'s memory cannot be mapped here: {exc}"
        finally:
            for m in held:
                self._release(m)
        with self._lock:
            self._geometries.pop(peer.engine_id, None)
            self._geometries[peer.engine_id] = (made, over)
            while len(self._geometries) > MAX_GEOMETRIES:  # the least recently made
                del self._geometries[next(iter(self._geometries))]
        return over, ""

    def _cannot_serve(self, peer: Peer, sources: list[int]) -> str:
        """Why this mover cannot serve ``peer`` whatever is mapped ("": it may)."""
        for src in sources:
            info = peer.ranks.get(src)
            if info is None or not info.shares:
                return f"P rank {src} shares no memory"
            if info.node != node_id():
                return f"P rank {src} runs on another node"
            if info.memory_kind() is not self.kind:
                return f"P rank {src} keeps {info.memory} memory, this rank {self.kind.value}"
        return "" if peer.remake is not None else "no geometry over mapped memory"

    def ready(self, peer: Peer) -> bool:
        """Whether :meth:`geometry` would answer at once: every P rank mapped at this
        epoch (or known unmappable) and the geometry made, or ``peer`` not served."""
        sources = sorted(peer.geometry.links)
        if self._cannot_serve(peer, sources):
            return True
        if not self._lock.acquire(blocking=False):  # a worker maps or unmaps: not now
            return False
        try:
            made = []
            for src in sources:
                key = (peer.engine_id, src)
                failed = self._failed.get(key)
                if failed is not None and failed[0] == peer.epoch:
                    return True
                known = self._sources.get(key)
                if known is None or known.epoch != peer.epoch:
                    return False
                made.append(known.made)
            geometry = self._geometries.get(peer.engine_id)
            return geometry is not None and geometry[0] == tuple(made)
        finally:
            self._lock.release()

    def launch(self, peer: Peer, runs: dict[int, Runs], over: Over) -> Launched:
        """Start copying every run of ``runs`` (per P rank; planned in ``over``, from
        :meth:`geometry`), asynchronously on a GPU, on the host to the end: what ends
        them (:meth:`Launched.finish`, called once). P's memory mapped again since
        ``over`` was made is a :class:`TransportError` before any byte moves. Every run is
        bounds-checked once (:func:`copy_groups`). Raises once every copy it started ended."""
        out = Launched(self)
        try:
            for src, r in runs.items():
                out.held.append(self._acquire(peer, src))
                span = out.held[-1].span
                if span.bases != over.bases.get(src):
                    raise TransportError(
                        f"P rank {src}'s memory was mapped again since this load was "
                        "planned (P restarted?)"
                    )
                divisor = over.divisors[src]
                for c in copy_groups(span, self.dst, r, f"P rank {src}'s"):
                    run_copy(self.dst, span, c, divisor, self.stream)
                    out.calls += 1
        except BaseException:
            out.finish()
            raise
        return out

    def _acquire(self, peer: Peer, src: int) -> _Mapped:
        """P rank ``src``'s regions mapped here (once per P epoch), marked in use; a
        mapping of an older epoch is retired here, unmapped once no move uses it."""
        key = (peer.engine_id, src)
        with self._lock:
            known = self._sources.get(key)
            if known is not None and known.epoch != peer.epoch:  # P restarted
                known.retired = True
                self._unmap_if_idle(known)
                del self._sources[key]
                known = None
            if known is None:
                failed = self._failed.get(key)
                if failed is not None and failed[0] == peer.epoch:
                    raise failed[1]
                try:
                    opened, span = self._open(peer, src)
                except TransportError as exc:
                    self._failed[key] = (peer.epoch, exc)
                    raise
                known = self._sources[key] = _Mapped(peer.epoch, opened, span)
            known.users += 1
            return known

    def _release(self, m: _Mapped) -> None:
        with self._lock:
            m.users -= 1
            self._unmap_if_idle(m)

    @staticmethod
    def _unmap_if_idle(m: _Mapped) -> None:
        if m.retired and m.users == 0:
            m.opened.close()

    def _open(self, peer: Peer, src: int) -> tuple[Opened, Span]:
        info = peer.ranks[src]
        shares = rank_shares(info)
        opened: Opened | None = None
        try:
            opened = Opened(shares, self.kind, self.device)
            here = regions_at(opened.bases, tuple(s.nbytes for s in shares), self.kind, self.device)
            return opened, Span(here, names=list(info.bases))
        except Exception as exc:  # e.g. torch or the driver refusing the pointer
            if opened is not None:
                opened.close()
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"mapping P rank {src}'s memory: {exc!r}") from exc

    def close(self) -> None:
        """Unmap every P region (no load may be running)."""
        with self._lock:
            mapped, self._sources = list(self._sources.values()), {}
            self._geometries = {}
        for m in mapped:
            m.opened.close()


@dataclass(slots=True)
class Launched:
    """Copies :meth:`KernelMover.launch` started, holding the mappings they read."""

    mover: KernelMover
    held: list[_Mapped] = field(default_factory=list)
    calls: int = 0
    ended: bool = False

    def finish(self, meanwhile: Callable[[], object] | None = None) -> int:
        """Run ``meanwhile`` (while the copies run, on a GPU), wait for the copies and
        release the mappings → the number of copy calls; returns or raises
        (``meanwhile``'s error) only then. A second call does nothing more."""
        if self.ended:
            return self.calls
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            self.ended = True
            try:
                if self.mover.stream is not None:
                    self.mover.stream.synchronize()
            finally:
                for m in self.held:
                    self.mover._release(m)
        return self.calls


Copy = tuple[np.ndarray, np.ndarray, int] | GridCopy
"""One copy call's runs: ``(destination offsets, source offsets, bytes per run)``, or a
grid of runs of one length."""


def copy_groups(src: Span, dst: Span, r: Runs, what: str) -> list[Copy]:
    """Runs ``r`` planned over the spans' offsets (:meth:`KernelMover.geometry`), each
    bounds-checked, as few copies of one length as possible (one copy call each); a
    plan's grids stay grids, one :class:`GridCopy` per length among its ``T`` runs."""
    if r.grids is not None:
        return [c for g in r.grids if len(g) for c in _grid_copies(src, dst, g, what)]
    if not len(r):
        return []
    lengths = (int(r.length.min()), int(r.length.max()))
    src.check(r.src, r.length, what, lengths)
    dst.check(r.dst, r.length, "this rank's", lengths)
    if lengths[0] == lengths[1]:
        return [(r.dst, r.src, lengths[0])]
    return list(equal_runs(r.dst, r.src, r.length))


def _grid_copies(src: Span, dst: Span, g: Grid, what: str) -> list[Copy]:
    src.check_grid(g.soff, g.pid, g.sstride, g.length, what)
    dst.check_grid(g.doff, g.did, g.dstride, g.length, "this rank's")
    sizes = np.unique(g.length)
    picks = [slice(None)] if sizes.shape[0] == 1 else [g.length == n for n in sizes]
    return [
        GridCopy(g.doff[p], g.did, g.dstride, g.soff[p], g.pid, g.sstride, int(n))
        for p, n in zip(picks, sizes, strict=True)
    ]


def run_copy(dst: Span, src: Span, c: Copy, divisor: int, stream: Any) -> None:
    """One copy call of :func:`copy_groups`' output (queued on ``stream`` on a GPU)."""
    if isinstance(c, GridCopy):
        grid_copy(dst.tensor, src.tensor, c, divisor, stream=stream)
    else:
        d, s, size = c
        checked_copy(dst.tensor, d, src.tensor, s, size, divisor, stream=stream)


def kernel_mover(regions: list[Region]) -> KernelMover | None:
    """A kernel mover over ``regions`` if torch can reach their memory here, else None."""
    try:
        return KernelMover(regions) if regions else None
    except TransportError:
        return None


__all__ = ["KernelMover", "Launched", "Over", "copy_groups", "kernel_mover", "run_copy"]
