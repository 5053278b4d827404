"""A rank's memory for the check: its KV regions and a staging buffer, as uint8 tensors.

GPU: one ``torch.empty`` per region on ``cuda:0``, each its own allocation (rounded up to
what torch's caching allocator gives a segment of its own: 2 MiB steps, 10 MiB at least),
so a CUDA IPC handle maps exactly one region and no two regions share a handle (a
process may open a handle only once). CPU with ``shm``: one file in /dev/shm per rank,
regions at page boundaries, mapped and wrapped by torch without a copy (the kernel mover's
way to reach a host-memory peer, :mod:`kvbridge.transport.ipc`); without: plain CPU
tensors, touched once so no page fault lands in a timed transfer.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import torch

from kvbridge.layout.tensor import MemKind, Region

PAGE = 4096
MIB = 1 << 20


def _round(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass
class Pools:
    """``regions[i]`` holds layout region ``i``; ``staging``: the rank's staging buffer
    (gathered runs, and the contiguous transfers' bytes)."""

    regions: list[torch.Tensor]
    staging: torch.Tensor
    kind: MemKind
    device: int = 0
    path: str = ""
    _maps: list[mmap.mmap] = field(default_factory=list)

    @property
    def bases(self) -> list[int]:
        return [int(t.data_ptr()) for t in self.regions]

    def region_list(self) -> list[Region]:
        return [Region(int(t.data_ptr()), t.numel(), self.kind, self.device) for t in self.regions]

    def staging_region(self) -> Region:
        return Region(int(self.staging.data_ptr()), self.staging.numel(), self.kind, self.device)

    def close(self) -> None:
        """Drop the tensors; unlink the /dev/shm file (peers unmapped it first)."""
        self.regions, self.staging = [], torch.empty(0, dtype=torch.uint8)
        if self.path:
            os.unlink(self.path)
            self.path = ""
        self._maps = []  # the mapping closes once no tensor holds it
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def allocate(sizes: tuple[int, ...], staging: int, gpu: bool, shm_path: str = "") -> Pools:
    """Regions of ``sizes`` bytes and a staging buffer of ``staging`` bytes: on ``cuda:0``
    (``gpu``), in the /dev/shm file ``shm_path``, or as plain CPU tensors."""
    if gpu:
        dev = torch.device("cuda", 0)
        regions = [_own_segment(n, dev) for n in sizes]
        return Pools(regions, _own_segment(staging, dev), MemKind.DEVICE)
    if shm_path:
        return _shm(sizes, staging, shm_path)
    regions = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    return Pools(regions, torch.zeros(staging, dtype=torch.uint8), MemKind.HOST)


def _own_segment(n: int, dev: torch.device) -> torch.Tensor:
    """``n`` bytes in a caching-allocator segment of their own (see the module docstring)."""
    whole = torch.empty(max(_round(n, 2 * MIB), 10 * MIB), dtype=torch.uint8, device=dev)
    return whole[:n]


def _shm(sizes: tuple[int, ...], staging: int, path: str) -> Pools:
    offsets, pos = [], 0
    for n in (*sizes, staging):
        offsets.append(pos)
        pos += _round(n, PAGE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, pos)
        mm = mmap.mmap(fd, pos)
    finally:
        os.close(fd)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    whole.zero_()  # touch every page now, not in a timed transfer
    parts = [whole[o : o + n] for o, n in zip(offsets, (*sizes, staging), strict=True)]
    return Pools(parts[:-1], parts[-1], MemKind.HOST, 0, path, [mm])
