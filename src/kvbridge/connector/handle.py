"""The handle P returns after prefill; the router forwards it to D unchanged."""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

import msgspec
import numpy as np

from kvbridge.errors import PeerError, PlanError, PromptMismatch

Tokens = Sequence[int] | np.ndarray
"""Token ids: a list (as vLLM keeps a prompt) or a 1-D integer array."""


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
    prompt_digest: bytes = b""
    """:func:`prompt_digest` of the ``n_tokens`` prompt tokens whose KV P holds; empty
    when P's engine gave no tokens."""

    def check_prompt(self, prompt: Tokens | None, required: bool = False) -> None:
        """:class:`PromptMismatch` unless the first ``n_tokens`` of ``prompt`` (the tokens
        D decodes from; later ones are D's own) are the ones this handle's KV belongs to.
        Without a digest or a ``prompt`` nothing is checked, unless ``required``."""
        if not self.prompt_digest or prompt is None:
            if required:
                lacks = "a prompt digest" if not self.prompt_digest else "D's prompt"
                raise PromptMismatch(f"handle of {self.request_id!r}: no check without {lacks}")
            return
        raw = _int32(prompt)
        if len(raw) // 4 < self.n_tokens:
            raise PromptMismatch(
                f"handle of {self.request_id!r} holds {self.n_tokens} prompt tokens, "
                f"D's prompt has {len(raw) // 4}"
            )
        got = _digest(raw, self.n_tokens)
        if got != self.prompt_digest:
            raise PromptMismatch(
                f"handle of {self.request_id!r} holds the KV of another prompt: digest of its "
                f"{self.n_tokens} tokens {self.prompt_digest.hex()}, D's {got.hex()}"
            )

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def from_bytes(data: bytes) -> TransferHandle:
        try:
            return msgspec.msgpack.decode(data, type=TransferHandle)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise PeerError(f"malformed transfer handle: {e}") from None
        except RecursionError:  # msgspec recurses skipping an unknown field's value
            raise PeerError("malformed transfer handle: nested too deeply") from None


_DOMAIN = b"kvbridge prompt, int32 little-endian"
assert array.array("i").itemsize == 4, "C int is not 32 bits here"


def prompt_digest(prompt: Tokens, n_tokens: int) -> bytes:
    """16 bytes: SHA-256 of the first ``n_tokens`` token ids as little-endian int32.

    The same ids give the same digest whatever holds them (list, any integer array).
    :class:`PlanError` if ``prompt`` is not 1-D integers within int32 (``1.0``, ``"1"``
    and ``2**31`` are refused) or has fewer than ``n_tokens``. About 1 ms for a list of
    32k ints, mostly reading the list (``benchmarks/bench_prompt_digest.py``)."""
    raw = _int32(prompt)
    if not 0 <= n_tokens <= len(raw) // 4:
        raise PlanError(f"digest of {n_tokens} tokens asked of a prompt of {len(raw) // 4}")
    return _digest(raw, n_tokens)


def _digest(raw: memoryview, n_tokens: int) -> bytes:
    h = hashlib.sha256(_DOMAIN)
    h.update(raw[: 4 * n_tokens])
    return h.digest()[:16]


def _int32(prompt: object) -> memoryview:
    """The bytes of ``prompt`` as contiguous little-endian int32 (copied only where they
    must be)."""
    if not isinstance(prompt, np.ndarray) and not hasattr(prompt, "__array__"):
        if not isinstance(prompt, Sequence) or isinstance(prompt, str | bytes):
            raise PlanError(f"a prompt is a sequence of token ids, not {type(prompt).__name__}")
        try:
            ids = array.array("i", prompt)  # ints only: floats and strings raise TypeError
        except (TypeError, OverflowError) as e:
            raise PlanError(f"prompt token ids must be int32 integers: {e}") from None
        if sys.byteorder == "big":
            ids.byteswap()
        return memoryview(ids).cast("B")
    arr = np.asarray(prompt)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise PlanError(f"prompt token ids as a {arr.dtype} array of shape {arr.shape}")
    if arr.dtype != np.dtype("<i4") and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -(1 << 31) or hi >= 1 << 31:
            raise PlanError(f"prompt token ids must be int32 integers, got {lo}..{hi}")
    return np.ascontiguousarray(arr, dtype="<i4").view(np.uint8).data
