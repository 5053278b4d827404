"""The engine's error. It lives here because the engine sits on top of kvbridge."""

from __future__ import annotations

from kvbridge.api import KVBridgeError


class EngineError(KVBridgeError):
    """The reference engine was misused or a rank failed; the message says which and why."""
