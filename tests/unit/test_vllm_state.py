"""vLLM's Mamba-2 / Gated DeltaNet state (``MambaSpec``) as the connector reads it: the
spec it derives equals the kvbridge builders', the state slot it picks follows vLLM's
rule, and a request's state moved P TP 1 → D TP 2 (and back) through the planner lands
byte-exact where vLLM's own sharding puts it (conv channels x|B|C or q|k|v split per
rank, SSM heads split) — checked against slices of torch tensors, not against the views.
Everything is built from fakes of vLLM's config objects and raw page buffers laid out
as vLLM 0.32's hybrid allocator lays them out on CPU (conv at page offset 0, SSM after
it, page padded)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbridge.api import checked_tables  # noqa: E402
from kvbridge.errors import ConfigError, PlanError  # noqa: E402
from kvbridge.integrations.vllm.cache import VllmCache, read_cache  # noqa: E402
from kvbridge.integrations.vllm.gpu_layout import gpu_rank_layout  # noqa: E402
from kvbridge.integrations.vllm.state import state_shapes  # noqa: E402
from kvbridge.plan.geometry import Geometry, Side  # noqa: E402
from kvbridge.plan.pattern import Bound  # noqa: E402
from kvbridge.spec.build import attention, gated_deltanet, mamba2  # noqa: E402
from kvbridge.spec.dtypes import DType  # noqa: E402
from kvbridge.transport.base import Region  # noqa: E402
from kvbridge.transport.loopback import Fabric, LoopbackTransport  # noqa: E402

PAGE = 16384  # bytes per block, shared by every group (the attention page)
BLOCKS = 12
# Mamba-2: 4 heads of 8, 2 groups of state 6, kernel 4; GDN: 2 k-heads of 8, 4 v-heads of 4
M2 = dict(heads=4, head_dim=8, groups=2, d_state=6, kernel=4)
GDN = dict(k_heads=2, k_dim=8, v_heads=4, v_dim=4, kernel=4)


@dataclass
class MambaSpec:  # named as vLLM's class: the connector dispatches on the name
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    block_size: int
    mamba_type: Any
    num_speculative_blocks: int = 0
    tp_replicated: bool = False


@dataclass
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: Any


def mamba_spec(kind: str, tp: int, block: int) -> MambaSpec:
    f = torch.float32
    if kind == "MAMBA2":
        h, hd, g, ds, k = (M2[x] for x in ("heads", "head_dim", "groups", "d_state", "kernel"))
        conv = (k - 1, (h * hd + 2 * g * ds) // tp)
        return MambaSpec((conv, (h // tp, hd, ds)), (f, f), block, SimpleNamespace(name=kind))
    kh, kd, vh, vd, k = (GDN[x] for x in ("k_heads", "k_dim", "v_heads", "v_dim", "kernel"))
    conv = (k - 1, (2 * kh * kd + vh * vd) // tp)
    return MambaSpec((conv, (vh // tp, vd, kd)), (f, f), block, SimpleNamespace(name=kind))


def configs(kind: str, tp: int, block: int, mode: str = "align") -> tuple[Any, Any]:
    """vLLM config fakes: layers 0, 1 Mamba (one group each), layer 2 full attention."""
    groups = [
        SimpleNamespace(kv_cache_spec=mamba_spec(kind, tp, block), layer_names=[f"m.layers.{i}.m"])
        for i in (0, 1)
    ]
    attn = FullAttentionSpec(block, 2, 8, 8, torch.float32)
    groups.append(SimpleNamespace(kv_cache_spec=attn, layer_names=["m.layers.2.attn"]))
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2, served_model_name="t"),
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
    )
    return vllm_config, SimpleNamespace(kv_cache_groups=groups, num_blocks=BLOCKS)


def test_spec_equals_the_builders() -> None:
    for tp in (1, 2):
        cache = read_cache(*configs("MAMBA2", tp, 32))
        want = mamba2(0, 4, 8, 2, 6, 4, DType.FP32, DType.FP32)
        assert cache.spec.layers[0] == want
        assert cache.spec.layers[2] == attention(2, 2, 8, DType.FP32)
        assert [g.block_size for g in cache.spec.groups] == [1, 1, 32]
        assert cache.state_blocks == {0: 32, 1: 32}
        gdn = read_cache(*configs("GDN_ATTN", tp, 32))
        assert gdn.spec.layers[1] == gated_deltanet(1, 2, 8, 4, 4, 4, DType.FP32, DType.FP32)
    a, b = read_cache(*configs("MAMBA2", 1, 32)), read_cache(*configs("MAMBA2", 2, 64))
    assert a.spec.compat_hash() == b.spec.compat_hash()  # other TP and block: same model


def test_unsupported_state_is_refused() -> None:
    vc, kc = configs("MAMBA2", 1, 32)
    kc.kv_cache_groups[0].kv_cache_spec.mamba_type = SimpleNamespace(name="SHORT_CONV")
    with pytest.raises(ConfigError, match="SHORT_CONV"):
        read_cache(vc, kc)
    vc, kc = configs("MAMBA2", 1, 32)
    kc.kv_cache_groups[0].kv_cache_spec.num_speculative_blocks = 1
    with pytest.raises(ConfigError, match="speculative"):
        read_cache(vc, kc)
    with pytest.raises(ConfigError, match="mamba_cache_mode"):
        read_cache(*configs("MAMBA2", 1, 32, mode="all"))


def test_state_slot_follows_vllms_rule() -> None:
    cache = read_cache(*configs("MAMBA2", 1, 32))
    tables = [[0, 0, 7, 9], [0, 0, 8, 10], [1, 2, 3, 4]]
    # align: the running state after n tokens is in block (n - 1) // block_size
    assert cache.tables(tables, 96).lists() == [[7], [8], [1, 2, 3, 4]]
    assert cache.tables(tables, 97).lists() == [[9], [10], [1, 2, 3, 4]]
    # a null block (0) or a short table: an empty table, which the plan refuses
    assert cache.tables(tables, 40).lists()[:2] == [[], []]
    assert cache.tables(tables, 200).lists()[:2] == [[], []]
    none = read_cache(*configs("MAMBA2", 1, 32, mode="none"))
    assert none.tables([[5], [6], [1, 2]], 50).lists() == [[5], [6], [1, 2]]


def cpu_layout(cache: VllmCache, rank: int, caches: dict[str, Any]) -> Any:
    """The description ``place`` gives vLLM's CPU attention backend's caches."""
    return gpu_rank_layout(cache, rank, caches, cpu_attn=True)


class Rank:
    """One TP rank of a vLLM engine: one raw page buffer that every layer aliases."""

    def __init__(self, cache: VllmCache, rank: int, gen: torch.Generator):
        self.cache, self.rank = cache, rank
        self.buf = torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, generator=gen)
        self.raw = {name: self.buf for name in cache.layer_names}
        # the attention layer as vLLM's CPU cache: [blocks, heads, block, 2·head] fp32
        bs = cache.spec.groups[2].block_size
        heads = 2 // cache.par.tp
        attn = self.buf.view(torch.float32)[:, : heads * bs * 16].view(BLOCKS, heads, bs, 16)
        self.raw["m.layers.2.attn"] = attn
        placed = cpu_layout(cache, rank, self.raw)
        self.layout, self.bases = placed.layout, placed.bases

    def state(self, layer: int) -> tuple[Any, Any]:
        """Conv ``[blocks, rows, channels]`` and SSM ``[blocks, heads, …]`` over the pages
        (vLLM's own arithmetic: conv at page offset 0, SSM right after it)."""
        shapes, _ = state_shapes(self.cache.kv_specs[f"m.layers.{layer}.m"])
        f = self.buf.view(torch.int32)  # fp32 state compared as bits (random bytes: NaNs)
        conv_n = int(np.prod(shapes[0]))
        conv = f[:, :conv_n].unflatten(1, shapes[0])
        ssm = f[:, conv_n : conv_n + int(np.prod(shapes[1]))].unflatten(1, shapes[1])
        return conv, ssm


def conv_split(kind: str) -> list[tuple[int, int]]:
    """Global conv segments as (units, elements per unit): x|B|C or q|k|v."""
    if kind == "MAMBA2":
        return [(M2["heads"], M2["head_dim"])] + [(M2["groups"], M2["d_state"])] * 2
    return [(GDN["k_heads"], GDN["k_dim"])] * 2 + [(GDN["v_heads"], GDN["v_dim"])]


def full_conv(kind: str, ranks: list[Rank], layer: int, slot: list[int]) -> Any:
    """The unsharded conv rows of one request, reassembled by vLLM's rule: each segment
    split in equal contiguous parts, rank r holding part r of every segment."""
    parts: list[list[Any]] = [[] for _ in conv_split(kind)]
    for r, rk in enumerate(ranks):
        conv = rk.state(layer)[0][slot[r]]
        at = 0
        for s, (units, elems) in enumerate(conv_split(kind)):
            n = units // len(ranks) * elems
            parts[s].append(conv[:, at : at + n])
            at += n
    return torch.cat([torch.cat(p, dim=1) for p in parts], dim=1)


@pytest.mark.parametrize("kind", ["MAMBA2", "GDN_ATTN"])
@pytest.mark.parametrize(("p_tp", "d_tp", "p_block", "d_block"), [(1, 2, 32, 16), (2, 1, 16, 64)])
def test_state_moves_byte_exact_across_tp(
    kind: str, p_tp: int, d_tp: int, p_block: int, d_block: int
) -> None:
    gen = torch.Generator().manual_seed(5)
    pc, dc = read_cache(*configs(kind, p_tp, p_block)), read_cache(*configs(kind, d_tp, d_block))
    p = [Rank(pc, r, gen) for r in range(p_tp)]
    d = [Rank(dc, r, gen) for r in range(d_tp)]
    n = 50
    # vLLM's block lists: align mode, the state in block (n - 1) // block_size
    p_lists = [[0] * ((n - 1) // p_block) + [3], [0] * ((n - 1) // p_block) + [5], [6, 7, 8, 9]]
    d_lists = [[0] * ((n - 1) // d_block) + [2], [0] * ((n - 1) // d_block) + [4], [6, 7, 9, 10]]
    p_tabs, d_tabs = pc.tables(p_lists, n), dc.tables(d_lists, n)
    assert p_tabs.lists()[:2] == [[3], [5]] and d_tabs.lists()[:2] == [[2], [4]]
    before = [rk.buf.clone() for rk in d]
    fabric = Fabric()
    agents = []
    for r, rk in enumerate(p):
        a = LoopbackTransport(f"p{r}", fabric)
        a.register([Region(rk.bases[0], PAGE * BLOCKS)])
        agents.append(a)
    bound = [Bound(rk.layout, tuple(rk.bases)) for rk in p]
    for r, rk in enumerate(d):
        a = LoopbackTransport(f"d{r}", fabric)
        a.register([Region(rk.bases[0], PAGE * BLOCKS)])
        d_side = Side(dc.spec, dc.par, {r: Bound(rk.layout, tuple(rk.bases))})
        geom = Geometry(Side(pc.spec, pc.par, bound), d_side, r)
        plan = geom.plan(n, p_tabs, d_tabs)
        for src, runs in plan.runs.items():
            s, dd, ln = runs.as_uint64()
            a.read(a.add_peer(agents[src].register([])), dd, s, ln)
    for layer, (ps, ds) in ((0, (3, 2)), (1, (5, 4))):
        want = full_conv(kind, p, layer, [ps] * p_tp)
        assert torch.equal(full_conv(kind, d, layer, [ds] * d_tp), want)
        p_ssm = torch.cat([rk.state(layer)[1][ps] for rk in p])
        assert torch.equal(torch.cat([rk.state(layer)[1][ds] for rk in d]), p_ssm)
    # nothing else of the state pages was written: other slots keep their bytes
    written = {2, 4, *d_tabs[2][: -(-n // d_block)]}
    for rk, old in zip(d, before, strict=True):
        for slot in range(BLOCKS):
            if slot not in written:
                assert torch.equal(rk.buf[slot], old[slot]), slot


def test_missing_state_slot_fails_the_plan() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = read_cache(*configs("MAMBA2", 1, 32))
    p, d = Rank(cache, 0, gen), Rank(cache, 0, gen)
    bound = [Bound(p.layout, tuple(p.bases))]
    d_side = Side(cache.spec, cache.par, [Bound(d.layout, tuple(d.bases))])
    geom = Geometry(Side(cache.spec, cache.par, bound), d_side, 0)
    tabs = cache.tables([[0, 0], [0, 5], [1, 2]], 40)  # layer 0's block is null
    with pytest.raises(PlanError, match="group 0"):
        geom.plan(40, tabs, cache.tables([[0, 3], [0, 4], [1, 2]], 40))


def test_layout_refuses_state_that_does_not_fit() -> None:
    cache = read_cache(*configs("MAMBA2", 1, 32))
    small = torch.zeros((BLOCKS, 64), dtype=torch.int8)
    with pytest.raises(ConfigError, match="does not fit"):
        cpu_layout(cache, 0, {"m.layers.0.m": small})


def test_block_ids_outside_the_pool_go_on_unchecked_for_the_rank_to_refuse() -> None:
    """The scheduler checks vLLM's ids against its pool once; ids it refuses reach the
    rank unchecked, whose own check refuses them, typed (that load fails alone)."""
    cache = read_cache(*configs("MAMBA2", 1, 32))
    good = cache.tables([[0, 0, 7], [0, 0, 8], [1, 2]], 96)
    assert checked_tables(good, [BLOCKS] * 3, "D") is good
    bad = cache.tables([[0, 0, 7], [0, 0, 8], [1, BLOCKS]], 96)
    assert bad.lists() == [[7], [8], [1, BLOCKS]]
    with pytest.raises(PlanError, match=f"table 2 holds block {BLOCKS}, outside"):
        checked_tables(bad, [BLOCKS] * 3, "D's block tables")
