"""A P instance prepared before its first request (:meth:`Consumer.prepare`): what a new
pair's first load would otherwise pay inside that request (``docs/performance.md``,
"First load on a new pair") is paid ahead, on a thread of its own: the handshake (NIXL
peers and the pair's geometry), the fast channel's connection, the kernel mover's mapping
of P's memory and its geometry over it, or, where loads go over NIXL, its connections
(and AUTO's measurement), and one throwaway plan (the planner's first calls)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvbridge.connector.load import Mode
from kvbridge.connector.movers import PROBE_TIMEOUT_S, measure
from kvbridge.connector.peers import Peer, Target
from kvbridge.control.messages import PROTOCOL_VERSION, Handshake, HandshakeReply
from kvbridge.errors import PeerError
from kvbridge.plan.tables import checked_tables

if TYPE_CHECKING:
    from kvbridge.connector.consumer import Consumer


def prepare(d: Consumer, target: Target) -> str:
    """Make ``target`` ready for loads that start on the engine's thread → the P epoch
    prepared (a later handle of another epoch handshakes again). A peer cached for an
    epoch P no longer answers with (P restarted) is replaced. Typed errors as a load's
    handshake would raise them (P down, another engine id, another model)."""
    peer = d.peers.get(target)
    try:
        epoch = _hello(d, peer, target)
        if epoch is not None and epoch != peer.epoch:  # cached, but P restarted since
            old, peer = peer, d.peers.get(Target(target.engine_id, target.endpoint, epoch))
            d.peers.done(old)
            _hello(d, peer, target)
        over = d.kernel.geometry(peer)[0] if d.kernel is not None else None
        geometry = over.geometry if over is not None else peer.geometry
        if over is None:  # loads go over NIXL: its connections made now, AUTO measured
            _connect(d, peer)
        ones = [[0]] * len(d.spec.groups)
        geometry.plan(1, ones, checked_tables(ones, d.peers.bound.layout.num_blocks, "D's"))
        return peer.epoch
    finally:
        d.peers.done(peer)


def _connect(d: Consumer, peer: Peer) -> None:
    """Each source rank's NIXL connections made ahead, into a staging slot (never a KV
    block): pull, one small READ; push and AUTO, the direction probe (a READ, and P's
    WRITE where it serves a push channel, else a READ alone; in :attr:`Mode.AUTO` its
    result is the pair's, :func:`~kvbridge.connector.movers.direction`). Nothing
    without a staging slot to land in."""
    if d.stager is None:
        return
    for src in sorted(peer.agents):
        if d.mode is Mode.PULL:
            _read(d, peer, src)
            continue
        with d.measuring:
            found = measure(d, peer, src)
            key = (peer.engine_id, peer.epoch)
            if d.mode is Mode.AUTO and key not in d.directions and not found.note:
                d.directions[key] = found
        if found.nbytes == 0:  # no WRITE to ask for: a READ alone
            _read(d, peer, src)


def _read(d: Consumer, peer: Peer, src: int) -> None:
    """One READ of up to 4 KiB of P rank ``src``'s first region into a staging slot."""
    info, pool = peer.ranks.get(src), d.stager.pool if d.stager else None
    if info is None or not info.regions or pool is None:
        return
    slot = pool.take(PROBE_TIMEOUT_S)
    if slot is None:
        return
    clean = False
    try:
        one = np.ones(1, np.uint64)
        at = pool.region.addr + slot * pool.slot_bytes
        n = min(4096, pool.slot_bytes, info.regions[0])
        handle = d.transport.read(peer.agents[src], one * at, one * info.bases[0], one * n)
        d.transport.wait(handle, PROBE_TIMEOUT_S)
        clean = True
    finally:
        pool.give_back(slot, clean)


def _hello(d: Consumer, peer: Peer, target: Target) -> str | None:
    """A handshake over ``peer``'s fast channel (it connects it) → the epoch P answers
    with; None where the channel is in use (connected, then) and nothing was asked."""
    assert peer.fast is not None
    answer = peer.fast.try_send(Handshake(PROTOCOL_VERSION, d.engine_id))
    if answer is None:
        return None
    reply = answer()
    if not isinstance(reply, HandshakeReply):
        raise PeerError(f"handshake: unexpected reply {type(reply).__name__}")
    if reply.engine_id != target.engine_id:
        raise PeerError(f"{target.endpoint} is {reply.engine_id!r}, not {target.engine_id!r}")
    return reply.epoch


__all__ = ["prepare"]
