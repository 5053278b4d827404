"""The vLLM connector on vLLM's GPU caches, driven as vLLM drives it, on CPU tensors.

vLLM's own allocator (``get_kv_cache_config_from_groups``, ``allocate_kv_cache``) makes
every rank's caches for a P and a D that differ in KV cache layout, block size, kernel block
size and TP. The attention backend is configured as ``FLASH_ATTN``, so the connector takes
its GPU path (``placement.place``), and ``KVBRIDGE_DEVICE_ON_CPU=1`` lets the CPU tensors
stand for device memory. Each engine gets the real :class:`KVBridgeConnector` for its
scheduler and for each worker (loopback transport, the real side channel): P's codes are
written through vLLM's views, P's scheduler finishes the request and returns its handle,
D's scheduler matches and allocates, D's workers load. D's storage must then equal its old
bytes with P's codes written through D's own vLLM views, byte for byte, and P's ranks
must have been announced as device memory.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge.adapter import HANDLE_KEY, decode_handle
from kvbridge.api import Tables
from kvbridge.control.channel import Client
from kvbridge.control.messages import LeaseOp, LeaseReply, PushRefused, PushRuns, tables_digest
from kvbridge.integrations.vllm import scheduler as scheduler_module
from kvbridge.integrations.vllm import worker as worker_module
from kvbridge.integrations.vllm.cache import read_cache
from kvbridge.integrations.vllm.connector import KVBridgeConnector
from kvbridge.integrations.vllm.metadata import StepMeta, decode_info
from kvbridge.integrations.vllm.placement import place
from tests.unit.test_vllm_gpu_layout import HD, KINDS, NB, layer_of, storage, write, write_tokens

HEADS = {"kv": 4, "diffkv": 4, "mla": 1, "MAMBA2": 2, "GDN_ATTN": 2}
"""KV heads of the model (all ranks together)."""


def groups(kind: str, block: int, tp: int) -> list[Any]:
    """vLLM's KV cache groups of one rank: two attention layers (``kv``: K|V of 8, fp32;
    ``diffkv``: K 8, V 4, bf16; ``mla``: a latent of 24, bf16), or a hybrid (``MAMBA2`` /
    ``GDN_ATTN``: two state layers, their page padded to the attention page, then two
    attention layers of blocks of ``block``), as ``test_vllm_gpu_layout`` builds them."""
    if kind in KINDS:
        heads, hk, hv, dt = KINDS[kind]
        spec: Any = (
            MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=hk, dtype=dt)
            if kind == "mla"
            else FullAttentionSpec(
                block_size=block, num_kv_heads=heads // tp, head_size=hk, head_size_v=hv, dtype=dt
            )
        )
        return [KVCacheGroupSpec(["m.layers.0.attn", "m.layers.1.attn"], spec)]
    calc = mamba_utils.MambaStateShapeCalculator
    if kind == "MAMBA2":  # heads 4 of 8, 2 groups of state 6, kernel 4
        shapes = calc.mamba2_state_shape(tp, 32, 2, 4, 8, 6, 4)
    else:  # 2 k-heads of 8, 4 v-heads of 4, kernel 4
        shapes = calc.gated_delta_net_state_shape(tp, 2, 4, 8, 4, 4)
    att = FullAttentionSpec(
        block_size=block, num_kv_heads=2 // tp, head_size=HD, dtype=torch.float32
    )
    ms = MambaSpec(
        block_size=block,
        shapes=shapes,
        dtypes=(torch.float32,) * 2,
        page_size_padded=att.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum[kind],
    )
    return [
        KVCacheGroupSpec(["m.layers.0.mixer", "m.layers.1.mixer"], ms),
        KVCacheGroupSpec(["m.layers.2.attn", "m.layers.3.attn"], att),
    ]


def vllm_config(name: str, role: str, kind: str, layout: str, tp: int) -> Any:
    """What the connector and vLLM's allocator read of a ``VllmConfig``."""
    extra = {"secret": "s3cret", "transport": "loopback", "model_id": "m", "timeout_s": 10}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role=role, engine_id=name, kv_connector_extra_config=extra
        ),
        model_config=SimpleNamespace(
            hf_config=None,
            served_model_name="t",
            get_total_num_kv_heads=lambda: HEADS[kind],
            dtype=torch.float32,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout[layout],
            num_gpu_blocks_override=NB,
            prefix_cache_retention_interval=None,
            mamba_cache_mode="none",
            cache_dtype="auto",
        ),
        attention_config=SimpleNamespace(
            backend=AttentionBackendEnum.FLASH_ATTN, hisparse_config=None
        ),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


class Engine:
    """One vLLM instance: its scheduler's connector and, per TP rank, a worker's connector
    with the caches vLLM allocated for it, registered as vLLM registers them."""

    def __init__(self, name: str, role: str, kind: str, side: tuple, mp: pytest.MonkeyPatch):
        conv, layout, block, kernel, tp = side
        self.tp, self.block = tp, block
        mp.setattr(mamba_utils, "is_conv_state_dim_first", lambda: conv == "DS")
        vc = vllm_config(name, role, kind, layout, tp)
        cfg = get_kv_cache_config_from_groups(vc, groups(kind, block, tp), 1 << 30)
        kernels = None if kernel is None else [kernel] * len(cfg.kv_cache_groups)
        lay = KVCacheLayout[layout]
        self.caches = [allocate_kv_cache(cfg, torch.device("cpu"), lay, kernels) for _ in range(tp)]
        self.specs = {n: g.kv_cache_spec for g in cfg.kv_cache_groups for n in g.layer_names}
        self.sched = KVBridgeConnector(vc, KVConnectorRole.SCHEDULER, cfg)
        self.workers = []
        for r in range(tp):
            mp.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda r=r: r)
            self.workers.append(KVBridgeConnector(vc, KVConnectorRole.WORKER, cfg))
            self.workers[-1].register_kv_caches(self.caches[r])
        if role == "kv_producer":
            metas = {r: w.get_handshake_metadata() for r, w in enumerate(self.workers)}
            self.sched.set_xfer_handshake_metadata(metas)

    def close(self) -> None:
        for c in [self.sched, *self.workers]:
            c.shutdown()


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Engine]]:
    monkeypatch.setenv("KVBRIDGE_DEVICE_ON_CPU", "1")
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def tokens(eng: Engine, r: int, ids: list[int], toks: range) -> None:
    """Codes of tokens ``toks`` (vLLM blocks ``ids``) through rank ``r``'s attention views."""
    for name, t in eng.caches[r].items():
        s = eng.specs[name]
        if toks and not isinstance(s, MambaSpec):
            h0 = 0 if isinstance(s, MLAAttentionSpec) else r * t.shape[1]
            write_tokens(t, layer_of(name), ids, s.block_size, toks, h0)


def prefill(p: Engine, slot: int, ids: list[int], n: int) -> dict[str, Any]:
    """P computes ``n`` tokens into vLLM blocks ``ids`` (state: ``slot``) on every rank in
    one step (a request for remote decode: its workers wait for the step's KV writes),
    then its scheduler finishes the request; the request's ``kv_transfer_params``."""
    req = SimpleNamespace(
        request_id="p-req",
        kv_transfer_params={"do_remote_decode": True},
        status=SimpleNamespace(name="FINISHED_STOPPED"),
        num_prompt_tokens=n + 1,  # P prefills one token short
        prompt_token_ids=list(range(n + 1)),
        _all_token_ids=list(range(n + 1)),
    )
    p.sched.on_new_request(req)
    assert req.num_prompt_tokens == n
    meta = p.sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"p-req": n}))
    assert isinstance(meta, StepMeta) and meta.save
    for r, w in enumerate(p.workers):
        w.bind_connector_metadata(meta)
        w.start_load_kv(SimpleNamespace())
        write((p.caches[r], p.specs), slot, ids, p.tp, r, range(len(ids) * p.block))
        for name, t in p.caches[r].items():
            w.save_kv_layer(name, t, None)
        w.wait_for_save()
        w.clear_connector_metadata()
    tables = ([slot], ids) if any(isinstance(s, MambaSpec) for s in p.specs.values()) else (ids,)
    delay, params = p.sched.request_finished_all_groups(req, tables)
    assert delay and params is not None
    return params


def test_p_waits_for_kv_writes_only_in_steps_with_a_remote_prefill(
    engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wait_for_save`` waits for the step's KV writes only in steps that schedule a
    request prefilled for remote decode (its handle may leave after the step); other steps
    (local requests, decodes) do not wait."""
    engines.append(p := Engine("P", "kv_producer", "kv", SIDES["kv"][0], monkeypatch))
    waits: list[int] = []
    for r, w in enumerate(p.workers):
        assert w.worker is not None and w.worker.producer is not None
        monkeypatch.setattr(w.worker.producer, "written", lambda r=r: waits.append(r))
    remote = SimpleNamespace(
        request_id="remote",
        kv_transfer_params={"do_remote_decode": True},
        num_prompt_tokens=9,
        prompt_token_ids=list(range(9)),
        _all_token_ids=list(range(9)),
    )
    local = SimpleNamespace(request_id="local", kv_transfer_params=None)
    p.sched.on_new_request(remote)
    p.sched.on_new_request(local)

    def step(*ids: str) -> list[int]:
        waits.clear()
        meta = p.sched.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens=dict.fromkeys(ids, 4))
        )
        for w in p.workers:
            w.bind_connector_metadata(meta)
            w.start_load_kv(SimpleNamespace())
            w.wait_for_save()
            w.clear_connector_metadata()
        return list(waits)

    assert step("local") == []
    assert step("local", "remote") == [0]
    remote.status = SimpleNamespace(name="FINISHED_STOPPED")
    p.sched.request_finished_all_groups(remote, ([1],))
    assert step("local", "remote") == []  # ended: its handle left already


def load(
    d: Engine, params: dict[str, Any], tables: tuple, n: int, cached: int, mp: pytest.MonkeyPatch
) -> None:
    """D's scheduler matches ``n - cached`` external tokens of a prompt of ``n + 1`` (D
    computes the last one; asked twice, as vLLM asks again when it cannot allocate yet)
    and allocates ``tables``, decoding the handle once; its workers load them."""
    decoded: list[object] = []

    def counted(data: object) -> object:
        decoded.append(data)
        return decode_handle(data)

    mp.setattr(scheduler_module, "decode_handle", counted)
    req = SimpleNamespace(request_id="d-req", kv_transfer_params=params, num_prompt_tokens=n + 1)
    for _ in range(2):
        ext, later = d.sched.get_num_new_matched_tokens(req, cached)
        assert (ext, later) == (n - cached, True)
    d.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: tables), ext)
    assert len(decoded) == 1  # once per request in the scheduler's process
    meta = d.sched.build_connector_meta(SimpleNamespace())
    for w in d.workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv(SimpleNamespace())
        w.clear_connector_metadata()
    for w in d.workers:
        deadline = time.monotonic() + 10
        res = w.get_transfer_results(set())
        while "d-req" not in res.finished_recving and time.monotonic() < deadline:
            time.sleep(0.005)
            res = w.get_transfer_results(set())
        assert res.finished_recving == {"d-req"} and not res.failed_recving


SIDES = {  # (conv layout, KV cache layout, block, kernel block, TP) of P, then D; cached
    "kv": (("SD", "LBHNC", 32, 16, 1), ("SD", "BHLNC", 16, None, 2), 0),
    "kv-cached": (("SD", "BLNHC", 32, None, 2), ("SD", "LBHNC", 32, 16, 1), 32),
    "diffkv": (("SD", "LBNHC", 16, None, 1), ("SD", "LBHNC", 32, 16, 2), 0),
    "mla": (("SD", "LHBNC", 16, None, 1), ("SD", "BLHNC", 32, None, 2), 0),
    "MAMBA2": (("DS", "LBHNC", 32, None, 1), ("SD", "BLHNC", 32, None, 2), 0),
    "GDN_ATTN": (("SD", "BHLNC", 32, None, 2), ("DS", "LBNHC", 32, None, 1), 0),
}
SPLITS = {  # described blocks per vLLM block, per group, on P and on D
    "kv": ((2,), (1,)),
    "kv-cached": ((1,), (2,)),
    "diffkv": ((1,), (2,)),
    "mla": ((1,), (1,)),
    "MAMBA2": ((1, 1), (1, 1)),
    "GDN_ATTN": ((1, 1), (1, 1)),
}
SLOTS = (2, 3)
"""The state slot of the request on P and on D (hybrids); attention blocks avoid it."""


def run(engines: list[Engine], case: str, mp: pytest.MonkeyPatch, n: int = 45) -> list[bool]:
    """One request P → D; per D rank, whether its storage is exactly what it should be."""
    kind = case.split("-")[0]
    p_side, d_side, cached = SIDES[case]
    engines.append(p := Engine("P", "kv_producer", kind, p_side, mp))
    engines.append(d := Engine("D", "kv_consumer", kind, d_side, mp))
    hybrid = kind in ("MAMBA2", "GDN_ATTN")
    rng = np.random.default_rng(11)
    ids = []
    for e, slot in zip((p, d), SLOTS, strict=True):
        free = [b for b in range(1, NB) if not (hybrid and b == slot)]
        ids.append([int(x) for x in rng.permutation(free)[: -(-n // e.block)]])
    params = prefill(p, SLOTS[0], ids[0], n)
    wants = []
    for r in range(d.tp):  # D's own prefix, and slots a padded block may take from P
        tokens(d, r, ids[1], range(cached))
        tokens(d, r, ids[1], range(n, len(ids[1]) * d.block))
        want = storage(next(iter(d.caches[r].values()))).clone()
        mirror = {
            nm: want.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
            for nm, t in d.caches[r].items()
        }
        write((mirror, d.specs), SLOTS[1], ids[1], d.tp, r, range(cached, n))
        wants.append(want)
    load(d, params, ([SLOTS[1]], ids[1]) if hybrid else (ids[1],), n, cached, mp)
    for w in p.workers:
        info = decode_info(w.get_handshake_metadata().info)
        assert (info.memory, info.device) == ("device", 0)
    return [torch.equal(storage(next(iter(d.caches[r].values()))), wants[r]) for r in range(d.tp)]


@pytest.mark.parametrize("case", list(SIDES))
def test_load_is_byte_exact_on_gpu_caches(
    engines: list[Engine], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case of :data:`SIDES`: K|V, K and V of different sizes, MLA, Mamba-2 and
    Gated DeltaNet hybrids; kernel blocks on P (its handle names them) or on D (its worker
    maps its tables); TP 1 → 2 and 2 → 1; a prefix D holds already."""
    assert run(engines, case, monkeypatch) == [True] * SIDES[case][1][4]
    p, d = engines
    assert p.sched.sched is not None and p.sched.sched.splits == SPLITS[case][0]
    assert {w.worker.splits for w in d.workers if w.worker} == {SPLITS[case][1]}


def test_a_broken_kernel_block_map_is_caught(
    engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: D keeps its vLLM blocks of 32 tokens as kernel blocks of 16. With the two
    kernel blocks of each vLLM block swapped in D's map, the load still succeeds, and the
    check sees the bytes land in the wrong place."""

    def swapped(tables: Tables, splits: tuple[int, ...]) -> Tables:
        ids = [
            np.array([b * s + s - 1 - j for b in tab for j in range(s)], np.int64)
            for tab, s in zip(tables.ids, splits, strict=True)
        ]
        return Tables(tuple(ids), ())  # unsealed: checked again by the Consumer

    monkeypatch.setattr(worker_module, "kernel_tables", swapped)
    assert run(engines, "kv-cached", monkeypatch) == [False]


def test_cpu_attn_keeps_the_cpu_description(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensors under vLLM's CPU backend are described as its CPU kernels keep
    them (K transposed per block: a view in pieces), in host memory."""
    monkeypatch.setenv("KVBRIDGE_DEVICE_ON_CPU", "1")
    vc = vllm_config("P", "kv_producer", "kv", "LBHNC", 1)
    cfg = get_kv_cache_config_from_groups(vc, groups("kv", 32, 1), 1 << 30)
    caches = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.LBHNC, None)
    cache = read_cache(vc, cfg)
    on_gpu = place(vc, cache, 0, caches)
    vc.attention_config.backend = AttentionBackendEnum.CPU_ATTN
    on_cpu = place(vc, cache, 0, caches)
    assert (on_gpu.memory.value, on_cpu.memory.value) == ("device", "host")
    assert on_gpu.layout.view(0, "k").pieces == ()
    assert on_cpu.layout.view(0, "k").pieces != ()


def test_refusals_at_p_reach_the_metrics(
    engines: list[Engine], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A key holder's ``confirm`` with a token P never issued (twice) is answered foreign
    and the legitimate load carries on; P's next step carries the refusals by cause (one
    WARNING line), its rank 0 alone counts them, a push refused at rank 1 is counted by
    that rank, and vLLM's Prometheus counter holds both by cause, once."""
    engines.append(p := Engine("P", "kv_producer", "kv", ("SD", "BLNHC", 32, None, 2), monkeypatch))
    engines.append(d := Engine("D", "kv_consumer", "kv", SIDES["kv"][1], monkeypatch))
    params = prefill(p, 0, [3, 5], 45)
    h = decode_handle(params[HANDLE_KEY])
    assert p.sched.sched is not None and p.sched.sched.producer is not None
    digest = tables_digest(h.block_tables, h.n_tokens)
    op = LeaseOp("confirm", h.request_id, h.lease_id, digest, "D", 0, 2, "x", "bogus")
    client = Client(p.sched.sched.producer.endpoint, b"s3cret", 3.0)
    try:
        replies = [client.call(op) for _ in range(2)]
    finally:
        client.close()
    assert replies == [LeaseReply("foreign", reason="unknown token")] * 2
    load(d, params, ([1, 4, 2],), 45, 0, monkeypatch)
    p1 = p.workers[1].worker
    assert p1 is not None and p1.producer is not None
    # vLLM's P ranks serve no push channel (no secret): the rank's handler takes it
    pushed = p1.producer._handle(PushRuns(h.request_id, b"", b"", b"", b"", b""))
    assert pushed == PushRefused(h.request_id, "no nonce")
    caplog.set_level(logging.WARNING, logger="kvbridge")
    metas = [p.sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})) for _ in "ab"]
    assert isinstance(metas[0], StepMeta) and metas[0].refused == {"unknown token": 2}
    assert isinstance(metas[1], StepMeta) and metas[1].refused == {}
    assert sum("refused 2 lease op(s): unknown token" in r.message for r in caplog.records) == 1
    stats = []
    for w in p.workers:
        for meta in metas:
            w.bind_connector_metadata(meta)
            w.start_load_kv(SimpleNamespace())
            w.clear_connector_metadata()
        stats.append(w.get_kv_connector_stats())
    events = [{k: n for k, n in s.data["events"].items() if "refused" in k} for s in stats]
    assert events == [{"refused_lease:unknown token": 2}, {"refused_push:no nonce": 1}]
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVBridgeConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}
    )
    total = KVBridgeConnector.build_kv_connector_stats()
    for s in stats:
        total.aggregate(s)
    prom.observe(total.data)
    name = "vllm:kvbridge_refused_total"
    lease = {"engine": "0", "what": "lease", "cause": "unknown token"}
    assert reg.get_sample_value(name, lease) == 2
    assert reg.get_sample_value(name, {"engine": "0", "what": "push", "cause": "no nonce"}) == 1
