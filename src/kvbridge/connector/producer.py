"""P side of the connector.

:class:`ProducerWorker` (one per P rank) registers the rank's KV memory with its
transport and describes it as a :class:`RankInfo`. :class:`Producer` (one per P
instance, scheduler side) serves handshakes and leases on the side channel, returns a
:class:`TransferHandle` per prefilled request and says which blocks may be freed.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kvbridge.connector.handle import Tokens, TransferHandle, prompt_digest
from kvbridge.connector.movers.push_gather import PushGather, PushLedger
from kvbridge.control.channel import Server
from kvbridge.control.lease import Freed, LeaseTable
from kvbridge.control.messages import (
    PROTOCOL_VERSION,
    FenceReply,
    Handshake,
    HandshakeReply,
    LeaseOp,
    Message,
    PushFence,
    PushRefused,
    PushReply,
    PushRuns,
    RankInfo,
    tables_digest,
    wire_layout,
)
from kvbridge.control.security import Keys
from kvbridge.errors import IncompatibleError, KVBridgeError, PeerError, TransferTimeout
from kvbridge.fdtable import reserve_fds
from kvbridge.layout.tensor import MemKind, regions_at
from kvbridge.layout.view import RankLayout
from kvbridge.plan.tables import Tables, checked_tables
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.transport.base import Transport, XferHandle
from kvbridge.transport.ipc import export
from kvbridge.transport.memory import torch_device


class Event(Protocol):
    """What ``written`` waits on: ``torch.cuda.Event`` has it (``query()``: done yet)."""

    def query(self) -> bool: ...


class ProducerWorker:
    """Registers one P rank's regions (``bases[i]`` holds ``layout.regions[i]`` bytes).

    With a ``secret`` it also serves push requests on its own side channel: D sends the
    runs it planned, this rank writes them into D (staged: gathered into one of
    ``push_slots`` slots of ``push_slot_bytes`` first) and notifies D; each load's pushes
    are written once, and a fenced request is refused (``docs/faults.md``).
    """

    FENCED_KEPT = 65536
    """Fenced request ids remembered (oldest forgotten first)."""

    def __init__(
        self,
        rank: int,
        layout: RankLayout,
        bases: list[int],
        transport: Transport,
        secret: bytes | None = None,
        host: str = "127.0.0.1",
        push_timeout_s: float = 10.0,
        advertise: str = "",
        keys: Keys | None = None,
        push_slots: int = 2,
        push_slot_bytes: int = 32 << 20,
        memory: MemKind = MemKind.HOST,
        device: int = 0,
        share: bool = True,
    ):
        """``memory``, ``device``: where ``bases`` point (host memory, or GPU ``device``;
        a staged push gathers where they live).
        ``share``: offer D ranks of this node a mapping of the regions, where the memory
        allows one (:mod:`kvbridge.transport.ipc`; D then copies with one kernel)."""
        self.rank, self.memory, self.device = rank, memory, device
        self.transport, self.timeout_s = transport, push_timeout_s
        self._peers: dict[bytes, str] = {}
        self._running: dict[tuple[str, str], list[tuple[XferHandle, int | None]]] = {}
        """Writes kept running past their wait, with the staging slot each reads from."""
        self._fenced: OrderedDict[tuple[str, str], None] = OrderedDict()
        """Both by (D engine id, request id)."""
        self.ledger = PushLedger()
        """Each load's pushes written once; refusals by cause (``movers/push_gather.py``)."""
        regions = regions_at(bases, layout.regions, memory, device)
        self.gather: PushGather | None = None
        if secret is not None and push_slots > 0 and regions:
            self.gather = PushGather(regions, push_slots, push_slot_bytes)
        extra = [self.gather.pool.region] if self.gather is not None else []
        meta = transport.register(regions + extra)
        self.server = (
            Server(self._handle, secret, host, advertise=advertise, keys=keys)
            if secret is not None
            else None
        )
        endpoint = self.server.endpoint if self.server else ""
        shares = [x for x in map(export, regions) if x is not None] if share else []
        kept = shares if len(shares) == len(regions) else None  # a share per region, or none
        self.info = wire_layout(rank, layout, regions, meta, endpoint, kept)
        reserve_fds()  # a request must not wait for the descriptor table to grow

    def _handle(self, msg: Message) -> Message:
        self._sweep()
        if isinstance(msg, PushFence):
            return self._fence(msg.request_id, msg.d_engine)
        if not isinstance(msg, PushRuns):
            raise PeerError(f"P rank {self.rank} serves push requests, not {type(msg).__name__}")
        if (msg.d_engine, msg.request_id) in self._fenced:
            self.ledger.refused["fenced"] += 1
            raise PeerError(f"push of {msg.request_id!r} refused: D fenced it after a failure")
        sizes = [len(b) for b in (msg.src, msg.dst, msg.nbytes)]
        if len(set(sizes)) > 1 or sizes[0] % 8:
            raise PeerError(
                f"push arrays must be uint64 (multiples of 8 bytes) of one length, got {sizes} B"
            )
        src, dst, n = (np.frombuffer(b, dtype="<u8") for b in (msg.src, msg.dst, msg.nbytes))
        why = self.ledger.admit(msg)
        if why:
            return PushRefused(msg.request_id, why)
        peer = self._peers.get(msg.d_agent)
        if peer is None:
            peer = self._peers[msg.d_agent] = self.transport.add_peer(msg.d_agent)
        return self._write(msg, peer, src, dst, n)

    def _write(
        self, msg: PushRuns, peer: str, src: np.ndarray, dst: np.ndarray, n: np.ndarray
    ) -> PushReply:
        slot: int | None = None
        if msg.staged and self.gather is not None:
            handle, slot, posted = self.gather.write(self.transport, peer, src, dst, n, msg.notif)
        else:
            handle, posted = self.transport.write(peer, src, dst, n, msg.notif), int(n.shape[0])
        try:
            self.transport.wait_or_keep(handle, self.timeout_s)
        except TransferTimeout:  # its slot back once the write ended
            self._running.setdefault((msg.d_engine, msg.request_id), []).append((handle, slot))
            slot = None
            raise
        finally:
            if slot is not None and self.gather is not None:
                self.gather.release(slot)  # ended: done, or failed as the transport reports
        return PushReply(posted)

    def _sweep(self) -> None:
        """Release kept writes that ended, whoever asks (D may never ask again)."""
        for key in list(self._running):
            self._left(key)

    def _left(self, key: tuple[str, str]) -> list[tuple[XferHandle, int | None]]:
        """The kept writes of ``key`` still running (those that ended are released, their
        staging slots given back)."""
        left = []
        for handle, slot in self._running.pop(key, []):
            if not self.transport.ended(handle):
                left.append((handle, slot))
            elif slot is not None and self.gather is not None:
                self.gather.release(slot)
        if left:
            self._running[key] = left
        return left

    def _fence(self, request_id: str, d_engine: str) -> FenceReply:
        key = (d_engine, request_id)
        self._fenced[key] = None
        self.ledger.fence(request_id, d_engine)
        while len(self._fenced) > self.FENCED_KEPT:
            self._fenced.popitem(last=False)
        return FenceReply(request_id, not self._left(key))

    def written(self, event: Event | None = None, timeout_s: float = 10.0) -> None:
        """Return once the engine's KV writes before ``event`` (e.g. a ``torch.cuda.Event``
        recorded after the step's last KV write; None: the device's current stream) are
        complete; :class:`TransferTimeout` after ``timeout_s`` (polled every 50 µs → 1 ms).
        Call it before the step's handles leave P (``docs/gpu.md``, ordering)."""
        if event is None:
            on = torch_device(self.memory, self.device)
            if on.type != "cuda":
                return  # host memory (or emulated on the CPU): nothing queued to wait for
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(on))
        deadline, pause = time.monotonic() + timeout_s, 50e-6
        while not event.query():
            if time.monotonic() > deadline:
                raise TransferTimeout(f"KV writes not complete after {timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class Producer:
    def __init__(
        self,
        engine_id: str,
        spec: ModelSpec,
        par: Parallel,
        secret: bytes,
        lease_s: float = 30.0,
        host: str = "127.0.0.1",
        port: int = 0,
        model_id: str = "",
        advertise: str = "",
        keys: Keys | None = None,
    ):
        """``model_id`` names what P serves; a D with another id is refused at the
        handshake (two models with the same KV shapes would otherwise exchange bytes).
        ``host``/``port``: where the side channel binds; ``advertise``: the address D
        connects to, if not ``host`` (see :class:`~kvbridge.control.channel.Server`);
        ``keys``: CURVE keys and allow-list (default: derived from ``secret``)."""
        self.engine_id, self.model_id, self.spec, self.par = engine_id, model_id, spec, par
        self.epoch = secrets.token_hex(8)
        self.leases = LeaseTable(lease_s)
        self.ranks: dict[int, RankInfo] = {}
        self.companions: list[tuple[str, str]] = []
        """P instances of this P's own (``<engine id>.<name>``, endpoint) that D prepares
        with it (a vLLM P's park)."""
        self.server = Server(self._handle, secret, host, port, advertise=advertise, keys=keys)
        reserve_fds()  # a first handshake must not wait for the table to grow

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def add_rank(self, info: RankInfo) -> None:
        if not 0 <= info.rank < self.par.world:
            raise KVBridgeError(f"rank {info.rank} outside P world {self.par.world}")
        self.ranks[info.rank] = info

    def prefill_done(
        self,
        request_id: str,
        block_tables: Sequence[Sequence[int] | np.ndarray] | Tables,
        n_tokens: int,
        payload: bytes = b"",
        prompt: Tokens | None = None,
    ) -> TransferHandle:
        """Hold ``block_tables`` under a lease; the handle goes to the router. ``prompt``:
        the token ids prefilled (their first ``n_tokens`` name the handle's prompt, which
        D checks before it loads; None: the handle names none)."""
        limits = self.ranks[0].num_blocks if 0 in self.ranks else [1 << 63] * len(self.spec.groups)
        tables = checked_tables(block_tables, limits, "P's block tables").lists()
        said = b"" if prompt is None else prompt_digest(prompt, n_tokens)
        lease_id = secrets.token_hex(8)
        digest = tables_digest(tables, n_tokens)
        self.leases.grant(request_id, lease_id, tables, digest)
        return TransferHandle(
            self.engine_id,
            self.endpoint,
            self.epoch,
            request_id,
            lease_id,
            n_tokens,
            tables,
            payload,
            said,
        )

    def abort(self, request_id: str) -> bool:
        return self.leases.abort(request_id)

    def freed(self, wait_for: int = 0, timeout_s: float = 5.0) -> list[Freed]:
        """Requests whose blocks may be reused now (each reported once). ``wait_for``:
        wait up to ``timeout_s`` until at least that many ended (a D rank's ``confirm``
        follows its outcome, so a lease may end just after D reported the load done)."""
        out = self.leases.drain_freed()
        end = time.monotonic() + timeout_s
        while len(out) < wait_for and time.monotonic() < end:
            time.sleep(0.001)
            out += self.leases.drain_freed()
        return out

    def _handle(self, msg: Message) -> Message:
        if isinstance(msg, Handshake):
            return self._handshake(msg)
        if isinstance(msg, LeaseOp):
            return self.leases.on_op(msg)
        raise PeerError(f"unexpected message {type(msg).__name__}")

    def _handshake(self, msg: Handshake) -> HandshakeReply:
        if msg.version != PROTOCOL_VERSION:
            raise IncompatibleError(
                f"protocol version {msg.version} from {msg.d_engine!r}; P speaks {PROTOCOL_VERSION}"
            )
        if len(self.ranks) != self.par.world:
            raise KVBridgeError(f"P has {len(self.ranks)} of {self.par.world} ranks registered")
        stages = list(self.par.stage_ranges(len(self.spec.layers)))
        return HandshakeReply(
            PROTOCOL_VERSION,
            self.engine_id,
            self.epoch,
            self.spec.compat_hash(),
            self.model_id,
            self.par.tp,
            self.par.pp,
            stages,
            [self.ranks[r] for r in range(self.par.world)],
            list(self.companions),
        )

    def close(self) -> None:
        self.server.close()
