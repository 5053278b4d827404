"""The side channel: a ZMQ ROUTER server thread on P, REQ-style clients on D, both
over CURVE (:mod:`kvbridge.control.security`): encrypted, both ends authenticated,
no frame replayable.

The server answers every frame with exactly one frame; a frame it cannot authenticate
or decode gets an :class:`ErrorReply` and the server goes on serving other peers.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbridge.control.messages import MAX_FRAME, ErrorReply, Message, seal, unseal
from kvbridge.control.security import Keys, secure_client, secure_server
from kvbridge.errors import ConfigError, KVBridgeError, PeerError, TransportError

log = logging.getLogger(__name__)
Handler = Callable[[Message], Message]


class Server:
    """Serves ``handler`` on ``tcp://host:port`` (port 0: any free port); ``keys``: CURVE
    keys (default: derived from ``secret``). :attr:`endpoint` is what peers connect to:
    ``advertise`` (an address or name of this host they can reach), else ``host``; a
    wildcard ``host`` (``0.0.0.0``, ``*``, ``::``) without ``advertise`` advertises the
    address of the interface that routes outward (:func:`reachable_address`)."""

    def __init__(
        self,
        handler: Handler,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        keys: Keys | None = None,
        advertise: str = "",
    ):
        self.handler, self.secret, self.keys = handler, secret, keys or Keys.from_secret(secret)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._auth: Any = None
        try:
            self._auth = secure_server(self._ctx, self._sock, self.keys)
            self._sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
            if ":" in host and host != "*":
                self._sock.setsockopt(zmq.IPV6, 1)
            if port:
                self._sock.bind(f"tcp://{_bracket(host)}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{_bracket(host)}")
            shown = advertise or (reachable_address() if host in WILDCARDS else host)
            self.endpoint = f"tcp://{_bracket(shown)}:{port}"
        except BaseException as e:
            self._sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            if isinstance(e, zmq.ZMQError):
                raise TransportError(f"side channel cannot bind {host}:{port}: {e}") from None
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="kvbridge-sidechannel", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self._sock.recv_multipart(copy=False)
            user = str(frames[-1].get("User-Id"))  # the client's key, as ZAP accepted it
            parts = [f.bytes for f in frames]
            if len(parts) == 3 and parts[1] == b"":
                reply = self._answer(parts[2], user)
            else:  # not a REQ envelope: answered on the route it came by, if any
                n = [len(p) for p in parts[1:]]
                reply = ErrorReply("PeerError", f"malformed envelope: {len(parts) - 1} parts {n}")
            with contextlib.suppress(zmq.ZMQError):  # the peer may be gone already
                self._sock.send_multipart([parts[0], b"", seal(reply, self.secret)])
        self._sock.close(0)

    def _answer(self, frame: bytes, user: str) -> Message:
        """The handler's reply to ``frame``, sent by the client key ``user`` (Z85)."""
        try:
            msg = unseal(frame, self.secret)
            self.keys.check_claim(getattr(msg, "d_engine", None), user)  # any claim field
            return self.handler(msg)
        except KVBridgeError as e:
            return ErrorReply(type(e).__name__, str(e))
        except Exception as e:  # a handler bug must not take the channel down
            log.exception("side channel handler failed")
            return ErrorReply("InternalError", f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._auth.stop()
        self._ctx.term()


WILDCARDS = ("0.0.0.0", "*", "::", "")
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def reachable_address() -> str:
    """This host's address on the interface that routes outward (a UDP socket is
    connected, nothing is sent); :class:`ConfigError` where no route exists."""
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                return str(s.getsockname()[0])
        except OSError:
            continue
    raise ConfigError(
        "bound to a wildcard address but no route leaves this host: give an advertised "
        "address (the one peers should connect to)"
    )


class Client:
    """Blocking request/reply to one endpoint with a timeout; thread-safe (calls take
    turns). A call that waited its turn behind a call that timed out fails at once with
    the same :class:`TransportError` rather than waiting out a timeout of its own (and so
    does one whose caller's work was queued before that timeout: ``since``): when P is
    down, the loads queued for it fail within one timeout, not one each."""

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        timeout_s: float = 5.0,
        keys: Keys | None = None,
        server: str = "",
    ):
        """``server``: the engine id serving ``endpoint`` (its key: :meth:`Keys.toward`)."""
        self.endpoint, self.secret, self.server = endpoint, secret, server
        self.keys = keys or Keys.from_secret(secret)
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._closed = False
        self._timed_out_at = -float("inf")

    def sibling(self, endpoint: str, timeout_s: float | None = None) -> Client:
        """A client of ``endpoint``, another channel of the same server instance (one of
        its ranks'), with this one's secret and keys (and timeout unless ``timeout_s``)."""
        timeout = self.timeout_ms / 1000 if timeout_s is None else timeout_s
        return Client(endpoint, self.secret, timeout, self.keys, self.server)

    def _socket(self) -> tuple[zmq.Socket, zmq.Socket]:
        if self._closed:
            raise TransportError(f"side channel to {self.endpoint} is closed")
        if self._sock is None or self._mon is None:
            self._sock = s = self._ctx.socket(zmq.REQ)
            with self._failing():
                s.setsockopt(zmq.LINGER, 0)
                secure_client(s, self.keys.toward(self.server) if self.server else self.keys)
                s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
                s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
                s.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
                self._mon = s.get_monitor_socket(HANDSHAKE_FAILED)
                s.connect(self.endpoint)
        else:  # events of an earlier connection must not fail this call
            with contextlib.suppress(zmq.Again):
                while True:
                    self._mon.recv_multipart(zmq.NOBLOCK)
        return self._sock, self._mon

    def _recv(self, sock: zmq.Socket, mon: zmq.Socket) -> bytes:
        """The reply, or :class:`PeerError` as soon as the CURVE handshake is refused
        (keys or secret differ) instead of waiting out the timeout; ``zmq.Again``."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout_ms / 1000
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1000))))
            if sock in ready:
                return bytes(sock.recv())
            if mon in ready:
                event = zmq.Event(recv_monitor_message(mon)["event"])
                raise PeerError(
                    f"side channel {self.endpoint}: CURVE handshake failed ({event.name}): "
                    "this side's keys or secret are not the server's, or the connection "
                    "dropped during the handshake"
                )
        raise zmq.Again()

    def call(self, msg: Message, since: float | None = None) -> Message:
        """Send ``msg``, return the reply; an :class:`ErrorReply` is raised as PeerError.
        ``since`` (``time.monotonic()``, default now): fail at once if a call to this
        endpoint timed out after it (no success in between)."""
        return self.send(msg, since)()

    def send(self, msg: Message, since: float | None = None) -> Callable[[], Message]:
        """:meth:`call` in two halves: send ``msg`` now, return what waits for the reply
        (the caller works while P answers). This client's other callers wait until it was
        called: call it exactly once and soon, in a ``finally`` (a second call raises)."""
        frame = seal(msg, self.secret)
        if len(frame) > MAX_FRAME:
            raise PeerError(
                f"{type(msg).__name__} of {len(frame)} B exceeds the {MAX_FRAME}-byte frame "
                f"limit; not sent to {self.endpoint}"
            )
        asked = time.monotonic() if since is None else since
        self._lock.acquire()
        return self._send_locked(frame, asked)

    def try_send(self, msg: Message) -> Callable[[], Message] | None:
        """:meth:`send` if no other call is in flight on this client, else None at once
        (nothing sent): for a caller that must not wait, such as an engine's thread."""
        frame = seal(msg, self.secret)
        if len(frame) > MAX_FRAME or not self._lock.acquire(blocking=False):
            return None
        return self._send_locked(frame, time.monotonic())

    def _send_locked(self, frame: bytes, asked: float) -> Callable[[], Message]:
        """Send ``frame`` under the lock the caller acquired; released by the reply (or
        here, if sending failed)."""
        try:
            if self._timed_out_at >= asked:
                raise TransportError(
                    f"side channel {self.endpoint}: a call made while this one waited got no "
                    f"reply within {self.timeout_ms} ms (P down or unreachable)"
                )
            sock, mon = self._socket()
            with self._failing():
                sock.send(frame)
        except BaseException:
            self._lock.release()
            raise
        taken = threading.Event()

        def reply() -> Message:  # releases the lock: once only
            if taken.is_set():
                raise RuntimeError(f"the reply of a call to {self.endpoint} was taken twice")
            taken.set()
            return self._reply(sock, mon)

        return reply

    def _reply(self, sock: zmq.Socket, mon: zmq.Socket) -> Message:
        try:
            with self._failing():
                frame = self._recv(sock, mon)
            self._timed_out_at = -float("inf")  # P answers again
        finally:
            self._lock.release()
        reply = unseal(frame, self.secret)
        if isinstance(reply, ErrorReply):
            raise PeerError(f"{self.endpoint} refused: {reply.kind}: {reply.message}")
        return reply

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """zmq's errors as ours; on any error the socket is dropped (a REQ socket that
        failed mid-call cannot send again)."""
        try:
            yield
        except zmq.Again:
            self._reset()
            self._timed_out_at = time.monotonic()
            raise TransportError(
                f"side channel {self.endpoint}: no reply within {self.timeout_ms} ms "
                "(P down or unreachable, or no CURVE session: keys or secret differ)"
            ) from None
        except zmq.ZMQError as e:
            self._reset()
            raise TransportError(f"side channel {self.endpoint}: {e}") from None
        except BaseException:
            self._reset()
            raise

    def _reset(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._sock.close(0)
            self._sock = None
        if self._mon is not None:
            self._mon.close(0)
            self._mon = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._reset()
