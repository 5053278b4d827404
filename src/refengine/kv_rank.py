"""kvbridge's connector inside a rank process, next to the cache it moves.

The NIXL agent must live in the process that owns the memory, so each rank runs its
own endpoint: a P rank a :class:`ProducerWorker` (its coordinator, the
:class:`~kvbridge.connector.producer.Producer`, lives with the instance), a D rank a
:class:`Consumer`. NIXL is imported only when the first endpoint starts, so plain
engine use never loads it.

    P rank   ServeKV ──► transport (NIXL) + ProducerWorker ──► KVInfo (RankInfo)
    D rank   ConsumeKV ─► transport (NIXL) + Consumer ──► Ack
             LoadKV ────► Consumer.load ──► Ack
             AwaitKV ───► Consumer.poll until the request's Outcome ──► Loaded
"""

from __future__ import annotations

import os
import time

from kvbridge.adapter import decode_handle
from kvbridge.api import (
    Consumer,
    ModelSpec,
    Outcome,
    Parallel,
    ProducerWorker,
    RankLayout,
    Transport,
    make_transport,
)
from refengine.errors import EngineError
from refengine.messages import (
    Ack,
    AwaitKV,
    ConsumeKV,
    KVCommand,
    KVInfo,
    Loaded,
    LoadKV,
    Prepared,
    PrepareKV,
    Reply,
    ServeKV,
)

POLL_S = 0.001


class RankKV:
    """One rank's connector endpoint over the cache at ``bases`` (one per region)."""

    def __init__(
        self, spec: ModelSpec, par: Parallel, rank: int, layout: RankLayout, bases: list[int]
    ) -> None:
        self.spec, self.par, self.rank = spec, par, rank
        self.layout, self.bases = layout, bases
        self.transport: Transport | None = None
        self.producer: ProducerWorker | None = None
        self.consumer: Consumer | None = None
        self.outcomes: dict[str, Outcome] = {}

    def handle(self, cmd: KVCommand) -> Reply:
        if isinstance(cmd, ServeKV):
            return self.serve(cmd)
        if isinstance(cmd, ConsumeKV):
            return self.consume(cmd)
        if isinstance(cmd, LoadKV):
            return self.load(cmd)
        if isinstance(cmd, PrepareKV):
            return self.prepare(cmd)
        return self.await_outcome(cmd)

    def serve(self, cmd: ServeKV) -> KVInfo:
        transport = self._transport(cmd.engine_id, cmd.transport)
        self.producer = ProducerWorker(
            self.rank, self.layout, self.bases, transport, cmd.secret, cmd.host,
            advertise=cmd.advertise,
        )  # fmt: skip
        return KVInfo(self.producer.info)

    def consume(self, cmd: ConsumeKV) -> Ack:
        self.consumer = Consumer(
            cmd.engine_id,
            self.spec,
            self.par,
            self.rank,
            self.layout,
            self.bases,
            self._transport(cmd.engine_id, cmd.transport),
            cmd.secret,
            policy=cmd.policy,
            transfer_timeout_s=cmd.timeout_s,
            mode=cmd.mode,
        )
        return Ack()

    def prepare(self, cmd: PrepareKV) -> Prepared:
        done = self._consumer().prepare(cmd.endpoint, cmd.engine_id)
        try:
            done.result(cmd.timeout_s)
            return Prepared()
        except Exception as e:  # P down, too slow: not this rank's failure
            return Prepared(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    def load(self, cmd: LoadKV) -> Ack:
        handle = decode_handle(cmd.job.handle)
        self.outcomes.pop(handle.request_id, None)  # a stale outcome of an earlier attempt
        self._consumer().load(handle, cmd.job.tables, cmd.job.cached)
        return Ack()

    def await_outcome(self, cmd: AwaitKV) -> Loaded:
        consumer = self._consumer()
        deadline = time.monotonic() + cmd.timeout_s
        while cmd.request_id not in self.outcomes and time.monotonic() < deadline:
            self.outcomes.update((o.request_id, o) for o in consumer.poll())
            time.sleep(POLL_S)
        missing = Outcome(cmd.request_id, False, error=f"no outcome within {cmd.timeout_s} s")
        return Loaded(self.outcomes.pop(cmd.request_id, missing))

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.close()
        if self.transport is not None:
            self.transport.close()

    def _transport(self, engine_id: str, kind: str) -> Transport:
        if self.transport is not None:
            raise EngineError(f"rank {self.rank} already serves kvbridge endpoints")
        self.transport = make_transport(kind, f"{engine_id}-r{self.rank}-{os.getpid()}")
        return self.transport

    def _consumer(self) -> Consumer:
        if self.consumer is None:
            raise EngineError(f"rank {self.rank} has no consumer: send ConsumeKV first")
        return self.consumer
