"""The handle P returns after prefill; the router forwards it to D unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from kvbridge.errors import PeerError, PlanError


class TransferHandle(msgspec.Struct, frozen=True):
    engine_id: str
    endpoint: str
    """P's side channel, ``tcp://host:port``."""
    epoch: str
    request_id: str
    lease_id: str
    n_tokens: int
    block_tables: list[list[int]]
    """P block ids per group covering tokens ``[0, n_tokens)`` (state groups: one slot)."""
    payload: bytes = b""
    """Engine data that travels with the handle (e.g. the first sampled token)."""

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def from_bytes(data: bytes) -> TransferHandle:
        try:
            return msgspec.msgpack.decode(data, type=TransferHandle)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise PeerError(f"malformed transfer handle: {e}") from None


def checked_tables(tables: object, num_blocks: Sequence[int], who: str) -> list[list[int]]:
    """``tables`` as one list of block ids per group, each id an integer in
    ``[0, num_blocks[g])``; :class:`PlanError` naming the first offending value
    otherwise. Nothing is coerced: ``0.9``, ``"3"`` and ``True`` are refused, not read
    as blocks 0, 3 and 1. Lists of ints and 1-D integer numpy arrays are accepted."""
    if not isinstance(tables, Sequence | np.ndarray) or len(tables) != len(num_blocks):
        got = len(tables) if isinstance(tables, Sequence | np.ndarray) else type(tables).__name__
        raise PlanError(f"{who}: need {len(num_blocks)} block tables (one per group), got {got}")
    out = []
    for g, (t, limit) in enumerate(zip(tables, num_blocks, strict=True)):
        if isinstance(t, np.ndarray):
            if t.ndim != 1 or t.dtype.kind not in "iu":
                raise PlanError(f"{who}: table {g} is a {t.dtype} array of shape {t.shape}")
            ids = t.tolist()
        elif isinstance(t, Sequence) and not isinstance(t, str | bytes):
            ids = [int(x) if isinstance(x, np.integer) else x for x in t]
            odd = [x for x in ids if type(x) is not int][:1]
            if odd:
                bad = odd[0]
                raise PlanError(
                    f"{who}: table {g} holds {bad!r} ({type(bad).__name__}), not a block id"
                )
        else:
            raise PlanError(f"{who}: table {g} is a {type(t).__name__}, not a list of block ids")
        if ids and not (min(ids) >= 0 and max(ids) < limit):
            worst = min(ids) if min(ids) < 0 else max(ids)
            raise PlanError(f"{who}: table {g} holds block {worst}, outside [0, {limit})")
        out.append(ids)
    return out
