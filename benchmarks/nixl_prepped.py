"""Prepared NIXL lists (``prep_xfer_dlist``, ``make_prepped_xfer``) for the trace bench:
the vLLM-like path and the ``prep``/``strided`` methods post READs through these."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbridge.errors import TransportError
from kvbridge.transport.nixl import _CAUGHT, NixlTransport, NixlXferHandle


def prep(transport: NixlTransport, peer: str, rows: np.ndarray, mem: str = "DRAM") -> Any:
    """NIXL list of uint64 rows (addr, len, dev[, stride, count]) of ``mem`` ("DRAM" or
    "VRAM"); ``peer`` "": own memory."""
    try:
        return transport._check_open().prep_xfer_dlist(peer, rows, mem)
    except _CAUGHT as exc:
        raise TransportError(f"cannot prepare {len(rows)} rows for {peer!r}: {exc!r}") from exc


def read_prepped(
    transport: NixlTransport, peer: str, lists: Any, idx: Any, nbytes: int
) -> NixlXferHandle:
    """READ runs ``idx[1]`` of the peer's list ``lists[1]`` (from :func:`prep`) to runs
    ``idx[0]`` of ``lists[0]`` (int32 indices); ``nbytes``: their total."""
    try:
        xfer = transport._check_open().make_prepped_xfer("READ", lists[0], idx[0], lists[1], idx[1])
    except _CAUGHT as exc:
        raise TransportError(f"prepped READ of {len(idx[0])} runs refused: {exc!r}") from exc
    return transport._start("READ", xfer, peer, len(idx[0]), nbytes)
