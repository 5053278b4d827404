"""A P instance prepared before its first request (:meth:`Consumer.prepare`): what a new
pair's first load would otherwise pay inside that request (``docs/performance.md``,
"First load on a new pair") is paid ahead, in a worker: the handshake (NIXL peers and the
pair's geometry), the kernel mover's mapping of P's memory and its geometry over it, the
fast channel's connection, and one throwaway plan (the planner's first-call costs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge.connector.peers import Target
from kvbridge.control.messages import PROTOCOL_VERSION, Handshake, HandshakeReply
from kvbridge.errors import PeerError
from kvbridge.plan.tables import checked_tables

if TYPE_CHECKING:
    from kvbridge.connector.consumer import Consumer


def prepare(d: Consumer, target: Target) -> str:
    """Make ``target`` ready for loads that start on the engine's thread → the P epoch
    prepared (a later handle of another epoch handshakes again). Typed errors as a load's
    handshake would raise them (P down, another engine id, another model)."""
    peer = d.peers.get(target)
    try:
        over = d.kernel.geometry(peer)[0] if d.kernel is not None else None
        geometry = over.geometry if over is not None else peer.geometry
        groups = len(d.spec.groups)
        ones = [[0]] * groups
        geometry.plan(1, ones, checked_tables(ones, d.peers.bound.layout.num_blocks, "D's"))
        assert peer.fast is not None  # connected by a call, never waited for (it is in use)
        answer = peer.fast.try_send(Handshake(PROTOCOL_VERSION, d.engine_id))
        reply = answer() if answer is not None else None
        if answer is not None and not isinstance(reply, HandshakeReply):
            raise PeerError(f"handshake: unexpected reply {type(reply).__name__}")
        return peer.epoch
    finally:
        d.peers.done(peer)


__all__ = ["prepare"]
