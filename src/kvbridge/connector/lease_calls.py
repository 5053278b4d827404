"""A D rank's side of the lease protocol (:mod:`kvbridge.control.lease`): its identity
(engine id, epoch, rank, world), the token each ``begin`` reply gives, and the calls
that carry them (``confirm``, ``fail``, ``renew``; a token-less one only for a rank that
never began)."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable

from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.load import _Load
from kvbridge.connector.peers import Peer, PeerCache
from kvbridge.control.channel import Client
from kvbridge.control.messages import LeaseOp, LeaseOpName, LeaseReply, Message
from kvbridge.errors import KVBridgeError, LeaseExpired, PeerError

log = logging.getLogger(__name__)


class LeaseCalls:
    def __init__(
        self,
        engine_id: str,
        rank: int,
        world: int,
        peers: PeerCache,
        secret: bytes,
        timeout_s: float,
    ):
        self.epoch = secrets.token_hex(8)
        """Names this D rank's start at P (with the engine id and rank)."""
        self.who = (engine_id, self.epoch, rank, world)
        self.peers, self.secret, self.timeout_s = peers, secret, timeout_s
        self._turn = threading.Condition()
        self._renewing: _Load | None = None
        """The load whose token-less renew is in flight (its ``begin`` waits for it)."""

    def op(self, job: _Load, op: LeaseOpName) -> LeaseOp:
        """``op``'s message; a ``begin`` waits until no token-less renew of ``job`` is in
        flight (P would refuse one that arrived after the ``begin``)."""
        if op == "begin":
            with self._turn:
                self._turn.wait_for(lambda: self._renewing is not job)
        (engine, epoch, rank, world), h = self.who, job.handle
        token = job.token  # its ``begin`` reply's ("" before it began)
        return LeaseOp(op, h.request_id, h.lease_id, job.digest, engine, rank, world, epoch, token)

    def call(
        self, peer: Peer | Client, job: _Load, op: LeaseOpName, since: float | None = None
    ) -> LeaseReply:
        client = peer if isinstance(peer, Client) else peer.client
        return checked_reply(job.handle, op, client.call(self.op(job, op), since))

    def begin(self, peer: Peer, job: _Load) -> Answer:
        """Send ``job``'s ``begin`` (``since`` its queue time); P's answer, to take later
        (the peer's channel stays locked until it is taken: take it soon)."""
        return Answer(peer.client.send(self.op(job, "begin"), since=job.queued), self, job)

    def try_begin(self, peer: Peer, job: _Load) -> Answer | None:
        """:meth:`begin` over the peer's ``fast`` channel, from a thread that must not
        wait (the engine's: :meth:`Consumer.load`'s inline start): None at once, nothing
        sent, where it would wait (a token-less renew of ``job`` in flight, the channel
        busy) or could not send. ``job.peer`` is set from here on (no renew starts)."""
        assert peer.fast is not None
        with self._turn:
            if self._renewing is job:
                return None
            job.peer = peer
        (engine, epoch, rank, world), h = self.who, job.handle
        op = LeaseOp("begin", h.request_id, h.lease_id, job.digest, engine, rank, world, epoch, "")
        reply = None
        try:
            reply = peer.fast.try_send(op)
        except KVBridgeError:  # the queued load meets it again, typed
            pass
        finally:
            if reply is None:
                with self._turn:
                    job.peer = None
        return None if reply is None else Answer(reply, self, job)

    def begun(self, job: _Load, reply: Message) -> float:
        """P's ``begin`` reply checked, its token kept for the rank's later ops → seconds
        the lease has left."""
        if isinstance(reply, LeaseReply):
            job.token, job.refused = reply.token, reply.state in ("refused", "foreign")
        return checked_reply(job.handle, "begin", reply).remaining_s

    def release(self, job: _Load, op: LeaseOpName = "confirm") -> None:
        """``op`` without a token: this rank needs no bytes (``confirm``) or refused the
        load before it began (``fail``); P accepts it only while the rank has not begun."""
        try:
            peer = self.peers.get(job.handle)
            try:
                self.call(peer, job, op)
            finally:
                self.peers.done(peer)
        except KVBridgeError as e:
            log.warning("%s of %s at P failed: %s", op, job.handle.request_id, e)

    def confirm_later(self, peer: Peer, job: _Load, since: float) -> None:
        """``since``: its queue time (behind a call that timed out, it fails at once)."""
        try:
            self.call(peer, job, "confirm", since=since)
        except KVBridgeError as e:  # P frees at lease expiry instead
            log.warning("confirming %s at P failed: %s", job.handle.request_id, e)
        finally:
            self.peers.done(peer)

    def report_failure(self, job: _Load) -> None:
        """``fail`` with the ``begin`` token (none if P never answered it: then accepted
        only if P saw no ``begin`` of this rank); nothing if P refused the ``begin``."""
        peer = self.peers.known(job.handle)
        with contextlib.suppress(KVBridgeError):  # else P frees the blocks at lease expiry
            if peer is not None and not job.refused:
                self.call(peer, job, "fail")

    def renew_loop(self, stop: threading.Event, waiting: Callable[[], list[_Load]]) -> None:
        """Every second until ``stop``, renew the leases of the ``waiting`` loads (in the
        queue or in a handshake: a first NIXL connection has been seen to take 31 s here):
        through the peer's channel once it is known, else through a short-timeout channel
        to the handle's endpoint and engine id (:meth:`_client`)."""
        clients: dict[tuple[str, str], Client] = {}
        while not stop.wait(1.0):
            for job in waiting():
                peer = self.peers.known(job.handle)
                self.renew(peer or self._client(clients, job.handle), job)
        for c in clients.values():
            c.close()

    def _client(self, clients: dict[tuple[str, str], Client], h: TransferHandle) -> Client:
        """The renew channel to ``h``'s endpoint and engine id (the server key is the one
        bound to that id), from ``clients``: the 16 seen last, one per endpoint (another
        engine id there replaces it: P restarted under a new id, or a reused port)."""
        at = (h.endpoint, h.engine_id)
        client = clients.pop(at, None)
        if client is None:
            for other in [k for k in clients if k[0] == h.endpoint]:
                clients.pop(other).close()
            client = Client(at[0], self.secret, min(self.timeout_s, 1.0), self.peers.keys, at[1])
        clients[at] = client  # most recent last
        while len(clients) > 16:
            clients.pop(next(iter(clients))).close()
        return client

    def renew(self, peer: Peer | Client, job: _Load) -> None:
        """A token-less ``renew`` of ``job``, unless it began or is about to (its peer is
        set, or it has a token): checked and sent while its ``begin`` waits (:meth:`op`)."""
        with self._turn:
            if job.peer is not None or job.token:
                return
            self._renewing = job
        try:
            with contextlib.suppress(KVBridgeError):  # the load itself will find out
                self.call(peer, job, "renew")
        finally:
            with self._turn:
                self._renewing = None
                self._turn.notify_all()


class Answer:
    """P's reply to a load's ``begin``, taken once (:meth:`take`), then kept: the lease
    seconds left, or the typed error every later :meth:`take` raises again."""

    def __init__(self, reply: Callable[[], Message], leases: LeaseCalls, job: _Load):
        self._reply: Callable[[], Message] | None = reply
        self._leases, self._job = leases, job
        self._left = 0.0
        self._error: BaseException | None = None
        self.waited = 0.0
        """Seconds spent waiting for the reply."""

    def take(self, quiet: bool = False) -> float:
        """Wait for the reply (the first call), check it (:meth:`LeaseCalls.begun`: the
        token is kept) → lease seconds left; ``quiet``: raise nothing (the caller is
        failing already, or takes the answer again later)."""
        if self._reply is not None:
            reply, self._reply = self._reply, None
            t0 = time.perf_counter()
            try:
                self._left = self._leases.begun(self._job, reply())
            except BaseException as exc:  # kept: no later take may pass unchecked
                self._error = exc
            self.waited = time.perf_counter() - t0
        if self._error is not None and not quiet:
            raise self._error
        return self._left


def checked_reply(h: TransferHandle, op: LeaseOpName, reply: Message) -> LeaseReply:
    """P's answer to ``op``; anything but ``held`` raised as a typed error."""
    if not isinstance(reply, LeaseReply):
        raise PeerError(f"lease {op}: unexpected reply {type(reply).__name__}")
    if reply.state == "mismatch":
        raise PeerError(f"handle of {h.request_id!r} does not match what P holds for it")
    if reply.state == "refused":
        raise PeerError(
            f"P refused {op} of {h.request_id!r} from this D rank (it began or reported already)"
        )
    if reply.state == "foreign":
        raise PeerError(f"P refused {op} of {h.request_id!r}: {reply.reason} (not this D's lease)")
    if reply.state != "held":
        raise LeaseExpired(f"lease of {h.request_id!r} {reply.state} at {op}")
    return reply
