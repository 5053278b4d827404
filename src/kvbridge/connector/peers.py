"""D's knowledge of P instances: handshake once per (engine, epoch), geometry cached,
the number of peers bounded."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

# numpy >= 2's np.unique imports numpy.ma on its first call (a geometry's build): imported
# here, at engine start, not in a first request's handshake, where an import in an
# engine's busy worker process waits for the GIL at each file read (tens of ms).
import numpy.ma  # noqa: F401

from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.movers.spans import Regions, regions_of
from kvbridge.control.channel import Client
from kvbridge.control.messages import (
    PROTOCOL_VERSION,
    Handshake,
    HandshakeReply,
    Message,
    RankInfo,
    rank_layout,
    rank_regions,
    rank_shares,
)
from kvbridge.control.security import Keys
from kvbridge.errors import IncompatibleError, PeerError, TransferTimeout, TransportError
from kvbridge.layout.view import RankLayout
from kvbridge.plan.geometry import Geometry, Side
from kvbridge.plan.pattern import Bound
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.transport.base import Transport

log = logging.getLogger(__name__)


COMPANIONS = 4
"""Most companions of a P kept (and prepared with it: :mod:`kvbridge.connector.prepare`)."""


@dataclass(slots=True)
class Peer:
    engine_id: str
    epoch: str
    client: Client
    agents: dict[int, str]
    geometry: Geometry
    clients: dict[int, Client] = field(default_factory=dict)
    regions: dict[int, Regions] = field(default_factory=dict)
    """Per P rank, its registered regions (sorted starts, ends): staged spans stay inside."""
    users: int = 0
    """Loads using this peer now (:meth:`PeerCache.get` … :meth:`PeerCache.done`)."""
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    """What each P rank said at the handshake (endpoint, memory kind, node, shares)."""
    remake: Callable[[dict[int, tuple[int, ...]], tuple[int, ...]], Geometry] | None = None
    """The pair's geometry over other region bases (per P rank, and D's): the kernel
    mover plans in offsets of the memory it mapped."""
    companions: tuple[tuple[str, str], ...] = ()
    """P's own other instances it named at the handshake (engine id, endpoint): prepared
    with it (:mod:`kvbridge.connector.prepare`)."""

    fast: Client | None = None
    """A second channel to P, for ``begin`` sent from the engine's thread
    (:meth:`LeaseCalls.try_begin`, never waiting): made with the peer."""

    def __post_init__(self) -> None:
        if self.fast is None:
            self.fast = self.client.sibling(self.client.endpoint)

    def rank_client(self, rank: int) -> Client:
        """Side channel of one P rank (push requests)."""
        info = self.ranks.get(rank)
        if info is None or not info.endpoint:
            raise PeerError(f"P rank {rank} of {self.engine_id!r} serves no push channel")
        if rank not in self.clients:
            self.clients[rank] = self.client.sibling(info.endpoint)
        return self.clients[rank]


@dataclass(frozen=True, slots=True)
class Target:
    """A P instance to reach before any handle names it (:meth:`Consumer.prepare`): its
    engine id and side-channel endpoint; ``epoch`` "" takes whichever P answers with."""

    engine_id: str
    endpoint: str
    epoch: str = ""


def _any(handle: TransferHandle | Target) -> str | None:
    """The epoch that stands for any: "" in a :class:`Target` only (a handle without
    epoch is stale or forged)."""
    return "" if isinstance(handle, Target) else None


class PeerCache:
    """D's peers by engine id: at most ``max_peers`` kept (least recently used and idle
    ones evicted), one handshake at a time per engine id (others wait for it, loads to
    other engines do not), and a P is replaced only by a handshake that succeeded with
    the engine id and epoch the handle names: a forged or stale handle costs its own
    load, never a working link. Loads queued before a handshake with their endpoint got
    no answer fail with it at once (P down: one timeout, not one per load)."""

    def __init__(
        self,
        engine_id: str,
        spec: ModelSpec,
        par: Parallel,
        rank: int,
        bound: Bound,
        transport: Transport,
        secret: bytes,
        timeout_s: float = 5.0,
        model_id: str = "",
        pad_blocks: bool = False,
        max_peers: int = 64,
        keys: Keys | None = None,
    ):
        """``timeout_s`` bounds each side-channel call to a P (handshake, lease, push);
        a P whose ``model_id`` differs from ``model_id`` is refused."""
        self.timeout_s, self.model_id, self.pad_blocks = timeout_s, model_id, pad_blocks
        self.engine_id, self.spec, self.par, self.rank = engine_id, spec, par, rank
        self.bound, self.transport, self.secret = bound, transport, secret
        self.max_peers, self.keys = max_peers, keys
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}  # least recently used first
        self._busy: dict[str, threading.Event] = {}
        self._stale: list[Peer] = []
        self._unreachable: dict[str, tuple[float, str]] = {}
        """Endpoint → when a handshake with it last got no answer, and the error."""

    def known(self, handle: TransferHandle) -> Peer | None:
        """The peer if one is cached. Does not wait for a handshake in progress: one
        dict read is atomic."""
        return self._peers.get(handle.engine_id)

    def __len__(self) -> int:
        return len(self._peers)

    def ready(self, handle: TransferHandle) -> Peer | None:
        """:meth:`get` where it needs no handshake (the peer is cached, same epoch), else
        None at once."""
        with self._lock:
            return self._use(handle)

    def _use(self, handle: TransferHandle | Target) -> Peer | None:
        """Under the lock: the peer cached for ``handle``, counted in use (and most
        recently used), else None."""
        peer = self._peers.get(handle.engine_id)
        if peer is None or handle.epoch not in (peer.epoch, _any(handle)):
            return None
        self._peers[handle.engine_id] = self._peers.pop(handle.engine_id)
        peer.users += 1
        return peer

    def get(self, handle: TransferHandle | Target, since: float | None = None) -> Peer:
        """The peer of ``handle`` (handshakes if new or if P restarted: new epoch; a
        :class:`Target` without epoch takes the one cached, else whichever P answers
        with), counted in use until :meth:`done`. ``since`` (``time.monotonic()``, default
        now): fail at once if a handshake with the handle's endpoint got no answer after
        it."""
        eid = handle.engine_id
        asked = time.monotonic() if since is None else since
        while True:
            with self._lock:
                peer = self._use(handle)
                if peer is not None:
                    return peer
                failed = self._unreachable.get(handle.endpoint)
                if failed is not None and failed[0] >= asked:  # while this load waited
                    raise TransportError(f"{failed[1]} (handshake made while this load waited)")
                busy = self._busy.get(eid)
                if busy is None:
                    busy = self._busy[eid] = threading.Event()
                    break
            if not busy.wait(max(60.0, 3 * self.timeout_s)):
                raise TransferTimeout(f"another handshake with {eid!r} is still running")
        try:
            try:
                new = self._handshake(handle)
            except TransportError as e:  # P down or unreachable: its waiters fail with it
                with self._lock:
                    self._unreachable.pop(handle.endpoint, None)
                    self._unreachable[handle.endpoint] = (time.monotonic(), str(e))
                    while len(self._unreachable) > self.max_peers:
                        self._unreachable.pop(next(iter(self._unreachable)))
                raise
            with self._lock:
                self._unreachable.pop(handle.endpoint, None)
                old = self._peers.pop(eid, None)
                self._peers[eid] = new
                new.users += 1
                doomed = self._evict(old)
        finally:
            with self._lock:
                self._busy.pop(eid, None)
            busy.set()
        for p in doomed:
            self._forget(p)
        return new

    def done(self, peer: Peer) -> None:
        """A load that :meth:`get` ``peer`` no longer uses it."""
        with self._lock:
            peer.users -= 1
            doomed = self._evict(None)
        for p in doomed:
            self._forget(p)

    def _evict(self, replaced: Peer | None) -> list[Peer]:
        """Under the lock: peers to forget now (idle ones beyond the limit, replaced
        ones once idle)."""
        if replaced is not None:
            self._stale.append(replaced)
        doomed = [p for p in self._stale if p.users <= 0]
        self._stale = [p for p in self._stale if p.users > 0]
        idle = [e for e, p in self._peers.items() if p.users <= 0]
        for eid in idle[: max(len(self._peers) - self.max_peers, 0)]:
            doomed.append(self._peers.pop(eid))
        return doomed

    def _handshake(self, handle: TransferHandle | Target) -> Peer:
        t0 = time.perf_counter()
        eid = handle.engine_id  # per-instance keys: P must hold the key bound to it
        client = Client(handle.endpoint, self.secret, self.timeout_s, self.keys, eid)
        try:
            reply = self.check(client.call(Handshake(PROTOCOL_VERSION, self.engine_id)), handle)
            return self._connect(handle, client, reply, t0)
        except BaseException:
            client.close()
            raise

    def check(self, reply: Message, handle: TransferHandle | Target) -> HandshakeReply:
        """P's answer to a handshake, if it is the P ``handle`` names (engine id and epoch)
        and serves this D's model; else a typed error."""
        if not isinstance(reply, HandshakeReply):
            raise PeerError(f"handshake: unexpected reply {type(reply).__name__}")
        if reply.version != PROTOCOL_VERSION:
            raise IncompatibleError(f"P speaks protocol {reply.version}, D {PROTOCOL_VERSION}")
        want = reply.epoch if handle.epoch == _any(handle) else handle.epoch
        if (reply.engine_id, reply.epoch) != (handle.engine_id, want):
            raise PeerError(
                f"{handle.endpoint} is {reply.engine_id!r} epoch {reply.epoch!r}; the handle "
                f"names {handle.engine_id!r} epoch {handle.epoch!r} (stale or forged handle)"
            )
        if reply.compat_hash != self.spec.compat_hash():
            raise IncompatibleError(
                f"P model hash {reply.compat_hash} differs from D's {self.spec.compat_hash()}"
            )
        if reply.model_id != self.model_id:
            raise IncompatibleError(
                f"P serves model {reply.model_id!r}, D {self.model_id!r} (same KV shapes, "
                "another model: its bytes would be wrong here)"
            )
        return reply

    def _connect(
        self, handle: TransferHandle | Target, client: Client, reply: HandshakeReply, t0: float
    ) -> Peer:
        laps = [time.perf_counter()]
        p_par = Parallel(reply.tp, reply.pp, tuple(tuple(s) for s in reply.stages))  # type: ignore[misc]
        if [r.rank for r in reply.ranks] != list(range(p_par.world)):
            raise PeerError(f"handshake lists ranks {[r.rank for r in reply.ranks]}")
        layouts = [rank_layout(info) for info in reply.ranks]
        for info, lay in zip(reply.ranks, layouts, strict=True):
            rank_regions(info, lay)  # a memory kind this side does not know is refused
            rank_shares(info)
        sizes = _block_sizes(layouts)
        names = {g.name: bs for g, bs in zip(self.spec.groups, sizes, strict=True)}
        spec_p = self.spec.with_block_sizes(names)
        p_bound = [Bound(lay, tuple(i.bases)) for lay, i in zip(layouts, reply.ranks, strict=True)]
        geometry = self._remake(spec_p, p_par, p_bound, {}, self.bound.bases)
        laps.append(time.perf_counter())
        sources = {b.src_rank for g in geometry.groups for b in g.buckets}
        add = self.transport.add_peer
        agents = {i.rank: add(i.agent) for i in reply.ranks if i.rank in sources}
        laps.append(time.perf_counter())
        if laps[-1] - t0 > 1.0:
            call, geom, peers = laps[0] - t0, laps[1] - laps[0], laps[2] - laps[1]
            log.warning(
                "handshake with %s took %.1f s (reply %.1f s, geometry %.1f s, NIXL peers %.1f s)",
                handle.engine_id, laps[-1] - t0, call, geom, peers,
            )  # fmt: skip
        return Peer(
            reply.engine_id,
            reply.epoch,
            client,
            agents,
            geometry,
            regions={
                i.rank: regions_of(i.bases, lay.regions)
                for i, lay in zip(reply.ranks, layouts, strict=True)
            },
            ranks={i.rank: i for i in reply.ranks},
            remake=partial(self._remake, spec_p, p_par, p_bound),
            companions=tuple((str(e), str(a)) for e, a in reply.companions[:COMPANIONS]),
        )

    def _remake(
        self,
        spec_p: ModelSpec,
        p_par: Parallel,
        p_bound: list[Bound],
        p_bases: dict[int, tuple[int, ...]],
        d_bases: tuple[int, ...],
    ) -> Geometry:
        p_b = [Bound(b.layout, p_bases.get(r, b.bases)) for r, b in enumerate(p_bound)]
        d = Side(self.spec, self.par, {self.rank: Bound(self.bound.layout, d_bases)})
        return Geometry(Side(spec_p, p_par, p_b), d, self.rank, self.pad_blocks)

    def _forget(self, peer: Peer) -> None:
        """Drop ``peer``'s channels and its transport peers, except names a cached peer
        uses too (a restarted P may reuse its agents' names)."""
        with self._lock:
            kept = {n for p in [*self._peers.values(), *self._stale] for n in p.agents.values()}
        for name in set(peer.agents.values()) - kept:
            self.transport.remove_peer(name)
        peer.client.close()
        if peer.fast is not None:
            peer.fast.close()
        for c in peer.clients.values():
            c.close()

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers.values()) + self._stale
            self._peers.clear()
            self._stale = []
        for peer in peers:
            self._forget(peer)


def _block_sizes(layouts: list[RankLayout]) -> tuple[int, ...]:
    """P's block sizes per group: every P rank's the same (the geometry plans each P rank
    with one spec), else a PeerError."""
    sizes = {tuple(lay.block_sizes) for lay in layouts}
    if len(sizes) != 1:
        raise PeerError(f"P's ranks describe their groups in blocks of {sorted(sizes)} tokens")
    return sizes.pop()
