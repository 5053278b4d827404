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
from kvbridge.connector.load import Answer, _Load, checked_reply
from kvbridge.connector.peers import Peer, PeerCache
from kvbridge.control.channel import Client
from kvbridge.control.messages import LeaseOp, LeaseOpName, LeaseReply
from kvbridge.errors import KVBridgeError

log = logging.getLogger(__name__)


class LeaseCalls:
    def __init__(self, engine_id: str, rank: int, world: int, peers: PeerCache):
        self.epoch = secrets.token_hex(8)
        """Names this D rank's start at P (with the engine id and rank)."""
        self.who = (engine_id, self.epoch, rank, world)
        self.peers = peers
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
        sent = time.monotonic()
        return Answer(peer.client.send(self.op(job, "begin"), since=job.queued), job, sent)

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
        reply, sent = None, time.monotonic()
        try:
            reply = peer.fast.try_send(self.op(job, "begin"))
        except KVBridgeError:  # the queued load meets it again, typed
            pass
        finally:
            if reply is None:
                with self._turn:
                    job.peer = None
        return None if reply is None else Answer(reply, job, sent)

    def tell(self, peer: Peer, job: _Load, op: LeaseOpName, since: float | None = None) -> None:
        """``op`` at P off the load's path, then ``peer`` released; a failure is logged
        (P frees the blocks at lease expiry instead). ``since``: as :meth:`Client.call`'s
        (behind a call that timed out, it fails at once)."""
        try:
            self.call(peer, job, op, since)
        except KVBridgeError as e:
            doing = "confirming" if op == "confirm" else f"{op} of"
            log.warning("%s %s at P failed: %s", doing, job.handle.request_id, e)
        finally:
            self.peers.done(peer)

    def release(self, job: _Load, op: LeaseOpName = "confirm") -> None:
        """``op`` without a token: this rank needs no bytes (``confirm``) or refused the
        load before it began (``fail``); P accepts it only while the rank has not begun."""
        try:
            peer = self.peers.get(job.handle)
        except KVBridgeError as e:
            log.warning("%s of %s at P failed: %s", op, job.handle.request_id, e)
            return
        self.tell(peer, job, op)

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
            p = self.peers
            client = Client(at[0], p.secret, min(p.timeout_s, 1.0), p.keys, at[1])
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
