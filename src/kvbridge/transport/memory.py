"""Torch access to registered memory, wherever it lives: the device code paths.

A region is host memory or a GPU's (:class:`~kvbridge.layout.tensor.MemKind`, CUDA
ordinal ``device``). :func:`byte_tensor` gives a 1-D ``uint8`` tensor over
``[addr, addr + nbytes)`` without copying: a CPU tensor for host memory, a ``cuda:<device>``
tensor (through ``__cuda_array_interface__``) for device memory. Device copies, staging and
the loopback transport's device moves all go through it, so they run the same torch code on
a GPU and, in CI, on the CPU.

A machine without a CUDA device has no device memory. There, and only when
``KVBRIDGE_DEVICE_ON_CPU=1`` (:func:`kvbridge.envs.device_on_cpu`), a region said to be
device memory is host memory reached through torch CPU tensors: how the test suite runs
every device code path without a GPU. Otherwise device regions are refused, with the reason.
"""

from __future__ import annotations

import ctypes
import functools

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


class _CudaBytes:
    """What ``torch.as_tensor`` needs to see raw device memory as a ``uint8`` vector."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
            "strides": None,
        }


def byte_tensor(region: Region) -> torch.Tensor:
    """A ``uint8`` tensor of ``region.nbytes`` bytes aliasing ``region`` (no copy).

    The caller keeps the memory alive while the tensor is used."""
    dev = torch_device(region.kind, region.device)
    if region.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    if dev.type == "cuda":
        t = torch.as_tensor(_CudaBytes(region.addr, region.nbytes), device=dev)
        if t.data_ptr() != region.addr or t.device != dev:  # a copy, not the memory itself
            raise TransportError(
                f"torch made a copy of {region.addr:#x} +{region.nbytes} B on {t.device}, "
                f"not a view on {dev}"
            )
        return t
    buf = (ctypes.c_uint8 * region.nbytes).from_address(region.addr)
    return torch.frombuffer(buf, dtype=torch.uint8)
