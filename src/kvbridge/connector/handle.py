"""The handle P returns after prefill; the router forwards it to D unchanged."""

from __future__ import annotations

import msgspec

from kvbridge.errors import PeerError


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
