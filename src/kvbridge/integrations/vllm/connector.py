"""The class vLLM loads (``kv_connector="KVBridgeConnector"``), built twice per engine:
role SCHEDULER in the EngineCore process (:class:`SchedulerSide`), role WORKER in each
worker process (:class:`WorkerSide`). It only routes vLLM's hooks to the half that owns
them (and has ``register_kv_caches`` describe the tensors, :func:`place`)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvbridge.integrations.vllm.cache import read_cache
from kvbridge.integrations.vllm.config import read_config, setup_logging
from kvbridge.integrations.vllm.metadata import RankMeta, StepMeta
from kvbridge.integrations.vllm.placement import place
from kvbridge.integrations.vllm.scheduler import SchedulerSide
from kvbridge.integrations.vllm.stats import KVBridgePromMetrics, KVBridgeStats
from kvbridge.integrations.vllm.worker import WorkerSide


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        setup_logging()
        cfg = read_config(vllm_config.kv_transfer_config, vllm_config.model_config.hf_config)
        cache = read_cache(vllm_config, kv_cache_config)
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.sched = SchedulerSide(cfg, cache)
        else:
            from vllm.distributed import parallel_state as ps

            stage = ps.get_pp_group().rank_in_group if cache.par.pp > 1 else 0
            self.worker = WorkerSide(cfg, cache, ps.get_tensor_model_parallel_rank(), stage)

    # --- scheduler side --------------------------------------------------------------
    def _s(self) -> SchedulerSide:
        assert self.sched is not None, "scheduler hook called on a worker"
        return self.sched

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._s().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMeta:
        return self._s().step_meta(scheduler_output)

    def on_new_request(self, request: Any) -> None:
        self._s().on_new_request(request)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        ours = {r: m for r, m in metadata.items() if isinstance(m, RankMeta)}
        infos = {r: m.info for r, m in ours.items() if m.info}
        self._s().set_ranks(infos, {r: m.park for r, m in ours.items() if m.park})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's metadata, keyed ``(pp_rank, tp_rank)``: rank ``pp · tp + tp_rank``."""
        tp = self._vllm_config.parallel_config.tensor_parallel_size
        self.set_xfer_handshake_metadata({pp * tp + r: m for (pp, r), m in metadata.items()})

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # --- worker side -----------------------------------------------------------------
    def _w(self) -> WorkerSide:
        assert self.worker is not None, "worker hook called on the scheduler"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        w = self._w()
        w.register(place(self._vllm_config, w.cache, w.tp_rank, kv_caches))

    def get_handshake_metadata(self) -> RankMeta | None:
        return self._w().handshake_meta()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMeta)
        self._w().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # P's cache is read in place by D

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()  # still bound: vLLM clears it after this
        assert isinstance(meta, StepMeta)
        self._w().written(meta)  # a finished request's handle leaves only after its KV writes

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recved, failed = self._w().results()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=recved, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, recved, _ = self._w().results()
        return sent or None, recved or None

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        if self.worker is None:  # vLLM asks the scheduler's instance too
            return None
        loads, events = self.worker.take_observed()
        return KVBridgeStats(data={"loads": loads, "events": events}) if loads or events else None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+ (0.32 never asks): no sleep mode. Sleeping gives the KV memory back
        while NIXL registrations and P's mapped memory still point at it."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.sched is not None:
            self.sched.close()
