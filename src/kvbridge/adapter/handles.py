"""The handle codec: a :class:`TransferHandle` as text in a request's transfer params
(``{HANDLE_KEY: text}``, base64 of its bytes) or as bytes, and D's prompt check."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from kvbridge.api import KVBridgeError, PeerError, TransferHandle

HANDLE_KEY = "kvbridge"
"""The ``kv_transfer_params`` key that carries the transfer handle from P to D."""


def encode_handle(handle: TransferHandle) -> str:
    return base64.b64encode(handle.to_bytes()).decode()


def decode_handle(data: Any) -> TransferHandle:
    """The handle of ``kv_transfer_params["kvbridge"]`` (text) or of its bytes;
    :class:`PeerError` if malformed."""
    if isinstance(data, bytes):
        return TransferHandle.from_bytes(data)
    if not isinstance(data, str):
        raise PeerError(f"kv_transfer_params.{HANDLE_KEY} is {type(data).__name__}, not str")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:
        raise PeerError(f"kv_transfer_params.{HANDLE_KEY} is not base64: {e}") from None
    return TransferHandle.from_bytes(raw)


def refusal(data: str | bytes | TransferHandle, prompt: Sequence[int] | None) -> str:
    """Why D must not load the handle ``data`` (or the one decoded from it) for
    ``prompt``, "" if it may: the handle holds the KV of other prompt tokens
    (:meth:`TransferHandle.check_prompt`; nothing is checked without a prompt, e.g. one
    given as embeddings). A malformed handle is left to the load, which reports it."""
    try:
        handle = data if isinstance(data, TransferHandle) else decode_handle(data)
    except KVBridgeError:
        return ""
    try:
        handle.check_prompt(prompt)
    except KVBridgeError as e:  # never raise into an engine's scheduler
        return str(e)
    return ""
