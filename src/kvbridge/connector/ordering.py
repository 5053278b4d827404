"""Ordering with the engine's streams, P side: a request's KV must be complete before
any byte of it may move.

A GPU engine writes KV asynchronously (kernels queued on its stream); D may read P's
blocks (pull, the kernel mover) or P may write them (push) as soon as the handle is out.
So P's engine calls :meth:`~kvbridge.connector.producer.ProducerWorker.written` with an
event recorded after its last KV write of a step, and hands out the step's handles only
after it returned. D's side needs no call: every mover returns only once its bytes and
kernels completed. Without this rule a transfer can copy blocks a kernel is still
writing (public reports: vLLM PR 48481, Mamba state under async scheduling; SGLang PR
33970, a needle test corrupted at a chunk boundary).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from kvbridge.errors import TransferTimeout
from kvbridge.layout.tensor import MemKind
from kvbridge.transport.memory import torch_device


class Event(Protocol):
    """What ``written`` waits on: ``torch.cuda.Event`` has it (``query()``: done yet)."""

    def query(self) -> bool: ...


def wait_written(event: Event | None, kind: MemKind, device: int, timeout_s: float = 10.0) -> None:
    """Return once ``event`` completed (None: everything queued so far on the device's
    current stream; host memory: nothing to wait for); :class:`TransferTimeout` after
    ``timeout_s`` (polled every 50 µs → 1 ms, never blocking without a deadline)."""
    if event is None:
        on = torch_device(kind, device) if kind is not MemKind.HOST else None
        if on is None or on.type != "cuda":
            return
        cuda_event = torch.cuda.Event()
        cuda_event.record(torch.cuda.current_stream(on))
        event = cuda_event
    deadline, pause = time.monotonic() + timeout_s, 50e-6
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferTimeout(f"KV writes not complete after {timeout_s} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
