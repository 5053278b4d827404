"""Torch access to registered memory, wherever it lives: the device code paths.

:func:`byte_tensor` views a region as a ``uint8`` tensor without copying (CPU for host
memory, ``cuda:<device>`` for device memory); device copies, staging and the loopback
transport's device moves all go through it. Without a CUDA device, and only when
``KVBRIDGE_DEVICE_ON_CPU=1``, device memory is host memory reached through CPU tensors (how
the tests run every device path without a GPU); otherwise device regions are refused.
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace

import torch

from kvbridge import envs
from kvbridge.errors import TransportError
from kvbridge.layout.tensor import MemKind, Region

__all__ = ["byte_tensor", "cuda_available", "torch_device"]


@functools.cache
def cuda_available() -> bool:
    """Whether this process can use a CUDA device (cached: initialising CUDA is slow)."""
    return bool(torch.cuda.is_available())


def torch_device(kind: MemKind, device: int = 0) -> torch.device:
    """Where torch must run copies of memory of ``kind`` on GPU ``device``.

    :class:`TransportError` for device memory on a machine without CUDA (unless
    emulated, see the module docstring) or a GPU index this process cannot see."""
    if kind is MemKind.HOST:
        return torch.device("cpu")
    if cuda_available():
        count = torch.cuda.device_count()
        if device >= count:
            raise TransportError(f"device memory on GPU {device}: this process sees {count}")
        return torch.device("cuda", device)
    if envs.device_on_cpu():
        return torch.device("cpu")
    raise TransportError(
        f"device memory on GPU {device}, but this machine has no CUDA device "
        "(KVBRIDGE_DEVICE_ON_CPU=1 runs the device paths on host memory, for tests)"
    )


def byte_tensor(region: Region) -> torch.Tensor:
    """A ``uint8`` tensor of ``region.nbytes`` bytes aliasing ``region`` (no copy).

    The caller keeps the memory alive while the tensor is used."""
    dev = torch_device(region.kind, region.device)
    if region.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    if dev.type == "cuda":
        raw = {"shape": (region.nbytes,), "typestr": "|u1", "data": (region.addr, False)}
        interface = {**raw, "version": 3, "strides": None}  # what torch reads device bytes by
        t = torch.as_tensor(SimpleNamespace(__cuda_array_interface__=interface), device=dev)
        if t.data_ptr() != region.addr or t.device != dev:  # a copy, not the memory itself
            raise TransportError(
                f"torch made a copy of {region.addr:#x} +{region.nbytes} B on {t.device}, "
                f"not a view on {dev}"
            )
        return t
    buf = (ctypes.c_uint8 * region.nbytes).from_address(region.addr)
    return torch.frombuffer(buf, dtype=torch.uint8)
