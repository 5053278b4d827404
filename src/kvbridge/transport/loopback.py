"""In-process transport: runs are executed with memmove between registered regions.

Agents find each other through a :class:`Fabric` (one per test or process). Every run
is checked against the registered regions of both sides before any byte moves, so a
plan that strays outside registered memory fails the same way it does over NIXL.
Device memory moves too: a run with a device side is copied by torch
(:mod:`kvbridge.transport.memory`; on a GPU a device copy, synchronised before the
transfer counts done).
"""

from __future__ import annotations

import ctypes
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from kvbridge.errors import PeerError, TransportError
from kvbridge.layout.tensor import MemKind
from kvbridge.transport.base import U64, PostingTransport, Region, XferHandle, XferState
from kvbridge.transport.memory import byte_tensor


class _Meta(msgspec.Struct, frozen=True):
    name: str


@dataclass(eq=False)
class Fabric:
    """Registry of the loopback agents that can reach each other."""

    agents: dict[str, LoopbackTransport] = field(default_factory=dict)


@functools.cache
def process_fabric() -> Fabric:
    """The fabric of agents made by name (``make_transport("loopback", ...)``)."""
    return Fabric()


class _Handle(XferHandle):
    def __init__(self, state: XferState) -> None:
        self.state = state

    def release(self) -> None:
        pass


class LoopbackTransport(PostingTransport):
    kinds = frozenset(MemKind)

    def __init__(self, name: str, fabric: Fabric) -> None:
        if name in fabric.agents:
            raise TransportError(f"agent name {name!r} already on this fabric")
        self.name, self.fabric = name, fabric
        self.starts = np.zeros(0, np.int64)
        self.ends = np.zeros(0, np.int64)
        self.regions: list[Region] = []
        """Registered regions, in the order of ``starts``."""
        self._tensors: dict[int, torch.Tensor] = {}
        self.peers: set[str] = set()
        self.inbox: deque[tuple[str, bytes]] = deque()
        fabric.agents[name] = self

    def register(self, regions: list[Region]) -> bytes:
        self.check_kinds(regions)
        self.regions = sorted([*self.regions, *regions], key=lambda r: r.addr)
        self._tensors.clear()
        self.starts = np.array([r.addr for r in self.regions], np.int64)
        self.ends = np.array([r.addr + r.nbytes for r in self.regions], np.int64)
        return msgspec.msgpack.encode(_Meta(self.name))

    def add_peer(self, metadata: bytes) -> str:
        try:
            meta = msgspec.msgpack.decode(metadata, type=_Meta)
        except msgspec.DecodeError as e:
            raise PeerError(f"loopback metadata does not decode: {e}") from None
        if meta.name not in self.fabric.agents:
            raise PeerError(f"no loopback agent {meta.name!r} on this fabric")
        self.peers.add(meta.name)
        return meta.name

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)

    def _post(
        self, op: str, peer: str, local: U64, remote: U64, nbytes: U64, notif: bytes | None
    ) -> XferHandle:
        pull = op == "READ"
        src, dst = (remote, local) if pull else (local, remote)
        other = self.fabric.agents.get(peer)
        if peer not in self.peers or other is None:
            raise TransportError(f"{self.name}: unknown peer {peer!r}")
        src_i, dst_i, n = (np.asarray(a).view(np.int64) for a in (src, dst, nbytes))
        src_owner, dst_owner = (other, self) if pull else (self, other)
        src_reg = src_owner.check_inside(src_i, n, "source")
        dst_reg = dst_owner.check_inside(dst_i, n, "destination")
        runs = list(zip(src_i.tolist(), dst_i.tolist(), n.tolist(), strict=True))
        on_device = src_owner.has_device(src_reg) or dst_owner.has_device(dst_reg)
        places = list(zip(src_reg.tolist(), dst_reg.tolist(), strict=True))

        def run() -> None:
            """Copy the runs; with a device side by torch, run ``i`` from ``src_owner``'s
            region ``places[i][0]`` to ``dst_owner``'s ``places[i][1]`` (synchronised)."""
            devices: set[torch.device] = set()
            for (s, d, k), (si, di) in zip(runs, places, strict=True):
                if not on_device:
                    ctypes.memmove(d, s, k)
                    continue
                st, dt = src_owner.tensor(si), dst_owner.tensor(di)
                so, do = s - src_owner.regions[si].addr, d - dst_owner.regions[di].addr
                dt[do : do + k].copy_(st[so : so + k])
                devices.update(t.device for t in (st, dt) if t.is_cuda)
            for dev in devices:
                torch.cuda.synchronize(dev)
            if notif is not None:
                other.inbox.append((self.name, notif))

        return self._start(peer, run)

    def _start(self, peer: str, run: Callable[[], None]) -> XferHandle:
        """Move the bytes of one checked transfer with ``peer`` (``run``) now."""
        run()
        return _Handle(XferState.DONE)

    def check_inside(self, addr: np.ndarray, n: np.ndarray, what: str) -> np.ndarray:
        """Index (in :attr:`regions`) of the registered region each ``[addr, addr+n)``
        lies in; :class:`TransportError` if one lies in none."""
        if addr.shape[0] == 0:
            return np.zeros(0, np.int64)
        idx = np.searchsorted(self.starts, addr, side="right") - 1
        bad = (idx < 0) | (n < 0)
        ok = ~bad
        bad[ok] = addr[ok] + n[ok] > self.ends[idx[ok]]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TransportError(
                f"{self.name}: {what} run {i} [{addr[i]:#x}, +{n[i]}) is outside registered memory"
            )
        return idx

    def has_device(self, idx: np.ndarray) -> bool:
        """Whether any of the regions ``idx`` (from :meth:`check_inside`) is device memory."""
        return any(self.regions[i].kind is MemKind.DEVICE for i in np.unique(idx).tolist())

    def tensor(self, i: int) -> torch.Tensor:
        """Region ``i`` as a ``uint8`` tensor where it lives (made once per registration)."""
        t = self._tensors.get(i)
        if t is None:
            t = self._tensors[i] = byte_tensor(self.regions[i])
        return t

    def poll(self, handle: XferHandle) -> XferState:
        assert isinstance(handle, _Handle)
        return handle.state

    def notifications(self) -> list[tuple[str, bytes]]:
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def close(self) -> None:
        self.fabric.agents.pop(self.name, None)
