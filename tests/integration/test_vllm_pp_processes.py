"""Pipeline parallelism in the vLLM connector, on vLLM's own pieces in separate processes.

For each pair of P and D shapes, every part of each engine runs in a process of its own
(``tests.support.vllm_pp``: the scheduler's connector with the scheduler's
``KVCacheConfig``, each worker's with its stage's, caches from ``allocate_kv_cache``),
over NIXL. P's workers fill their caches with random values in the prefill step, P's
scheduler returns the handle, D's scheduler matches and allocates, D's workers load. Then
every K and V element of the request's tokens, every layer and head, on every D rank
must equal the one P's rank holding that layer and head has, each Mamba layer's conv and
SSM state in D's slot the model's in P's (gathered over P's TP shards), and every D block
outside the request must keep its old bytes; P's lease ends ``done`` (every D rank
confirmed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbridge.adapter import HANDLE_KEY, decode_handle
from kvbridge.integrations.vllm.metadata import StepMeta
from tests.support.vllm_pp import (
    HEADS,
    NB,
    Caches,
    Engine,
    Finish,
    Match,
    Prefill,
    Side,
    Step,
    Wait,
    kv_cache_configs,
    layer_name,
    vllm_config,
)
from tests.support.vllm_pp_bytes import conv_channels, kv_of, ssm_heads, state_of
from tests.support.vllm_pp_models import KINDS, MAMBA, WINDOW, layer_spec
from tests.support.zygote import Zygote

pytestmark = pytest.mark.integration

N = 150
"""Tokens P prefills (the prompt has one more: D computes it)."""

GPU = {"backend": "FLASH_ATTN"}
SWA = {"model": "swa"}
MAMBA2 = {"model": "mamba"}
CASES: dict[str, tuple[tuple, tuple]] = {  # P, then D: (TP, PP, block[, other Side fields])
    "pp2->pp2": ((1, 2, 32), (1, 2, 64)),
    "pp2->pp1": ((1, 2, 64), (1, 1, 32)),
    "pp1->pp2": ((1, 1, 32), (1, 2, 32)),
    "tp1pp2->tp2pp1": ((1, 2, 32), (2, 1, 64)),
    "pp2(3,1)->pp2": ((1, 2, 32, {"partition": "3,1"}), (1, 2, 32)),
    "gpu-tp2pp2->tp1pp2": ((2, 2, 32, {**GPU, "layout": "BLNHC"}), (1, 2, 16, GPU)),
    "swa-pp2->pp1": ((1, 2, 32, SWA), (1, 1, 64, SWA)),
    "swa-pp1->pp2": ((1, 1, 32, SWA), (1, 2, 32, SWA)),
    "swa-tp2pp1->tp1pp2(3,1)": ((2, 1, 32, SWA), (1, 2, 64, {**SWA, "partition": "3,1"})),
    "gpu-swa-pp2(3,1)->pp2": (
        (1, 2, 32, {**GPU, **SWA, "partition": "3,1"}),
        (1, 2, 64, {**GPU, **SWA}),
    ),
    "mamba-pp2->pp1": ((1, 2, 32, MAMBA2), (1, 1, 64, MAMBA2)),
    "mamba-pp1->pp2": ((1, 1, 32, MAMBA2), (1, 2, 32, MAMBA2)),
    "mamba-tp2pp1->tp1pp2(3,1)": ((2, 1, 32, MAMBA2), (1, 2, 64, {**MAMBA2, "partition": "3,1"})),
    "gpu-mamba-tp2pp1->tp1pp2(3,1)": (
        (2, 1, 32, {**GPU, **MAMBA2}),
        (1, 2, 64, {**GPU, **MAMBA2, "partition": "3,1"}),
    ),
    # P parks (park_blocks): each stage copies its layers' blocks, its caches then rewritten
    "park-swa-pp2(3,1)->pp1": (
        (1, 2, 32, {**SWA, "partition": "3,1", "park": 32}),
        (1, 1, 64, SWA),
    ),
    "park-gpu-mamba-tp2pp2->pp2": ((2, 2, 32, {**GPU, **MAMBA2, "park": 32}), (1, 2, 64, MAMBA2)),
}
"""``pp2(3,1)``: vLLM's partition set by ``VLLM_PP_LAYER_PARTITION`` (layers 0-2, 3), so
D's stage 1 reads its layers from both P stages. The ``gpu`` cases take the connector's
GPU description (vLLM's logical views; P's cache block-major) over host memory; with
(3,1) a stage holds no layer of some group (no full-attention or no Mamba layer), which
it describes as vLLM's pool, undivided. ``swa``:
gemma-3's pattern (``tests.support.vllm_pp_models``), four KV cache groups (three
sliding-window, one full), each with its own block table, all in one pool. ``mamba``:
Mamba-2 and full attention alternating (granite-4.0-h's kind), two groups; a Mamba
layer's cache is vLLM's int8 page view, its state one slot (block) per request."""


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """Imports vLLM once for the module's engine processes."""
    z = Zygote("tests.support.vllm_pp")
    yield z
    z.close()


@pytest.fixture
def engines(zygote: Zygote) -> Iterator[tuple[Zygote, list[Engine]]]:
    made: list[Engine] = []
    yield zygote, made
    for e in made:
        e.close()


def block_ids(seed: int, n: int, side: Side) -> list[list[int]]:
    """Per KV cache group, blocks of ``n`` tokens, not in order, no block in two groups
    (block 0 is vLLM's null block: a sliding-window group's blocks wholly before the
    window, which vLLM frees)."""
    free = iter(int(b) for b in np.random.default_rng(seed).permutation(range(1, NB)))
    out = []
    for kind in group_kinds(side.model):
        if kind == "mamba":  # mamba_cache_mode "none": the request's one state slot
            out.append([next(free)])
            continue
        first = (n - WINDOW + 1) // side.block if kind == "sliding" else 0
        out.append([0 if b < first else next(free) for b in range(-(-n // side.block))])
    return out


def group_kinds(model: str) -> list[str]:
    """The kind of each of vLLM's KV cache groups of ``model`` (its own grouping)."""
    side = Side("D", "kv_consumer", 1, 1, 32, model=model)
    groups = kv_cache_configs(side, vllm_config(side))[1].kv_cache_groups
    return [KINDS[model][int(g.layer_names[0].split(".")[2])] for g in groups]


def group_of(model: str, layer: int) -> int:
    """vLLM's KV cache group of ``layer``."""
    side = Side("D", "kv_consumer", 1, 1, 32, model=model)
    groups = kv_cache_configs(side, vllm_config(side))[1].kv_cache_groups
    return next(g for g, group in enumerate(groups) if layer_name(layer) in group.layer_names)


def holder(side: Side, layer: int, head: int) -> tuple[int, int]:
    """``(global rank, local head)`` of the rank of ``side`` holding ``layer``'s ``head``."""
    stage = next(s for s in range(side.pp) if layer in side.stage_layers(s))
    per = HEADS // side.tp
    return stage * side.tp + head // per, head % per


def transfer(
    engines: tuple[Zygote, list[Engine]], p_side: Side, d_side: Side
) -> tuple[list, list, list]:
    """One request P → D; P's caches, D's before and D's after, per global rank."""
    zygote, made = engines
    made.append(p := Engine(p_side, zygote))
    made.append(d := Engine(d_side, zygote))
    p.handshake()
    p_ids, d_ids = block_ids(1, N, p_side), block_ids(2, N, d_side)
    meta = p.sched(Prefill(N, p_ids))
    assert isinstance(meta, StepMeta) and meta.save and bool(meta.parks) == bool(p_side.park)
    p.each_worker(Step(meta, write=True, seed=7))
    delay, params = p.sched(Finish(p_ids))
    assert params is not None and delay != bool(p_side.park)
    p_caches = p.each_worker(Caches())
    if p_side.park:  # vLLM reuses the blocks it got back: D must read the park
        assert decode_handle(params[HANDLE_KEY]).engine_id == "P.park"
        p.each_worker(Step(p.sched(Step()), write=True, seed=99))
    d_before = d.each_worker(Caches())
    meta = d.sched(Match(params, N, d_ids))
    assert isinstance(meta, StepMeta) and len(meta.loads) == 1
    d.each_worker(Step(meta))
    for done, failed in d.each_worker(Wait("d-req")):
        assert done == {"d-req"} and not failed
    ended, end = lease_end(p.sched(Step()), p_side), time.monotonic() + 20.0
    while not ended and time.monotonic() < end:  # D's confirms reach P asynchronously
        time.sleep(0.01)
        ended = lease_end(p.sched(Step()), p_side)
    assert ended == [("p-req", "done")]
    return p_caches, d_before, d.each_worker(Caches())


def lease_end(meta: StepMeta, p_side: Side) -> list[tuple[str, str]]:
    """The lease ends a step of P reports: vLLM's blocks freed, or the park's (counted)."""
    if p_side.park:
        return [("p-req", "done")] if meta.events.get("lease_done") else []
    return meta.freed


def side(name: str, role: str, args: tuple, **kw: object) -> Side:
    """A :class:`Side` of ``(tp, pp, block[, {other fields}])``."""
    return Side(name, role, *args[:3], **(args[3] if len(args) > 3 else {}), **kw)


def check(case: str, engines: tuple[Zygote, list[Engine]], swap: bool = False) -> None:
    """``swap``: D's workers describe their heads as the other TP rank's (a control)."""
    p_args, d_args = CASES[case]
    p_side = side("P", "kv_producer", p_args)
    d_side = side("D", "kv_consumer", d_args, swap_heads=swap)
    p_caches, d_before, d_after = transfer(engines, p_side, d_side)
    p_ids, d_ids = block_ids(1, N, p_side), block_ids(2, N, d_side)
    loaded = {b for ids in d_ids for b in ids} - {0}
    others = [b for b in range(NB) if b not in loaded]
    seen = 0
    for r in range(d_side.world):
        stage, tp_rank = divmod(r, d_side.tp)
        assert set(d_after[r]) == {layer_name(i) for i in d_side.stage_layers(stage)}
        for name, after in d_after[r].items():
            layer = int(name.split(".")[2])
            g = group_of(d_side.model, layer)
            ids = (p_ids[g], d_ids[g])
            where = (case, r, name)
            if KINDS[d_side.model][layer] == "mamba":
                seen += check_state(where, p_side, p_caches, d_side, after, ids, tp_rank)
            else:
                seen += check_kv(where, p_side, p_caches, d_side, after, ids, tp_rank)
            assert np.array_equal(after[others], d_before[r][name][others]), where
    kinds = KINDS[d_side.model]
    assert seen == sum(d_side.tp if k == "mamba" else HEADS for k in kinds)  # each, once


def check_kv(
    where: tuple, p_side: Side, p_caches: list, d_side: Side, after: np.ndarray, ids: tuple, r: int
) -> int:
    """K and V of every token D needs of one attention layer, each head D rank ``r`` holds
    (``after``: its cache) equal to those of the P rank holding the head; heads checked."""
    name = where[2]
    layer = int(name.split(".")[2])
    first = N - WINDOW + 1 if KINDS[d_side.model][layer] == "sliding" else 0
    k_d, v_d = kv_of(after, ids[1], d_side.block, N, d_side.backend)
    for h in range(after.shape[1]):
        src, local = holder(p_side, layer, r * (HEADS // d_side.tp) + h)
        k_p, v_p = kv_of(p_caches[src][name], ids[0], p_side.block, N, p_side.backend)
        assert np.array_equal(k_d[first:, h], k_p[first:, local]), (*where, h, "K")
        assert np.array_equal(v_d[first:, h], v_p[first:, local]), (*where, h, "V")
    return int(after.shape[1])


def check_state(
    where: tuple, p_side: Side, p_caches: list, d_side: Side, after: np.ndarray, ids: tuple, r: int
) -> int:
    """One Mamba layer's conv and SSM state in D rank ``r``'s slot (``after``: its cache)
    equal to the model's state in P's slot, gathered from the P ranks of its stage (each
    holds its shard of the conv channels and SSM heads); 1."""
    name = where[2]
    layer = int(name.split(".")[2])
    stage = next(s for s in range(p_side.pp) if layer in p_side.stage_layers(s))
    h, k = MAMBA["heads"], MAMBA["kernel"]
    conv = np.zeros((k - 1, conv_channels(1, 0).size), np.float32)
    ssm = np.zeros((h, MAMBA["head_dim"], MAMBA["d_state"]), np.float32)
    for pr in range(p_side.tp):
        spec = layer_spec("mamba", layer, p_side.tp, p_side.block)
        c, x = state_of(p_caches[stage * p_side.tp + pr][name], spec)
        conv[:, conv_channels(p_side.tp, pr)] = c[ids[0][0]]
        ssm[ssm_heads(p_side.tp, pr)] = x[ids[0][0]]
    c, x = state_of(after, layer_spec("mamba", layer, d_side.tp, d_side.block))
    assert np.array_equal(c[ids[1][0]], conv[:, conv_channels(d_side.tp, r)]), (*where, "conv")
    assert np.array_equal(x[ids[1][0]], ssm[ssm_heads(d_side.tp, r)]), (*where, "ssm")
    return 1


@pytest.mark.parametrize("case", list(CASES))
def test_pp_load_is_byte_exact_across_processes(
    case: str, engines: tuple[Zygote, list[Engine]]
) -> None:
    """P PP 2 → D PP 2, PP 2 → PP 1, PP 1 → PP 2, TP 1 × PP 2 → TP 2 × PP 1, PP 2 of an
    uneven partition → PP 2, and TP 2 × PP 2 → TP 1 × PP 2 on the GPU description, with
    block sizes changing on the way; hybrids of sliding-window or Mamba-2 layers."""
    check(case, engines)


def test_heads_landing_on_the_wrong_tp_rank_are_caught(
    engines: tuple[Zygote, list[Engine]],
) -> None:
    """Control: D's TP ranks describe each other's heads; the load succeeds, and the
    byte check sees P's heads land on the wrong rank."""
    with pytest.raises(
        AssertionError, match=r"'tp1pp2->tp2pp1', 0, 'model\.layers\.0\.\S+, 0, 'K'"
    ):
        check("tp1pp2->tp2pp1", engines, swap=True)
