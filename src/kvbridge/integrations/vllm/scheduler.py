"""Scheduler side of the vLLM connector (one per engine, in vLLM's EngineCore process;
docs/vllm.md, "How it maps onto vLLM"). P prefills a ``do_remote_decode`` request one
token short and returns ``{"kvbridge": <handle>}`` (block ids as P's workers describe
them: ``gpu_layout.kernel_tables``), holding its blocks under a lease; D queues a load of
the tokens a request's handle names beyond its local prefix-cache hit."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvbridge.adapter import (
    HANDLE_KEY,
    LoadJob,
    Requests,
    decode_handle,
    encode_handle,
    increase,
    refusal,
    state_slot,
)
from kvbridge.api import (
    ConfigError,
    Keys,
    KVBridgeError,
    PeerError,
    Producer,
    RankInfo,
    TransferHandle,
)
from kvbridge.integrations.vllm.cache import VllmCache
from kvbridge.integrations.vllm.config import ConnectorConfig
from kvbridge.integrations.vllm.gpu_layout import kernel_tables, table_splits
from kvbridge.integrations.vllm.metadata import StepMeta, decode_info
from kvbridge.integrations.vllm.park import Order
from kvbridge.integrations.vllm.park_book import Keep, ParkBook

log = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, cache: VllmCache):
        self.cfg, self.cache = cfg, cache
        self.producer: Producer | None = None
        self.requests = Requests()
        self._refused: dict[str, int] = {}
        """P: lease refusals by cause, as of the last step."""
        self.splits: tuple[int, ...] = (1,) * len(cache.spec.groups)
        """Per group: P's described blocks per vLLM block (from its ranks' layouts)."""
        self._decoded: dict[str, tuple[str, TransferHandle | None]] = {}
        """D: per waiting request, its handle text and the handle (None: malformed),
        decoded once in this process; dropped once dealt with."""
        self.park: Producer | None = None
        """P with ``park_blocks``: the P instance of its workers' parks."""
        self.book: ParkBook | None = None
        self._events: Counter[str] = Counter()
        """P: the park's requests and lease ends since the last step."""

    # --- P ---------------------------------------------------------------------------
    def set_ranks(self, infos: dict[int, bytes], parks: dict[int, bytes] | None = None) -> None:
        """P's workers' rank infos (and, with ``park_blocks``, their parks'), by rank."""
        if not self.cfg.producer:
            return
        ranks = _ranks(infos)
        if ranks:
            self.splits = table_splits(self.cache.spec, _block_sizes(ranks))
        named: list[tuple[str, str]] = []
        if parks and self.cfg.park_blocks:
            if sorted(parks) != sorted(infos):
                raise PeerError(f"workers {sorted(parks)} of {sorted(infos)} have a park")
            eid = f"{self.cfg.engine_id}.park"
            self.park = self._producer(eid, self.cfg.park_port, _ranks(parks))
            named = [(eid, self.park.endpoint)]  # D prepares both
            groups = len(self.cache.spec.groups)
            self.book = ParkBook(self.cfg.park_blocks, groups, park_keep(self.cache))
        self.producer = self._producer(self.cfg.engine_id, self.cfg.port, ranks, named)

    def _producer(
        self,
        engine_id: str,
        port: int,
        ranks: list[RankInfo],
        named: Sequence[tuple[str, str]] = (),
    ) -> Producer:
        """A P instance of ``ranks``, naming ``named`` at every handshake it answers (set
        before its ranks: it answers none before)."""
        p = Producer(
            engine_id,
            self.cache.spec,
            self.cache.par,
            self.cfg.secret,
            self.cfg.lease_s,
            self.cfg.host,
            port,
            self.cfg.model_id,
            self.cfg.advertise,
            Keys.load(self.cfg.keys_file) if self.cfg.keys_file else None,
        )
        p.companions = list(named)
        for info in ranks:
            p.add_rank(info)
        log.info("kvbridge P %s serves handshakes on %s", engine_id, p.endpoint)
        return p

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not (self.cfg.producer and params and params.get("do_remote_decode")):
            return
        self.requests.prefill_for_remote(request.request_id)
        if request.num_prompt_tokens > 1 and request.prompt_token_ids is not None:
            del request.prompt_token_ids[-1:]
            del request._all_token_ids[-1:]
            request.num_prompt_tokens -= 1
        request.max_tokens = 1
        if self.book is not None:
            self.book.watch(request.request_id, request.num_prompt_tokens)

    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.requests.finished(request.request_id)
        self._decoded.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_decode")) or self.producer is None:
            return False, None
        ok = request.status.name in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
        parked = self.book.settle(request.request_id, block_ids, ok) if self.book else None
        if not ok:
            return False, None  # aborted or never prefilled: nothing for D
        n, prompt = request.num_prompt_tokens, getattr(request, "prompt_token_ids", None)
        handle = None if parked is None else self._parked(request.request_id, parked, n, prompt)
        if self.book is not None:
            self._events["park_parked" if handle is not None else "park_held"] += 1
        if handle is not None:  # vLLM frees its blocks now
            return False, {HANDLE_KEY: encode_handle(handle)}
        tables = kernel_tables(self.cache.tables(block_ids, n), self.splits)
        handle = self.producer.prefill_done(request.request_id, tables, n, prompt=prompt)
        return True, {HANDLE_KEY: encode_handle(handle)}

    def _parked(
        self, request_id: str, slots: list[Any], n: int, prompt: Any
    ) -> TransferHandle | None:
        """The park's handle of ``request_id`` (its ``slots``), or None (slots back)."""
        assert self.park is not None and self.book is not None
        try:
            tables = kernel_tables(self.cache.tables(slots, n, self.cfg.park_blocks), self.splits)
            return self.park.prefill_done(request_id, tables, n, prompt=prompt)
        except KVBridgeError as e:  # served from vLLM's blocks instead
            log.warning(
                "kvbridge P %s: request %s not parked: %s", self.cfg.engine_id, request_id, e
            )
            self.book.ended(request_id)
            return None

    # --- D ---------------------------------------------------------------------------
    def _incoming(self, request: Any) -> tuple[Any, TransferHandle | None] | None:
        """D: ``request``'s handle text and handle (None: malformed, which the workers
        report, by policy), decoded once per request; None where D loads nothing for it
        (no handle, not a consumer, or its load begun)."""
        text = (request.kv_transfer_params or {}).get(HANDLE_KEY)
        if text is None or not self.cfg.consumer or self.requests.begun(request.request_id):
            return None
        known = self._decoded.get(request.request_id)
        if known is None or known[0] != text:
            try:  # vLLM's transfer params are JSON: a handle is text, anything else malformed
                handle = decode_handle(text) if isinstance(text, str) else None
            except KVBridgeError:
                handle = None
            known = self._decoded[request.request_id] = (text, handle)
        return known

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        got = self._incoming(request)
        n = 0 if got is None else _tokens(request, got[1])
        return (n - num_computed, True) if n > num_computed else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        got = self._incoming(request)
        if got is None:
            return
        text, handle = got
        self._decoded.pop(request.request_id, None)
        # vLLM's prompt_token_ids: none for a prompt given as embeddings
        prompt = getattr(request, "prompt_token_ids", None)
        refused = "" if handle is None else refusal(handle, prompt)
        if num_external <= 0:
            # D's own cache holds the prompt: P may free the request's blocks now rather
            # than at lease expiry (not another prompt's: that would end its lease)
            if refused:
                log.warning(
                    "kvbridge: request %s keeps its handle: %s", request.request_id, refused
                )
            self.requests.release(request.request_id, "" if refused else str(text))
            return
        n = _tokens(request, handle)
        tables = self.cache.tables(blocks.get_block_ids(), n)
        job = LoadJob(request.request_id, str(text), tables, n - num_external, refused)
        self.requests.load(job)

    # --- both ------------------------------------------------------------------------
    def step_meta(self, scheduled: Any = None) -> StepMeta:
        """``scheduled``: vLLM's scheduler output for the step (its requests' ids are the
        keys of ``num_scheduled_tokens``; None: assume a remote-decode request is in it)."""
        freed = (
            [(f.request_id, f.reason.value) for f in self.producer.freed()] if self.producer else []
        )
        ids = getattr(scheduled, "num_scheduled_tokens", None)
        save = self.requests.any_remote(ids)
        refused = increase(self.producer.leases.refused, self._refused) if self.producer else {}
        for cause, n in refused.items():  # one line per cause and step, however many
            log.warning("kvbridge P %s refused %d lease op(s): %s", self.cfg.engine_id, n, cause)
        loads, releases = self.requests.take()
        parks = self._parks(scheduled)
        events, self._events = dict(self._events), Counter()
        return StepMeta(loads, freed, releases, save, refused, events, parks)

    def _parks(self, scheduled: Any) -> list[Order]:
        """The park's slots of ended leases back, then this step's copies."""
        if self.book is None or self.park is None:
            return []
        for f in self.park.freed():
            self.book.ended(f.request_id)
            self._events[f"lease_{f.reason.value}"] += 1
        return self.book.orders(scheduled) if scheduled is not None else []

    def close(self) -> None:
        for p in (self.producer, self.park):
            if p is not None:
                p.close()


def park_keep(cache: VllmCache) -> Keep:
    """The block table positions D may read, per group, after P prefilled ``n`` tokens:
    a state group's one slot (as :meth:`VllmCache.tables` cuts it), an attention group's
    blocks holding the tokens its layers need (``Layer.needed_tokens``: a window's last)."""
    spec = cache.spec

    def keep(g: int, n: int) -> range:
        if g in cache.state_blocks:
            at = state_slot(cache.state_blocks[g], cache.state_mode, n)  # as the handle's
            return range(at, at + 1)
        start, end = spec.layers[spec.groups[g].layers[0]].needed_tokens(n, 0)
        size = spec.groups[g].block_size
        return range(start // size, -(-end // size))

    return keep


def _ranks(infos: dict[int, bytes]) -> list[RankInfo]:
    ranks: list[RankInfo] = [decode_info(b) for _, b in sorted(infos.items())]
    for r, info in zip(sorted(infos), ranks, strict=True):
        if info.rank != r:  # a worker whose PP stage or TP rank is not the one it says
            raise PeerError(f"the worker of rank {r} announced rank {info.rank}")
    return ranks


def _block_sizes(ranks: list[RankInfo]) -> tuple[int, ...]:
    """Per group, the tokens per block every rank describes (one handle's ids serve them
    all, and D plans every P rank in rank 0's): a ConfigError where two ranks differ (a
    PP stage holding no layer of a group describes it in vLLM's blocks; a stage holding
    some may split them in kernel blocks)."""
    first = tuple(ranks[0].block_sizes)
    for info in ranks[1:]:
        if tuple(info.block_sizes) != first:
            raise ConfigError(
                f"P's rank {info.rank} describes its groups in blocks of "
                f"{list(info.block_sizes)} tokens, rank {ranks[0].rank} in {list(first)}: "
                "one handle cannot name both (kernel blocks on a PP stage, vLLM's blocks "
                "on a stage holding none of the group's layers)"
            )
    return first


def _tokens(request: Any, handle: TransferHandle | None) -> int:
    """Prompt tokens D loads for ``request``: the handle's, never its last one (a
    malformed handle: all but the last; the workers report the failure, by policy)."""
    last = request.num_prompt_tokens - 1
    return last if handle is None else min(handle.n_tokens, last)
