"""The side channel's security: ZeroMQ CURVE (CurveZMQ) under the HMAC-tagged frames.

CURVE encrypts, authenticates both ends before any frame is read, and makes no frame
replayable (per-session keys, a nonce per message). Keys come in three modes (shared
secret, explicit keys, per-instance identity: ``docs/security.md``); the HMAC tag stays as
a second check (``docs/faults.md``, "The side channel").
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85

from kvbridge.errors import ConfigError, IdentityError, KVBridgeError


def _key_pair(secret: bytes, label: bytes) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85-encoded Curve25519 keys derived from ``secret``."""
    raw = hashlib.blake2b(secret, digest_size=32, person=b"kvbridge-curve", salt=label).digest()
    sk = z85.encode(raw)
    return zmq.curve_public(sk), sk


@dataclass(frozen=True, slots=True)
class Keys:
    """CURVE keys of one deployment (Z85 text, 40 bytes each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed: frozenset[bytes]
    """Client public keys a server accepts."""
    engine_id: str = ""
    """Per-instance identity: this instance's engine id ("" in the other modes)."""
    peers: tuple[tuple[str, bytes], ...] = ()
    """Per-instance identity: ``(engine id, public key)`` of every peer instance (P: the
    D instances it serves; D: the P instances it loads from)."""

    def toward(self, engine_id: str) -> Keys:
        """The keys to connect to instance ``engine_id``'s server: with a per-instance
        identity, the server key bound to it (:class:`IdentityError` if none is)."""
        if not self.engine_id:
            return self
        key = dict(self.peers).get(engine_id)
        if key is None:
            raise IdentityError(
                f"no public key for instance {engine_id!r} among the peers of "
                f"{self.engine_id!r}: it cannot be authenticated, so it is not contacted"
            )
        return replace(self, server_public=key, server_secret=b"")

    def check_claim(self, claimed: str | None, user_id: str) -> None:
        """With a per-instance identity, ``claimed`` (the engine id a frame names, None
        if it names none) must be the one bound to the client key ``user_id`` (Z85 text,
        as ZAP reports it); :class:`IdentityError` otherwise."""
        if not self.engine_id or claimed is None:
            return
        bound = [eid for eid, key in self.peers if key == user_id.encode()]
        if bound != [claimed]:
            raise IdentityError(
                f"frame claims engine id {claimed!r} but came over the session of the key "
                f"bound to {bound[0] if bound else 'no instance'!r}"
            )

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question (as a server's authenticator): is client key ``key`` allowed?"""
        return key in self.allowed

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
        """Keys from a JSON file of Z85 text: a per-instance identity (``engine_id``,
        ``public``, ``secret``, ``peers``) or explicit keys (``server_*``, ``client_*``,
        ``allowed``; a side may leave out keys it does not need): ``docs/security.md``.
        A malformed file is a :class:`ConfigError` naming the field."""
        raw = _read(path)
        if "engine_id" in raw:
            return _identity(path, raw)
        unknown = set(raw) - {*KEY_FIELDS, "allowed"}
        if unknown:
            raise ConfigError(f"CURVE keys file {path}: unknown keys {sorted(unknown)}")
        vals = {k: _z85(path, k, raw.get(k, "")) for k in KEY_FIELDS}
        allowed = raw.get("allowed", [])
        if not isinstance(allowed, list):
            raise ConfigError(f"CURVE keys file {path}: allowed must be a list")
        if not vals["server_public"]:
            raise ConfigError(f"CURVE keys file {path}: server_public is required")
        spub, ssec, cpub, csec = (vals[k] for k in KEY_FIELDS)
        return Keys(spub, ssec, cpub, csec, frozenset(_z85(path, "allowed", k) for k in allowed))

    @staticmethod
    def new_identity(path: str | Path, engine_id: str) -> Keys:
        """Write a fresh identity for ``engine_id`` to ``path`` (mode 0600, no peers yet)
        and return it; :class:`ConfigError` if ``path`` exists (it is never overwritten)."""
        if not engine_id:
            raise ConfigError("an identity needs a non-empty engine id")
        pub, sec = zmq.curve_keypair()
        body = {"engine_id": engine_id, "public": pub.decode(), "secret": sec.decode(), "peers": {}}
        _write(Path(path), body, replace_file=False)
        return Keys.load(path)

    @staticmethod
    def add_peers(path: str | Path, peers: dict[str, str]) -> Keys:
        """Bind ``peers`` (engine id → public key, Z85 text) in the identity at ``path``
        (an engine id already listed gets the new key); the file is replaced atomically."""
        raw = _read(path)
        if "engine_id" not in raw:
            raise ConfigError(f"CURVE keys file {path}: not a per-instance identity")
        _identity(path, raw)
        raw["peers"] = {**raw["peers"], **peers}
        _identity(path, raw)
        _write(Path(path), raw, replace_file=True)
        return Keys.load(path)


KEY_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")
IDENTITY_FIELDS = ("engine_id", "public", "secret", "peers")


def _read(path: str | Path) -> dict[str, Any]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"CURVE keys file {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"CURVE keys file {path}: expected a JSON object")
    return raw


def _identity(path: str | Path, raw: dict[str, Any]) -> Keys:
    """A per-instance identity file, checked: the key pair matches, each peer key is
    bound to one engine id."""
    if set(raw) != set(IDENTITY_FIELDS):
        raise ConfigError(
            f"CURVE keys file {path}: an identity needs exactly {list(IDENTITY_FIELDS)}, "
            f"got {sorted(raw)}"
        )
    eid, peers = raw["engine_id"], raw["peers"]
    if not isinstance(eid, str) or not eid:
        raise ConfigError(f"CURVE keys file {path}: engine_id must be a non-empty string")
    if not isinstance(peers, dict):
        raise ConfigError(f"CURVE keys file {path}: peers must be an object (engine id → key)")
    pub, sec = _z85(path, "public", raw["public"]), _z85(path, "secret", raw["secret"])
    if not pub or not sec or zmq.curve_public(sec) != pub:
        raise ConfigError(f"CURVE keys file {path}: public is not the key of secret")
    bound = tuple(sorted((str(e), _z85(path, f"peers.{e}", k)) for e, k in peers.items()))
    keys = [k for _, k in bound]
    if b"" in keys or len(set(keys)) != len(keys):
        raise ConfigError(f"CURVE keys file {path}: each peer needs its own public key")
    return Keys(pub, sec, pub, sec, frozenset(keys), eid, bound)


def _write(path: Path, body: dict[str, Any], replace_file: bool) -> None:
    """Write ``body`` to a new file of a random name beside ``path`` (0600; created
    exclusively, never through a link someone planted) and move it there: readers never
    see half a file, and without ``replace_file`` an existing file is kept
    (:class:`ConfigError`)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    made = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        made = True
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
        if replace_file:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    except FileExistsError:
        why = " exists; not overwritten" if made else f": temporary file {tmp} exists"
        raise ConfigError(f"CURVE keys file {path}{why}") from None
    except OSError as e:
        raise ConfigError(f"CURVE keys file {path}: {e}") from None
    finally:
        if made:
            tmp.unlink(missing_ok=True)


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


def secure_server(ctx: zmq.Context[Any], sock: zmq.Socket[Any], keys: Keys) -> Any:
    """Make ``sock`` a CURVE server accepting only ``keys.allowed``; returns the ZAP
    authenticator (stop it when the context is done)."""
    if not keys.server_secret or not keys.server_public:
        raise ConfigError("a side-channel server needs server_public and server_secret")
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", keys)
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
