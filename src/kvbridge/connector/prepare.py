"""A P instance prepared before its first request (:meth:`Consumer.prepare`): what a new
pair's first load would otherwise pay inside that request (``docs/performance.md``,
"First load on a new pair") is paid ahead, on a thread of its own: the handshake (NIXL
peers and the pair's geometry), the fast channel's connection, the kernel mover's mapping
of P's memory and its geometry over it, or, where loads go over NIXL, its connections
(and AUTO's measurement), and one throwaway plan (the planner's first calls)."""

from __future__ import annotations

import contextlib
import logging

import numpy as np

from kvbridge.connector.inline import Starting
from kvbridge.connector.load import Mode
from kvbridge.connector.movers.choice import PROBE_TIMEOUT_S, measure
from kvbridge.connector.peers import Peer, Target
from kvbridge.control.messages import PROTOCOL_VERSION, Handshake
from kvbridge.errors import KVBridgeError
from kvbridge.plan.tables import checked_tables

log = logging.getLogger(__name__)


def prepare(d: Starting, target: Target, companions: bool = True) -> str:
    """Make ``target`` ready for loads that start on the engine's thread → the P epoch
    prepared (a later handle of another epoch handshakes again). A peer cached for an
    epoch P no longer answers with (P restarted) is replaced. Typed errors as a load's
    handshake would raise them (P down, another engine id, another model). Then the P
    instances of P's own it named (``<engine id>.<name>``: a vLLM P's park), at most
    ``peers.COMPANIONS``, each failure logged only."""
    epoch, named = _prepare(d, target)
    for eid, endpoint in named if companions else ():
        if d.closing():
            break
        if not eid.startswith(f"{target.engine_id}."):
            log.warning("kvbridge: P %s names %r, not one of its own", target.engine_id, eid)
            continue
        try:
            prepare(d, Target(eid, endpoint), companions=False)
        except KVBridgeError as e:
            log.warning("kvbridge: preparing %s (of P %s) failed: %s", eid, target.engine_id, e)
    return epoch


def _prepare(d: Starting, target: Target) -> tuple[str, tuple[tuple[str, str], ...]]:
    peer = d.peers.get(target)
    try:
        epoch = _hello(d, peer, target)
        if epoch is not None and epoch != peer.epoch:  # cached, but P restarted since
            old, peer = peer, d.peers.get(Target(target.engine_id, target.endpoint, epoch))
            d.peers.done(old)
            with d.measuring:  # what was measured with the old epoch is no one's now
                d.pair_costs.pop((old.engine_id, old.epoch), None)
            _hello(d, peer, target)
        over = d.kernel.geometry(peer)[0] if d.kernel is not None else None
        geometry = over.geometry if over is not None else peer.geometry
        if over is None:  # loads go over NIXL: its connections made now, AUTO measured
            _connect(d, peer)
        ids = [[g] for g in range(len(d.spec.groups))]  # distinct: groups may share a pool
        with contextlib.suppress(KVBridgeError):  # a warm-up only (a pool of one block?)
            geometry.plan(1, ids, checked_tables(ids, d.peers.bound.layout.num_blocks, "D's"))
        return peer.epoch, peer.companions
    finally:
        d.peers.done(peer)


def _connect(d: Starting, peer: Peer) -> None:
    """Each source rank's NIXL connections made ahead, into a staging slot (never a KV
    block): pull, one small READ; push and AUTO, the direction probe (a READ, and P's
    WRITE where it serves a push channel, else a READ alone; in :attr:`Mode.AUTO` its
    result is the pair's, :func:`~kvbridge.connector.movers.choice.measure`). The first rank
    that does not answer ends it, logged: prepare still succeeds, at most one staging
    slot stays out of the pool (a READ may yet land in it), and the first load meets P as
    it would have. Nothing without a staging slot to land in, or once D closes."""
    if d.stager is None:
        return
    for src in sorted(peer.agents):
        if d.closing():
            return
        why = _read(d, peer, src) if d.mode is Mode.PULL else _probe(d, peer, src)
        if why:
            log.warning("preparing for P %s: rank %d not connected: %s", peer.engine_id, src, why)
            return


def _probe(d: Starting, peer: Peer, src: int) -> str:
    """The direction probe with P rank ``src`` (measured outside ``d.measuring``: loads
    read the pair costs meanwhile) → why it failed ("": it did not)."""
    found = measure(d, peer, src)
    if found.note.endswith("serves no push channel"):
        return _read(d, peer, src)
    if found.note:
        return found.note
    if d.mode is Mode.AUTO:
        with d.measuring:
            d.pair_costs.setdefault((peer.engine_id, peer.epoch), found)
    return ""


def _read(d: Starting, peer: Peer, src: int) -> str:
    """One READ of up to 4 KiB of P rank ``src``'s first region into a staging slot →
    why it failed ("": it did not)."""
    info, pool = peer.ranks.get(src), d.stager.pool if d.stager else None
    if info is None or not info.regions or pool is None:
        return ""
    wait_s = min(PROBE_TIMEOUT_S, d.timeout_s)
    slot = pool.take(wait_s)
    if slot is None:
        return "no free staging slot"
    posted = done = False
    try:
        one = np.ones(1, np.uint64)
        at = pool.region.addr + slot * pool.slot_bytes
        n = min(4096, pool.slot_bytes, info.regions[0])
        handle = d.transport.read(peer.agents[src], one * at, one * info.bases[0], one * n)
        posted = True
        d.transport.wait(handle, wait_s)
        done = True
        return ""
    except KVBridgeError as exc:
        return str(exc)
    finally:
        pool.give_back(slot, done or not posted)


def _hello(d: Starting, peer: Peer, target: Target) -> str | None:
    """A handshake over ``peer``'s fast channel (it connects it) → the epoch P answers
    with; None where the channel is in use (connected, then) and nothing was asked."""
    assert peer.fast is not None
    answer = peer.fast.try_send(Handshake(PROTOCOL_VERSION, d.engine_id))
    return None if answer is None else d.peers.check(answer(), target).epoch


__all__ = ["prepare"]
