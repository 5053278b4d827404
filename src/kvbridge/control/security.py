"""The side channel's security: ZeroMQ CURVE (CurveZMQ) under the HMAC-tagged frames.

Why CURVE: it is ZeroMQ's own, reviewed mechanism (Curve25519 key exchange, per-session
ephemeral keys, nonces on every message; libsodium underneath), it is built into the
pyzmq wheels, and it gives what hand-made framing did not: confidentiality (P's NIXL
metadata and block tables are not readable on the wire), authentication of *both* ends
before any frame is read, and no replay — a frame recorded from one session is
rejected in that session (nonce) and in every other (different session keys), so a
captured push, ``begin`` or handshake cannot be played back.

Keys. By default both key pairs are derived from the deployment's shared secret
(BLAKE2b with a label, as Curve25519 secret keys), so a deployment that already
distributes one secret gets CURVE without new configuration, and the trust model is
that of the secret: whoever holds it may connect, nobody else can even complete a
session. Deployments that want per-instance keys give :class:`Keys` explicitly: the
server's key pair, a client key pair, and the allow-list of client public keys the
server accepts (checked by a ZAP handler before the session opens).

The HMAC tag on each frame stays (a second check, and the typed "authentication
failed" reply when a peer speaks CURVE with the right keys but signs with another
secret).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85

from kvbridge.errors import ConfigError, KVBridgeError


def _key_pair(secret: bytes, label: bytes) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85-encoded Curve25519 keys derived from ``secret``."""
    raw = hashlib.blake2b(secret, digest_size=32, person=b"kvbridge-curve", salt=label).digest()
    sk = z85.encode(raw)
    return zmq.curve_public(sk), sk


@dataclass(frozen=True)
class Keys:
    """CURVE keys of one deployment (Z85 text, 40 bytes each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed: frozenset[bytes]
    """Client public keys a server accepts."""

    @staticmethod
    def from_secret(secret: bytes) -> Keys:
        if not secret:
            raise KVBridgeError("the side channel needs a non-empty shared secret")
        if not zmq.has("curve"):
            raise KVBridgeError("this libzmq has no CURVE support (pyzmq wheels do)")
        spub, ssec = _key_pair(secret, b"server")
        cpub, csec = _key_pair(secret, b"client")
        return Keys(spub, ssec, cpub, csec, frozenset({cpub}))

    @staticmethod
    def load(path: str | Path) -> Keys:
        """Keys from a JSON file: ``server_public`` (every side), ``server_secret`` and
        ``allowed`` (a list of client public keys; P), ``client_public`` and
        ``client_secret`` (D). Z85 text as ``zmq.curve_keypair()`` makes it. A key a side
        does not need may be left out; a malformed one is a :class:`ConfigError`."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"CURVE keys file {path}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"CURVE keys file {path}: expected a JSON object")
        unknown = set(raw) - {*KEY_FIELDS, "allowed"}
        if unknown:
            raise ConfigError(f"CURVE keys file {path}: unknown keys {sorted(unknown)}")
        vals = {k: _z85(path, k, raw.get(k, "")) for k in KEY_FIELDS}
        allowed = raw.get("allowed", [])
        if not isinstance(allowed, list):
            raise ConfigError(f"CURVE keys file {path}: allowed must be a list")
        if not vals["server_public"]:
            raise ConfigError(f"CURVE keys file {path}: server_public is required")
        return Keys(**vals, allowed=frozenset(_z85(path, "allowed", k) for k in allowed))


KEY_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


def _z85(path: str | Path, name: str, value: object) -> bytes:
    if value == "":
        return b""
    if not isinstance(value, str) or len(value) != 40:
        raise ConfigError(f"CURVE keys file {path}: {name} must be 40 characters of Z85 text")
    try:
        z85.decode(value)
    except (ValueError, KeyError):
        raise ConfigError(f"CURVE keys file {path}: {name} is not Z85 text") from None
    return value.encode()


class _AllowList:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def secure_server(ctx: zmq.Context[Any], sock: zmq.Socket[Any], keys: Keys) -> Any:
    """Make ``sock`` a CURVE server accepting only ``keys.allowed``; returns the ZAP
    authenticator (stop it when the context is done)."""
    if not keys.server_secret or not keys.server_public:
        raise ConfigError("a side-channel server needs server_public and server_secret")
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _AllowList(keys.allowed))
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    return auth


def secure_client(sock: zmq.Socket[Any], keys: Keys) -> None:
    """Make ``sock`` a CURVE client of a server holding ``keys.server_secret``."""
    if not (keys.server_public and keys.client_public and keys.client_secret):
        raise ConfigError(
            "a side-channel client needs server_public, client_public and client_secret"
        )
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
