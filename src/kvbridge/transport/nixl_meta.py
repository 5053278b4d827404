"""The checked envelope around a NIXL agent's metadata, and where its memory is.

The envelope (:func:`seal`): header (magic+version, name and blob lengths), name, NIXL
blob, the agent's region table (``(addr, nbytes, kind code, device)`` uint64 rows: which
segment type and device a descriptor into its memory names), BLAKE2b digest. A damaged
one is refused (:func:`unseal`) before NIXL sees it: a blob a byte short half-loads and
the name stays unusable in this process (NIXL_ERR_INVALID_PARAM even after removal).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from kvbridge.errors import PeerError, TransportError
from kvbridge.layout.tensor import MemKind, Region

KIND_CODE = {MemKind.HOST: 0, MemKind.DEVICE: 1}
_MAGIC = b"KVBNIXL2"
_HEAD = struct.Struct("<8sHI")
_DIGEST_BYTES = 16
_ROW = 4 * 8


def seal(name: str, blob: bytes, table: np.ndarray) -> bytes:
    """Wrap NIXL metadata ``blob`` of agent ``name`` and its region ``table`` (N, 4)."""
    raw_name = name.encode()
    body = _HEAD.pack(_MAGIC, len(raw_name), len(blob)) + raw_name + blob
    body += table.astype("<u8").tobytes()
    return body + hashlib.blake2b(body, digest_size=_DIGEST_BYTES).digest()


def unseal(data: object) -> tuple[str, bytes, np.ndarray]:
    """``(agent name, NIXL blob, region table)``; :class:`PeerError` if damaged."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PeerError(f"peer metadata must be bytes, got {type(data).__name__}")
    md = bytes(data)
    if len(md) < _HEAD.size + _DIGEST_BYTES or not md.startswith(_MAGIC):
        raise PeerError(f"not kvbridge NIXL metadata ({len(md)} B, head {md[:16]!r})")
    _, name_len, blob_len = _HEAD.unpack_from(md)
    blob_end = _HEAD.size + name_len + blob_len
    body_len = len(md) - _DIGEST_BYTES
    if body_len < blob_end or (body_len - blob_end) % _ROW:
        raise PeerError(f"peer metadata is {len(md)} B, its header says {blob_end + 16} B + rows")
    if hashlib.blake2b(md[:body_len], digest_size=_DIGEST_BYTES).digest() != md[body_len:]:
        raise PeerError(f"peer metadata ({len(md)} B) fails its digest check")
    try:
        name = md[_HEAD.size : _HEAD.size + name_len].decode()
    except UnicodeDecodeError as exc:
        raise PeerError(f"peer name is not UTF-8: {exc}") from exc
    table = np.frombuffer(md[blob_end:body_len], dtype="<u8").reshape(-1, 4).astype(np.uint64)
    if table.size and int(table[:, 2].max()) >= len(KIND_CODE):
        raise PeerError(f"peer {name!r} names an unknown memory kind {int(table[:, 2].max())}")
    return name, md[_HEAD.size + name_len : blob_end], table


class Places:
    """Where an agent's registered memory is: sorted region starts with their kind and
    device, to name the segment type and device of each descriptor."""

    def __init__(self, table: np.ndarray):
        order = np.argsort(table[:, 0], kind="stable") if table.size else np.zeros(0, np.int64)
        self.table = table[order].reshape(-1, 4).astype(np.uint64)

    def add(self, regions: list[Region]) -> Places:
        rows = [(r.addr, r.nbytes, KIND_CODE[r.kind], r.device) for r in regions]
        return Places(np.concatenate([self.table, np.array(rows, np.uint64).reshape(-1, 4)]))

    def kind_devs(self, addrs: np.ndarray, what: str) -> tuple[MemKind, np.ndarray]:
        """The memory kind of runs starting at ``addrs`` and each run's device.

        A start in no region is described as host memory (NIXL then refuses it as
        outside registered memory); runs of one post must share one kind."""
        t = self.table
        if not t.size:
            return MemKind.HOST, np.zeros(addrs.shape[0], np.uint64)
        idx = np.searchsorted(t[:, 0], addrs, side="right").astype(np.int64) - 1
        inside = idx >= 0
        inside[inside] = addrs[inside] < t[idx[inside], 0] + t[idx[inside], 1]
        codes = np.where(inside, t[np.maximum(idx, 0), 2], 0)
        devs = np.where(inside, t[np.maximum(idx, 0), 3], 0)
        kinds = np.unique(codes[inside])
        if kinds.shape[0] > 1:
            raise TransportError(f"{what} runs lie in host and device memory: post them apart")
        kind = MemKind.DEVICE if kinds.shape[0] and int(kinds[0]) == 1 else MemKind.HOST
        return kind, devs.astype(np.uint64)
