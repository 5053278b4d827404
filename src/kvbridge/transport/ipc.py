"""Sharing a rank's memory with another process of the same node, without NIXL.

P describes each region as a :class:`Share` (:func:`export`); D, on the same node
(:func:`node_id`), maps them (:class:`Opened`) for :mod:`kvbridge.connector.movers.kernel`.
Two ways: ``cuda``, a CUDA IPC handle of the allocation holding a device region (driver
API) and the region's offset in it; ``shm``, the /dev/shm file behind host memory (also
device memory emulated on the CPU, ``KVBRIDGE_DEVICE_ON_CPU``). Anonymous host memory, or
device memory the driver will not export (virtual memory API), has no share. Handles
travel only over the authenticated side channel; D reads a mapping only under a lease.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass

from kvbridge.errors import TransportError
from kvbridge.layout.tensor import MemKind, Region
from kvbridge.transport.memory import cuda_available

__all__ = ["Opened", "Share", "export", "node_id"]

SHM_DIR = "/dev/shm/"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Share:
    """How another process of this node maps one region: ``way`` "cuda" or "shm";
    ``handle``: the CUDA IPC handle (64 bytes) or the file path (UTF-8); ``offset``: the
    region's byte offset in the allocation or file; ``nbytes``: the region's size."""

    way: str
    handle: bytes
    offset: int
    nbytes: int
    ident: int = 0
    """shm: the file's identity (device and inode), checked by D after opening: a
    process of another mount namespace (a container on the same host, same boot id) may
    see another file under the same name."""


@functools.cache
def node_id() -> str:
    """This machine's boot id: equal in two processes exactly when they share a node."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def export(region: Region) -> Share | None:
    """How another process of this node can map ``region``; None if it cannot."""
    if region.kind is MemKind.DEVICE and cuda_available():
        return _cuda_export(region)
    return _shm_export(region)


def _ident(st: os.stat_result) -> int:
    return (st.st_dev * 1_000_003 + st.st_ino) & ((1 << 63) - 1)


def _shm_file(path: str) -> bool:
    """A file directly in /dev/shm (no subdirectory: nothing to redirect through links)."""
    return path.startswith(SHM_DIR) and "/" not in path[len(SHM_DIR) :]


def _shm_export(region: Region) -> Share | None:
    """The /dev/shm file and offset behind ``region``, from this process's memory map;
    only a shared mapping (a private one's written pages are not the file's)."""
    end = region.addr + region.nbytes
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= region.addr and end <= hi and len(parts) == 6:
            path = parts[5].strip()
            if not _shm_file(path) or parts[1][3:4] != "s":
                return None
            try:
                ident = _ident(os.stat(path))
            except OSError:  # unlinked since
                return None
            off = int(parts[2], 16) + region.addr - lo
            return Share("shm", path.encode(), off, region.nbytes, ident)
    return None


class Opened:
    """P's shared regions mapped into this process, in P's region order.

    ``bases[i]``: the local address of P's region ``i`` (its bytes are P's bytes);
    :class:`TransportError` if a share cannot be mapped (a closed or different file, a
    handle the driver refuses, a way that does not fit memory of ``kind`` here).
    ``close()`` unmaps."""

    def __init__(self, shares: list[Share], kind: MemKind, device: int = 0):
        self._maps: list[mmap.mmap] = []
        self._cuda: dict[bytes, int] = {}  # a handle is opened once per process
        self.bases: list[int] = []
        self.device = device
        on_gpu = kind is MemKind.DEVICE and cuda_available()
        try:
            for s in shares:
                if (s.way == "cuda") != on_gpu:
                    raise TransportError(f"a {s.way!r} share for {kind.value} memory here")
                self.bases.append(self._open(s))
        except BaseException:
            self.close()
            raise

    def _open(self, s: Share) -> int:
        if s.way == "shm":
            return self._open_shm(s)
        if s.way == "cuda":
            if s.offset < 0 or s.nbytes <= 0:
                raise TransportError(f"CUDA share +{s.offset} ({s.nbytes} B) refused")
            addr = self._cuda.get(s.handle)
            if addr is None:
                addr = self._cuda[s.handle] = _cuda_open(s.handle, self.device)
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            with _DRIVER_LOCK:
                rc = _driver().cuMemGetAddressRange_v2(
                    ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)
                )
            _check("cuMemGetAddressRange", rc)
            mapped = int(size.value) - (addr - int(base.value))
            if s.offset + s.nbytes > mapped:  # reading past it would fault the context
                raise TransportError(f"CUDA share ends at {s.offset + s.nbytes}, maps {mapped} B")
            return addr + s.offset
        raise TransportError(f"unknown way of sharing memory {s.way!r}")

    def _open_shm(self, s: Share) -> int:
        path = s.handle.decode(errors="replace")
        if not _shm_file(path) or s.offset < 0 or s.nbytes <= 0:
            raise TransportError(f"shared memory {path!r} +{s.offset} ({s.nbytes} B) refused")
        page = s.offset - s.offset % mmap.ALLOCATIONGRANULARITY
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise TransportError(f"cannot open shared memory {path!r}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or _ident(st) != s.ident:
                raise TransportError(f"{path!r} here is not the file P shares (another namespace?)")
            if s.offset + s.nbytes > st.st_size:  # pages past the end would fault on access
                raise TransportError(
                    f"{path!r} has {st.st_size} B, the share ends at {s.offset + s.nbytes}"
                )
            m = mmap.mmap(fd, s.offset - page + s.nbytes, offset=page)
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot map {path!r} +{s.offset} {s.nbytes} B: {exc}") from exc
        finally:
            os.close(fd)
        self._maps.append(m)
        return ctypes.addressof(ctypes.c_uint8.from_buffer(m)) + s.offset - page

    def close(self) -> None:
        """Unmap everything; tensors over the mappings must not be used any more."""
        for m in self._maps:
            m.close()
        for addr in self._cuda.values():
            _cuda_close(addr, self.device)
        self._maps, self._cuda = [], {}


# --- CUDA driver API, through ctypes (present wherever a CUDA GPU is) -----------------

_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_DRIVER_LOCK = threading.Lock()


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # raw bytes (c_char would stop at NUL)


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise TransportError(f"CUDA driver not loadable: {exc}") from exc


def _check(what: str, rc: int) -> None:
    if rc != 0:
        raise TransportError(f"CUDA driver: {what} failed with CUresult {rc}")


def _current(device: int) -> None:
    """Make GPU ``device``'s primary context (torch's) current in this thread: the driver
    API needs it, and a new thread has none (``torch.cuda.set_device`` to the device it
    believes current does not bind one)."""
    cu = _driver()
    ctx = _primary(device)
    with _DRIVER_LOCK:
        _check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctypes.c_void_p(ctx)))


@functools.cache
def _primary(device: int) -> int:
    """GPU ``device``'s primary context, retained once per process."""
    cu = _driver()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    with _DRIVER_LOCK:
        _check("cuInit", cu.cuInit(ctypes.c_uint(0)))
        _check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device)))
        _check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    return int(ctx.value or 0)


def _cuda_export(region: Region) -> Share | None:
    """The IPC handle of the allocation holding ``region``; None if not exportable."""
    try:
        cu = _driver()
        _current(region.device)
    except TransportError as exc:  # no sharing then: D moves the bytes over the transport
        log.warning("GPU %d memory not shared: %s", region.device, exc)
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    handle = _IpcHandle()
    with _DRIVER_LOCK:
        rc = cu.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(region.addr)
        )
        if rc != 0 or region.addr + region.nbytes > base.value + size.value:
            return None
        if cu.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base.value)) != 0:
            return None
    return Share("cuda", bytes(handle), region.addr - base.value, region.nbytes)


def _cuda_open(raw: bytes, device: int) -> int:
    """Map a CUDA IPC handle (64 bytes) on ``device``; the local base address."""
    if len(raw) != 64:
        raise TransportError(f"a CUDA IPC handle has 64 bytes, not {len(raw)}")
    cu = _driver()
    _current(device)
    handle = _IpcHandle()
    ctypes.memmove(ctypes.addressof(handle), raw, 64)
    ptr = ctypes.c_uint64()
    with _DRIVER_LOCK:
        _check(
            "cuIpcOpenMemHandle",
            cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, ctypes.c_uint(_LAZY_PEER_ACCESS)),
        )
    return int(ptr.value)


def _cuda_close(addr: int, device: int) -> None:
    """Unmap an opened handle (a refusal is logged: the mapping then stays)."""
    try:
        _current(device)
        with _DRIVER_LOCK:
            rc = _driver().cuIpcCloseMemHandle(ctypes.c_uint64(addr))
    except TransportError as exc:
        rc, why = -1, str(exc)
    else:
        why = f"CUresult {rc}"
    if rc != 0:
        log.warning("CUDA IPC mapping at %#x not closed: %s", addr, why)
