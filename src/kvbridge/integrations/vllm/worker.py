"""Worker side of the vLLM connector (one per rank, TP × PP, in vLLM's worker process): it
registers the KV tensors vLLM allocated, as :mod:`~kvbridge.integrations.vllm.placement`
described them, publishes P's rank layout, and on D loads each request through a
:class:`Consumer` (D's tables mapped to kernel blocks where the layout splits them)."""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from concurrent.futures import Future
from functools import partial

from kvbridge.adapter import Loading, LoadJob, Tally, decode_handle, increase
from kvbridge.adapter.metrics import Sample
from kvbridge.api import (
    ConfigError,
    Consumer,
    Keys,
    KVBridgeError,
    ProducerWorker,
    TransferHandle,
    Transport,
    make_transport,
)
from kvbridge.integrations.vllm.cache import VllmCache
from kvbridge.integrations.vllm.config import ConnectorConfig
from kvbridge.integrations.vllm.gpu_layout import Placement, kernel_tables
from kvbridge.integrations.vllm.metadata import RankMeta, StepMeta, encode_info
from kvbridge.integrations.vllm.park import Park

log = logging.getLogger(__name__)


def _prepared(engine_id: str, done: Future[str]) -> None:
    """Log how preparing P ``engine_id`` ended (a failure costs its first request only)."""
    if done.cancelled():  # the consumer closed first
        return
    exc = done.exception()
    if exc is not None:
        log.warning("kvbridge: preparing P %s failed: %s", engine_id, exc)
    else:
        log.info("kvbridge: P %s prepared (epoch %s)", engine_id, done.result())


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, cache: VllmCache, tp_rank: int, stage: int = 0):
        """``tp_rank`` within PP stage ``stage`` (vLLM's ``pp_rank``), whose layers
        ``cache`` must name; the rank peers know is ``stage · tp + tp_rank``."""
        if stage != cache.stage:
            raise ConfigError(
                f"PP stage {stage}: vLLM's KV cache config names the layers of stage "
                f"{cache.stage} ({cache.par.stage_ranges(len(cache.spec.layers))[cache.stage]})"
            )
        self.cfg, self.cache, self.tp_rank = cfg, cache, tp_rank
        self.rank = stage * cache.par.tp + tp_rank
        self.producer: ProducerWorker | None = None
        self.park: Park | None = None
        self.park_producer: ProducerWorker | None = None
        self.consumer: Consumer | None = None
        self._transports: list[Transport] = []
        self.loading = Loading()
        self._sent: set[str] = set()
        self.tally = Tally()
        """Loads finished, lease ends and refusals (P), releases (D) since vLLM last
        asked for stats; totals since start."""
        self.totals: Counter[str] = self.tally.totals
        self._refused: dict[str, int] = {}
        """P: this rank's push refusals by cause, as of the last report."""
        self.splits: tuple[int, ...] = (1,) * len(cache.spec.groups)
        """Per group: described blocks per vLLM block (set by :meth:`register`)."""
        self._to_prepare = list(cfg.prepare) if cfg.consumer else []
        """P instances to prepare at the first step (not at registration: vLLM may be
        capturing CUDA graphs then, and mapping P's memory must not run meanwhile)."""

    def _transport(self, role: str) -> Transport:
        name = f"kvb-{role}-{self.cfg.engine_id}-{self.rank}-{secrets.token_hex(3)}"
        threads = self.cfg.num_threads
        opts = {"threads": threads} if self.cfg.transport == "nixl" and threads is not None else {}
        t = make_transport(self.cfg.transport, name, **opts)
        self._transports.append(t)
        return t

    def register(self, placed: Placement) -> None:
        """Register this rank's KV memory, described once
        (:func:`~kvbridge.integrations.vllm.placement.place`), with P's and D's halves as
        the role asks (P with ``park_blocks``: its park too)."""
        self.splits = placed.splits
        if self.cfg.producer:
            self.producer = ProducerWorker(
                self.rank,
                placed.layout,
                placed.bases,
                self._transport("p"),
                memory=placed.memory,
                device=placed.device,
            )
            if self.cfg.park_blocks:
                self.park = park = Park(placed, self.cfg.park_blocks)
                self.park_producer = ProducerWorker(
                    self.rank,
                    park.layout,
                    park.bases,
                    self._transport("park"),
                    memory=placed.memory,
                    device=placed.device,
                )
        if self.cfg.consumer:
            self.consumer = Consumer(
                self.cfg.engine_id,
                placed.spec,
                self.cache.par,
                self.rank,
                placed.layout,
                placed.bases,
                self._transport("d"),
                self.cfg.secret,
                transfer_timeout_s=self.cfg.timeout_s,
                model_id=self.cfg.model_id,
                pad_blocks=True,  # vLLM writes a slot before any read of it
                keys=Keys.load(self.cfg.keys_file) if self.cfg.keys_file else None,
                memory=placed.memory,
                device=placed.device,
            )

    def written(self, meta: StepMeta) -> None:
        """P: return once this step's KV writes are complete (device memory: everything
        queued on the current stream), so that no handle of the step leaves before them;
        a step without a request prefilled for remote decode (``meta.save``) does not wait."""
        if self.park is not None and meta.parks:  # queued after the step's KV writes
            self.park.copy(meta.parks)
        if self.producer is not None and (meta.save or meta.parks):
            self.producer.written()

    def handshake_meta(self) -> RankMeta | None:
        if self.producer is None:
            return None
        park = encode_info(self.park_producer.info) if self.park_producer else b""
        return RankMeta(encode_info(self.producer.info), park)

    def start(self, meta: StepMeta) -> None:
        if self._to_prepare and self.consumer is not None:  # on its own thread
            for eid, endpoint in self._to_prepare:
                self.consumer.prepare(endpoint, eid).add_done_callback(partial(_prepared, eid))
            self._to_prepare = []
        first = self.rank == 0  # every rank sees the same lease; count it once
        for request_id, ended in meta.freed:
            self._sent.add(request_id)
            self.tally.event(f"lease_{ended}", 1, f"leases_{ended}", report=first)
        for cause, n in meta.refused.items():  # refused by P's scheduler process
            self.tally.event(f"refused_lease:{cause}", n, report=first)
        for name, n in meta.events.items():  # totals as the leases' above
            self.tally.event(name, n, name.replace("lease_", "leases_", 1), report=first)
        for text in meta.releases:
            try:
                if self.consumer is not None:
                    self.consumer.release(decode_handle(text))
                    self.tally.event("release", 1, "releases")
            except KVBridgeError as e:  # P frees the blocks at lease expiry instead
                log.warning("kvbridge: cannot release a handle at P: %s", e)
        for job in meta.loads:
            try:
                if self.consumer is None:
                    raise KVBridgeError("this engine is not a kv_consumer")
                self.loading.start(job, self._load)
            except KVBridgeError as e:
                log.error("kvbridge: request %s cannot load: %s", job.request_id, e)
                self.loading.fail(job.request_id, e)  # never queued: counted, not timed

    def _load(self, handle: TransferHandle, job: LoadJob) -> None:
        assert self.consumer is not None
        self.consumer.load(handle, kernel_tables(job.tables, self.splits), job.cached)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished sending, finished receiving, failed receiving)`` since the last call."""
        done = self.loading.finished(self.consumer.poll() if self.consumer else [])
        for out in done:
            self.tally.load(out)
            if not out.ok:
                stages = " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in out.stages.items())
                log.error(
                    "kvbridge: load of request %s failed after %.2f s (%s): %s",
                    out.request_id,
                    out.seconds,
                    stages or "no stage reached",
                    out.error,
                )
        sent, self._sent = self._sent, set()
        return sent, {o.request_id for o in done}, {o.request_id for o in done if not o.ok}

    def take_observed(self) -> tuple[list[dict[str, list[Sample]]], dict[str, int]]:
        """Loads finished and events counted since the last call (P: with the pushes this
        rank refused)."""
        if self.producer is not None:
            for cause, n in increase(self.producer.ledger.refused, self._refused).items():
                log.warning("kvbridge P rank %d refused %d push(es): %s", self.rank, n, cause)
                self.tally.event(f"refused_push:{cause}", n)
        return self.tally.take()

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        for p in (self.producer, self.park_producer):
            if p is not None:
                p.close()
        for t in self._transports:
            t.close()
