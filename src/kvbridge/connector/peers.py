"""D's knowledge of P instances: handshake once per (engine, epoch), geometry cached."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from kvbridge.connector.handle import TransferHandle
from kvbridge.control.channel import Client
from kvbridge.control.messages import PROTOCOL_VERSION, Handshake, HandshakeReply, rank_layout
from kvbridge.errors import IncompatibleError, PeerError
from kvbridge.plan.build import Geometry
from kvbridge.plan.geometry import Bound
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.transport.base import Transport

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Peer:
    engine_id: str
    epoch: str
    client: Client
    agents: dict[int, str]
    geometry: Geometry
    endpoints: dict[int, str]
    secret: bytes
    timeout_s: float = 5.0
    clients: dict[int, Client] = field(default_factory=dict)

    def rank_client(self, rank: int) -> Client:
        """Side channel of one P rank (push requests)."""
        if not self.endpoints.get(rank):
            raise PeerError(f"P rank {rank} of {self.engine_id!r} serves no push channel")
        if rank not in self.clients:
            self.clients[rank] = Client(self.endpoints[rank], self.secret, self.timeout_s)
        return self.clients[rank]


class PeerCache:
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
    ):
        """``timeout_s`` bounds each side-channel call to a P (handshake, lease, push);
        a P whose ``model_id`` differs from ``model_id`` is refused."""
        self.timeout_s, self.model_id, self.pad_blocks = timeout_s, model_id, pad_blocks
        self.engine_id, self.spec, self.par, self.rank = engine_id, spec, par, rank
        self.bound, self.transport, self.secret = bound, transport, secret
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}

    def known(self, handle: TransferHandle) -> Peer | None:
        """The peer if one is cached. Does not wait for a handshake in progress (that
        holds the lock for as long as P takes): one dict read is atomic."""
        return self._peers.get(handle.engine_id)

    def get(self, handle: TransferHandle) -> Peer:
        """The peer of ``handle``; handshakes if new or if P restarted (new epoch)."""
        with self._lock:
            peer = self._peers.get(handle.engine_id)
            if peer is not None and peer.epoch == handle.epoch:
                return peer
            if peer is not None:
                self._forget(peer)
            peer = self._handshake(handle)
            self._peers[handle.engine_id] = peer
            return peer

    def _handshake(self, handle: TransferHandle) -> Peer:
        t0 = time.perf_counter()
        client = Client(handle.endpoint, self.secret, self.timeout_s)
        reply = client.call(Handshake(PROTOCOL_VERSION, self.engine_id))
        laps = [time.perf_counter()]
        if not isinstance(reply, HandshakeReply):
            raise PeerError(f"handshake: unexpected reply {type(reply).__name__}")
        if reply.version != PROTOCOL_VERSION:
            raise IncompatibleError(f"P speaks protocol {reply.version}, D {PROTOCOL_VERSION}")
        if reply.compat_hash != self.spec.compat_hash():
            raise IncompatibleError(
                f"P model hash {reply.compat_hash} differs from D's {self.spec.compat_hash()}"
            )
        if reply.model_id != self.model_id:
            raise IncompatibleError(
                f"P serves model {reply.model_id!r}, D {self.model_id!r} (same KV shapes, "
                "another model: its bytes would be wrong here)"
            )
        p_par = Parallel(reply.tp, reply.pp, tuple(tuple(s) for s in reply.stages))  # type: ignore[misc]
        if len(reply.ranks) != p_par.world or [r.rank for r in reply.ranks] != list(
            range(p_par.world)
        ):
            raise PeerError(f"handshake lists ranks {[r.rank for r in reply.ranks]}")
        layouts = [rank_layout(info) for info in reply.ranks]
        names = {g.name: bs for g, bs in zip(self.spec.groups, layouts[0].block_sizes, strict=True)}
        spec_p = self.spec.with_block_sizes(names)
        p_bound = [Bound(lay, tuple(i.bases)) for lay, i in zip(layouts, reply.ranks, strict=True)]
        geometry = Geometry(
            spec_p, self.spec, p_par, self.par, p_bound, self.bound, self.rank, self.pad_blocks
        )
        laps.append(time.perf_counter())
        agents = {}
        for info in reply.ranks:
            if info.rank in {pc for pc in _sources(geometry)}:
                agents[info.rank] = self.transport.add_peer(info.agent)
        laps.append(time.perf_counter())
        if laps[-1] - t0 > 1.0:
            call, geom, peers = laps[0] - t0, laps[1] - laps[0], laps[2] - laps[1]
            log.warning(
                "handshake with %s took %.1f s (reply %.1f s, geometry %.1f s, NIXL peers %.1f s)",
                handle.engine_id, laps[-1] - t0, call, geom, peers,
            )  # fmt: skip
        endpoints = {info.rank: info.endpoint for info in reply.ranks}
        return Peer(
            reply.engine_id,
            reply.epoch,
            client,
            agents,
            geometry,
            endpoints,
            self.secret,
            self.timeout_s,
        )

    def _forget(self, peer: Peer) -> None:
        for name in peer.agents.values():
            self.transport.remove_peer(name)
        peer.client.close()
        for c in peer.clients.values():
            c.close()

    def close(self) -> None:
        with self._lock:
            for peer in self._peers.values():
                self._forget(peer)
            self._peers.clear()


def _sources(geometry: Geometry) -> set[int]:
    return {b.src_rank for g in geometry.groups for b in g.buckets}
