"""The vLLM connector under pipeline parallelism: what each process makes of its stage's
``KVCacheConfig`` (vLLM's own, from ``get_kv_cache_configs``), and the typed errors for
configurations it cannot serve. The transfers themselves: ``tests/integration/
test_vllm_pp_processes.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
import torch
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge.api import ConfigError, PeerError
from kvbridge.integrations.vllm.cache import read_cache
from kvbridge.integrations.vllm.connector import KVBridgeConnector
from kvbridge.integrations.vllm.placement import place
from tests.support.vllm_pp import (
    LAYERS,
    Side,
    attention_spec,
    kv_cache_configs,
    layer_name,
    vllm_config,
)
from tests.support.vllm_pp_models import hf_config, layer_spec, mamba_spec

P2 = Side("P", "kv_producer", 1, 2, 32, "loopback")
LBHNC = KVCacheLayout.LBHNC


def worker(
    side: Side,
    cfg: Any,
    stage: int,
    tp_rank: int,
    mp: pytest.MonkeyPatch,
    kernel: list[int] | None = None,
) -> Any:
    """The worker connector of (``stage``, ``tp_rank``) given ``cfg``, caches registered
    (``kernel``: vLLM's kernel block size of each group, as its runner may choose them)."""
    mp.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
    mp.setattr(parallel_state, "get_pp_group", lambda: type("G", (), {"rank_in_group": stage}))
    conn = KVBridgeConnector(vllm_config(side), KVConnectorRole.WORKER, cfg)
    lay = KVCacheLayout.LBHNC
    conn.register_kv_caches(allocate_kv_cache(cfg, torch.device("cpu"), lay, kernel))
    return conn


@pytest.fixture
def made() -> Iterator[list[Any]]:
    conns: list[Any] = []
    yield conns
    for c in conns:
        c.shutdown()


@pytest.mark.parametrize("partition", [None, "3,1"])
@pytest.mark.parametrize(("model", "tp"), [("full", 1), ("swa", 1), ("swa", 2), ("mamba", 2)])
def test_every_process_plans_with_the_whole_model(
    model: str, tp: int, partition: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker's config names its stage's layers only, the scheduler's stage 0's; all
    make the same spec of every layer (that of a PP 1 engine: its compatibility hash) and
    vLLM's layer partition as the stages (``VLLM_PP_LAYER_PARTITION`` too). ``swa``: four
    groups (three sliding, one full), each stage holding layers of two, none of the
    others; ``mamba``: a state and a full group."""
    if partition:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    stages = ((0, 3), (3, 4)) if partition else ((0, 2), (2, 4))
    side = Side("P", "kv_producer", tp, 2, 32, "loopback", model=model)
    vc = vllm_config(side)
    workers, sched = kv_cache_configs(side, vc)
    caches = [read_cache(vc, c) for c in (*workers, sched)]
    one = Side("D", "kv_consumer", tp, 1, 32, model=model)
    flat = read_cache(vllm_config(one), kv_cache_configs(one, vllm_config(one))[1])
    assert [c.stage for c in caches] == [s for s in (0, 1) for _ in range(tp)] + [0]
    assert [sorted(c.layer_names.values()) for c in caches] == [
        list(range(*stages[s])) for s in (0, 1) for _ in range(tp)
    ] + [list(range(*stages[0]))]
    assert len(flat.spec.groups) == {"full": 1, "swa": 4, "mamba": 2}[model]
    for c in caches:
        assert c.par.stages == stages and c.par.pp == 2
        assert c.spec == flat.spec and len(c.spec.layers) == LAYERS
        assert c.spec.compat_hash() == flat.spec.compat_hash()
        assert c.state_blocks == flat.state_blocks


def test_a_worker_given_another_stage_s_layers_is_refused(
    made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker of PP stage 1 with stage 0's config: a ConfigError naming both."""
    workers, _ = kv_cache_configs(P2, vllm_config(P2))
    with pytest.raises(ConfigError, match=r"PP stage 1: .* layers of stage 0 \(\(0, 2\)\)"):
        made.append(worker(P2, workers[0], 1, 0, monkeypatch))


def test_layers_that_are_no_stage_s_are_refused() -> None:
    """A stage whose layers are not one range of vLLM's partition (layers 1 and 2 for
    stages [0, 2), [2, 4))."""
    specs = [{layer_name(i): attention_spec(P2) for i in ix} for ix in ((1, 2), (0, 3))]
    vc = vllm_config(P2)
    workers, _ = kv_cache_configs(P2, vc, specs)
    with pytest.raises(ConfigError, match=r"holds KV layers 1\.\.2 \(2 layers\), which are no"):
        read_cache(vc, workers[0])


@pytest.mark.parametrize(
    ("held", "worker", "said"),
    [
        (((0,), (2, 3)), 0, r"KV layers 0 \(1 layers\).*stage 0's layers 1 keep no KV cache: "
         "likely layers without attention"),
        (((0, 1), (2, 3, 4)), 1, r"KV layers 2\.\.4 \(3 layers\).*layers 4 lie past the "
         "model's 4 layers: likely MTP or draft layers"),
        (((1, 2), (0, 3)), 0, r"layers 2 are other stages' than stage 0's 0\.\.1: likely a "
         "layer partition that differs"),
    ],
)  # fmt: skip
def test_a_stage_of_other_layers_is_refused_saying_what_it_holds_and_why(
    held: tuple[tuple[int, ...], ...], worker: int, said: str
) -> None:
    """A stage [0, 2) without KV for layer 1 (no attention there), a last stage with a
    layer past the model's 4 (an MTP layer), a stage holding another stage's layer: the
    ConfigError names what the stage holds against its stage and the likely cause."""
    specs = [{layer_name(i): attention_spec(P2) for i in ix} for ix in held]
    vc = vllm_config(P2)
    workers, _ = kv_cache_configs(P2, vc, specs)
    with pytest.raises(ConfigError, match=said):
        read_cache(vc, workers[worker])


def hybrid(
    model: str = "swa", kinds: tuple[str, ...] | None = None, specs: list[dict] | None = None
) -> tuple[Any, list[Any]]:
    """vLLM's config of P PP 2 with ``model`` and the workers' ``KVCacheConfig``s, its
    ``hf_config`` saying the layers are ``kinds`` (default: what they are)."""
    side = Side("P", "kv_producer", 1, 2, 32, "loopback", model=model)
    vc = vllm_config(side)
    workers, _ = kv_cache_configs(side, vc, specs)
    vc.model_config.hf_config = hf_config(model, kinds)
    return vc, workers


def test_several_groups_without_hf_config_are_refused() -> None:
    """Which group a layer of another stage is in, only the model's layer pattern tells."""
    vc, workers = hybrid()
    vc.model_config.hf_config = None
    for cfg in workers:
        with pytest.raises(ConfigError, match="several KV cache groups: the model has no hf_c"):
            read_cache(vc, cfg)


def test_a_layer_pattern_disagreeing_with_vllm_is_refused() -> None:
    """The config makes layer 1 full where vLLM caches it sliding: stage 0 refuses; stage
    1, whose own layers agree, refuses too (its regrouped model has two groups, not 4)."""
    vc, workers = hybrid(kinds=("sliding", "full", "sliding", "full"))
    with pytest.raises(ConfigError, match="layer 1: vLLM caches it as sliding, the model's c"):
        read_cache(vc, workers[0])
    with pytest.raises(ConfigError, match="regrouped has 2 KV cache groups; vLLM gave this st"):
        read_cache(vc, workers[1])


def test_a_regrouping_that_differs_from_vllm_s_is_refused() -> None:
    """Layers of the right kinds, grouped otherwise: the config says 2 full layers (vLLM
    would group ``[2, 3]`` together) where vLLM grouped layer 3 alone."""
    vc, workers = hybrid(kinds=("sliding", "sliding", "full", "full"))
    with pytest.raises(ConfigError, match="regrouped has 2 KV cache groups; vLLM gave this st"):
        read_cache(vc, workers[0])


def test_a_kind_no_group_has_is_refused() -> None:
    """The config makes layer 2 (stage 1's) sliding; vLLM's groups are state and full."""
    vc, workers = hybrid("mamba", kinds=("mamba", "full", "sliding", "full"))
    vc.model_config.hf_config.data["sliding_window"] = 64
    with pytest.raises(ConfigError, match="makes layer 2 a sliding layer, but vLLM's KV cach"):
        read_cache(vc, workers[0])


def test_two_groups_of_one_kind_with_different_specs_are_refused() -> None:
    """Sliding windows of 32 and 64 tokens: a sliding layer of another stage could be in
    either group."""
    side = Side("P", "kv_producer", 1, 2, 32, "loopback", model="swa")
    specs = [
        {layer_name(i): layer_spec("swa", i, 1, 32) for i in side.stage_layers(s)} for s in (0, 1)
    ]
    specs[0][layer_name(0)] = SlidingWindowSpec(
        block_size=32, num_kv_heads=4, head_size=64, dtype=torch.float32, sliding_window=32
    )
    vc, workers = hybrid(specs=specs)
    with pytest.raises(ConfigError, match="groups of kind sliding have different specs"):
        read_cache(vc, workers[0])


def test_hybrid_layers_that_are_no_stage_s_are_refused() -> None:
    """Layers 1 and 2 for a stage of vLLM's partition [0, 2), [2, 4)."""
    specs = [{layer_name(i): layer_spec("swa", i, 1, 32) for i in ix} for ix in ((1, 2), (0, 3))]
    vc, workers = hybrid(specs=specs)
    with pytest.raises(ConfigError, match=r"holds KV layers 1\.\.2 \(2 layers\), which are no"):
        read_cache(vc, workers[0])


def test_a_model_of_state_layers_only_is_refused() -> None:
    """One group of Mamba layers: kept refused (no PP transfer of such a model proven)."""
    side = Side("P", "kv_producer", 1, 2, 32, "loopback", model="mamba")
    page = layer_spec("mamba", 0, 1, 32).page_size_bytes
    specs = [{layer_name(i): mamba_spec(1, 32, page) for i in side.stage_layers(s)} for s in (0, 1)]
    vc, workers = hybrid("mamba", specs=specs)
    with pytest.raises(ConfigError, match="a model of state layers \\(Mamba\\) only is not"):
        read_cache(vc, workers[1])


SHAPES = {  # heads of layer i in stage s
    "within a stage": lambda s, i: 128 if i == 1 else 64,
    "between stages": lambda s, i: 64 if s == 0 else 128,
}


@pytest.mark.parametrize("case", SHAPES)
def test_layers_of_different_shapes_under_pp_are_refused(case: str) -> None:
    """Heads of 64 and of 128 in one stage, or 64 in stage 0 and 128 in stage 1 (each
    stage alone looking uniform): vLLM's config of every stage shows the model's shapes
    differ (``UniformTypeKVCacheSpecs``), and every stage refuses it (accepted, each
    stage would plan another spec)."""
    heads = SHAPES[case]
    specs = [
        {layer_name(i): attention_spec(P2, heads(s, i)) for i in P2.stage_layers(s)}
        for s in range(2)
    ]
    vc = vllm_config(P2)
    vc.cache_config.num_gpu_blocks_override = 64
    workers, _ = kv_cache_configs(P2, vc, specs)
    for cfg in workers:
        with pytest.raises(ConfigError, match="several KV shapes; PP needs one KV shape"):
            read_cache(vc, cfg)


@pytest.mark.parametrize("key", ["prefill_context_parallel_size", "decode_context_parallel_size"])
def test_context_parallelism_is_refused(key: str) -> None:
    vc = vllm_config(P2)
    setattr(vc.parallel_config, key, 2)
    workers, _ = kv_cache_configs(
        P2,
        vllm_config(P2),
        [{layer_name(i): attention_spec(P2) for i in P2.stage_layers(s)} for s in range(2)],
    )
    with pytest.raises(ConfigError, match=f"{key} 2: the vLLM connector supports 1"):
        read_cache(vc, workers[0])


def test_a_worker_announcing_another_rank_is_refused(
    made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's engine core keys each worker's metadata by its (pp_rank, tp_rank); metadata
    that names another rank (two stages' swapped) stops P's scheduler with a PeerError;
    in order, P's scheduler knows all ranks."""
    vc = vllm_config(P2)
    workers, sched_cfg = kv_cache_configs(P2, vc)
    for stage in range(2):
        made.append(worker(P2, workers[stage], stage, 0, monkeypatch))
    metas = [w.get_handshake_metadata() for w in made]
    made.append(sched := KVBridgeConnector(vc, KVConnectorRole.SCHEDULER, sched_cfg))
    with pytest.raises(PeerError, match="the worker of rank 0 announced rank 1"):
        sched.set_xfer_handshake_metadata_pp_aware({(0, 0): metas[1], (1, 0): metas[0]})
    sched.set_xfer_handshake_metadata_pp_aware({(0, 0): metas[0], (1, 0): metas[1]})
    assert sched.sched is not None and sched.sched.producer is not None
    assert sorted(sched.sched.producer.ranks) == [0, 1]


GPU3_1 = {"backend": "FLASH_ATTN", "transport": "loopback"}


@pytest.mark.parametrize("model", ["swa", "mamba"])
def test_a_stage_holding_no_layer_of_a_group_describes_it_in_vllm_s_blocks(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU description (``FLASH_ATTN`` over host memory), PP 2 of partition (3,1):
    stage 0 holds no full-attention layer of ``swa``, stage 1 no sliding one (``mamba``:
    no state layer). Such a group has no view there and is vLLM's pool, undivided: its
    block size vLLM's, its blocks ``KVCacheConfig.num_blocks``, the pool of the others."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    side = Side("P", "kv_producer", 1, 2, 32, model=model, **GPU3_1)
    vc = vllm_config(side)
    workers, _ = kv_cache_configs(side, vc)
    lacking = 0
    for cfg in workers:
        cache = read_cache(vc, cfg)
        placed = place(vc, cache, 0, allocate_kv_cache(cfg, torch.device("cpu"), LBHNC, None))
        lay, spec = placed.layout, cache.spec
        held = {spec.group_of(i) for i in cache.layer_names.values()}
        viewed = {spec.group_of(v.layer) for v in lay.views}
        assert viewed == held and len(set(lay.pools)) == 1 and set(placed.splits) == {1}
        for g in set(range(len(spec.groups))) - held:
            assert (lay.block_sizes[g], lay.num_blocks[g]) == (spec.groups[g].block_size, 96)
            lacking += 1
    assert lacking == {"swa": 4, "mamba": 1}[model]  # swa: 3 sliding groups, 1 full


def test_a_group_of_the_stage_s_own_layers_unregistered_is_still_refused() -> None:
    """PP 2 (layers 0-1, 2-3 of ``swa``): stage 1's caches without its full layer 3."""
    side = Side("P", "kv_producer", 1, 2, 32, model="swa", **GPU3_1)
    vc = vllm_config(side)
    cfg = kv_cache_configs(side, vc)[0][1]
    cache = read_cache(vc, cfg)
    caches = allocate_kv_cache(cfg, torch.device("cpu"), LBHNC, None)
    del caches[layer_name(3)]
    with pytest.raises(
        ConfigError,
        match=r"none of its layers \(of this PP stage's layers 2\.\.3, it holds \[3\]\)",
    ):
        place(vc, cache, 0, caches)


def test_p_stages_describing_a_group_in_different_blocks_are_refused(
    made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Partition (3,1) of ``swa``: stage 1's full layer in vLLM kernel blocks of 16 (the
    GPU description splits its blocks of 32 in two), stage 0, holding no full layer,
    describes that group in vLLM's blocks: one handle cannot name both, so P's scheduler
    refuses them at start; both in vLLM's blocks, it serves them undivided."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    side = Side("P", "kv_producer", 1, 2, 32, model="swa", **GPU3_1)
    vc = vllm_config(side)
    workers, sched_cfg = kv_cache_configs(side, vc)
    for kernel in ([32, 32, 32, 32], [32, 32, 32, 16]):
        ws = [worker(side, workers[s], s, 0, monkeypatch, kernel if s else None) for s in (0, 1)]
        made.extend(ws)
        metas = {(s, 0): w.get_handshake_metadata() for s, w in enumerate(ws)}
        made.append(sched := KVBridgeConnector(vc, KVConnectorRole.SCHEDULER, sched_cfg))
        if kernel[3] == 32:
            sched.set_xfer_handshake_metadata_pp_aware(metas)
            assert sched.sched is not None and sched.sched.splits == (1, 1, 1, 1)
            continue
        with pytest.raises(
            ConfigError,
            match=r"rank 1 describes its groups in blocks of \[32, 32, 32, 16\] tokens, "
            r"rank 0 in \[32, 32, 32, 32\]",
        ):
            sched.set_xfer_handshake_metadata_pp_aware(metas)
