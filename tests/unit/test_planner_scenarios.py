"""Named planner scenarios: bytes equal the element-wise reference, descriptor counts."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.spec import (
    DType,
    Group,
    Kind,
    ModelSpec,
    Parallel,
    attention,
    group_by_kind,
    mamba2,
    mla,
    state,
    state_tensor,
)
from tests.support.scenario import Side, run_scenario


def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def llama(layers: int = 4, heads: int = 8, bs: int = 16) -> ModelSpec:
    return group_by_kind("llama", [attention(i, heads, 64) for i in range(layers)], bs)


def run(p_spec, d_spec, p_tp, d_tp, p_lay, d_lay, n, cached=0, shuffle=True, blocks=64):
    p = Side(p_spec, Parallel(tp=p_tp), p_lay, blocks)
    d = Side(d_spec, Parallel(tp=d_tp), d_lay, blocks)
    return run_scenario(p, d, n, cached, rng(), shuffle)


def test_homogeneous_gqa_consecutive_is_one_run_per_layer():
    s = llama()
    plans = run(s, s, 1, 1, "nhd", "nhd", 256, shuffle=False)
    plan = plans[0]
    assert plan.descriptors == 4  # 16 consecutive blocks × 4 layers, coalesced per layer
    assert plan.nbytes == 256 * 4 * 2 * 8 * 64 * 2


def test_homogeneous_gqa_shuffled_is_one_run_per_block_and_layer():
    s = llama()
    plan = run(s, s, 1, 1, "nhd", "nhd", 256)[0]
    assert 16 * 4 - 4 <= plan.descriptors <= 16 * 4  # rare neighbours may still merge
    assert plan.summary().bytes_by_kind["full"] == plan.nbytes


def test_hnd_head_split_keeps_descriptor_count_of_1_to_1():
    s = llama()
    # [blocks][heads][K|V][tokens][dim]: a rank's heads are one run per block
    one = run(s, s, 1, 1, "hnd", "hnd", 256)[0]
    two = run(s, s, 1, 2, "hnd", "hnd", 256)
    assert 16 * 4 - 4 <= one.descriptors <= 16 * 4  # blocks whose ids chain by chance merge
    assert [p.descriptors for p in two.values()] == [16 * 4, 16 * 4]
    assert all(p.nbytes == one.nbytes // 2 for p in two.values())
    # NHD with a head split cannot keep runs long
    nhd = run(s, s, 1, 2, "nhd", "nhd", 256)
    assert nhd[0].descriptors >= 16 * 16 * 4


def test_2_to_1_reads_from_both_p_ranks():
    s = llama()
    plan = run(s, s, 2, 1, "hnd", "nhd", 100)[0]
    summary = plan.summary()
    assert [src.rank for src in summary.sources] == [0, 1]
    assert summary.sources[0].bytes == summary.sources[1].bytes == plan.nbytes // 2


def test_non_divisible_tp_3_to_2_and_2_to_3():
    s = llama(heads=6)
    for p_tp, d_tp in [(3, 2), (2, 3)]:
        plans = run(s, s, p_tp, d_tp, "hnd", "nhd", 77)
        assert sum(p.nbytes for p in plans.values()) == 77 * 4 * 2 * 6 * 64 * 2


def mla_spec(layers: int = 4) -> ModelSpec:
    return group_by_kind("mla", [mla(i, 72) for i in range(layers)])


def test_mla_read_from_one_rank_with_sources_spread():
    s = mla_spec()
    plan = run(s, s, 2, 1, "nhd", "nhd", 50)[0]
    srcs = plan.summary().sources
    assert [x.rank for x in srcs] == [0, 1]
    assert srcs[0].bytes == srcs[1].bytes  # layers alternate between the two P ranks
    assert plan.nbytes == 50 * 4 * 72 * 2  # each latent read exactly once
    d4 = run(s, s, 1, 4, "nhd", "hnd", 50)
    assert all(p.nbytes == 50 * 4 * 72 * 2 for p in d4.values())  # replicated on every D rank


def test_full_and_mla_mixed_in_one_group():
    layers = [attention(0, 4, 32), mla(1, 40), attention(2, 4, 32), mla(3, 40)]
    s = ModelSpec("mixed", tuple(layers), (Group("attn", (0, 1, 2, 3), 16),))
    for p_tp, d_tp in [(1, 2), (2, 1)]:
        plans = run(s, s, p_tp, d_tp, "nhd", "block-major", 90)
        by_kind = [p.summary().bytes_by_kind for p in plans.values()]
        assert sum(k["mla"] for k in by_kind) == 90 * 2 * 40 * 2 * d_tp
        assert sum(k["full"] for k in by_kind) == 90 * 2 * 2 * 4 * 32 * 2


def test_sliding_window_moves_only_the_window_blocks():
    layers = [attention(i, 4, 32, kind=Kind.SLIDING, window=33) for i in range(2)]
    layers += [attention(2, 4, 32)]
    s = group_by_kind("gemma", layers, 16)
    plan = run(s, s, 1, 1, "nhd", "nhd", 200, shuffle=False)[0]
    kinds = plan.summary().bytes_by_kind
    assert kinds["sliding"] == 2 * 32 * 2 * 4 * 32 * 2  # W-1 = 32 tokens per layer
    assert kinds["full"] == 200 * 2 * 4 * 32 * 2


def test_chunked_moves_only_the_current_chunk():
    layers = [attention(0, 4, 32, kind=Kind.CHUNKED, chunk=64), attention(1, 4, 32)]
    s = group_by_kind("llama4", layers, 16)
    plan = run(s, s, 1, 2, "hnd", "nhd", 150)
    assert sum(p.summary().bytes_by_kind["chunked"] for p in plan.values()) == 22 * 2 * 4 * 32 * 2


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (4, 2)])
def test_mamba2_conv_xbc_and_ssm(p_tp, d_tp):
    layers = [mamba2(0, 8, 16, 2, 8, 4), attention(1, 4, 32), mamba2(2, 8, 16, 2, 8, 4)]
    s = group_by_kind("nemotron-h", layers, 16)
    plans = run(s, s, p_tp, d_tp, "nhd", "hnd", 40)
    state_bytes = sum(p.summary().bytes_by_kind["state"] for p in plans.values())
    assert state_bytes == s.state_bytes  # every state byte read exactly once over D ranks


def kimi_like(bs: int = 16) -> ModelSpec:
    f32 = DType.FP32
    kda = [
        state_tensor("conv_q", 3, [(4, 16)]),
        state_tensor("conv_k", 3, [(4, 16)]),
        state_tensor("recurrent", 1, [(4, 16 * 16)], f32),
    ]
    layers = [state(0, kda), state(1, kda), mla(2, 72), state(3, kda), mla(4, 72)]
    groups = (Group("kda", (0, 1, 3), 1), Group("mla", (2, 4), bs))
    return ModelSpec("kimi-like", tuple(layers), groups)


@pytest.mark.parametrize(("p_tp", "d_tp", "p_bs", "d_bs"), [(2, 1, 16, 16), (1, 1, 16, 32)])
def test_kimi_linear_shared_pool(p_tp, d_tp, p_bs, d_bs):
    p_spec = kimi_like().with_block_sizes(p_bs)
    d_spec = kimi_like().with_block_sizes(d_bs)
    plans = run(p_spec, d_spec, p_tp, d_tp, "shared-pool", "shared-pool", 70, blocks=40)
    kinds = plans[0].summary().bytes_by_kind
    assert kinds["state"] == kimi_like().state_bytes
    assert kinds["mla"] == 70 * 2 * 72 * 2


def test_layout_conversion_nhd_to_hnd_and_per_layer_to_block_major():
    s = llama()
    run(s, s, 1, 1, "nhd", "hnd", 100)
    plan = run(s, s, 1, 1, "nhd", "block-major", 96, shuffle=False)[0]
    assert plan.descriptors == 6 * 4  # no run spans two layers of a block-major D block


@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 32), (32, 16), (16, 24), (1, 16), (24, 16)])
def test_block_size_pairs(p_bs, d_bs):
    s = llama(layers=2, heads=4)
    run(s.with_block_sizes(p_bs), s.with_block_sizes(d_bs), 1, 2, "hnd", "nhd", 101, blocks=128)


def test_cached_prefix_moves_only_uncached_tokens():
    s = llama()
    full = run(s, s, 1, 1, "nhd", "nhd", 100)[0].nbytes
    part = run(s, s, 1, 1, "nhd", "nhd", 100, cached=37)[0].nbytes
    assert part == full * 63 // 100
    none = run(s, s, 1, 1, "nhd", "nhd", 100, cached=100)[0]
    assert none.nbytes == 0 and none.descriptors == 0


def test_pp_on_either_side():
    s = llama(layers=6)
    p = Side(s, Parallel(tp=2, pp=2), "hnd", 32)
    d = Side(s, Parallel(tp=1, pp=3), "nhd", 32)
    plans = run_scenario(p, d, 45, 0, rng())
    assert sum(pl.nbytes for pl in plans.values()) == 45 * 6 * 2 * 8 * 64 * 2
    assert {src for pl in plans.values() for src in pl.runs} == {0, 1, 2, 3}


def test_partly_consecutive_ids_coalesce_per_streak():
    s = llama()
    p_ids = [[3, 4, 5, 9, 10, 20, 21, 22]]  # streaks 3, 2, 3 on P
    d_ids = [[7, 8, 9, 0, 1, 30, 31, 2]]  # streaks 3, 2, 2, 1 on D
    for p_lay, d_lay in [("nhd", "nhd"), ("block-major", "block-major")]:
        p = Side(s, Parallel(1), p_lay, 64)
        d = Side(s, Parallel(1), d_lay, 64)
        plan = run_scenario(p, d, 128, 0, rng(), tables=(p_ids, d_ids))[0]
        per_layer = 1 if p_lay == "block-major" else 4
        assert plan.descriptors == 4 * per_layer  # joint streaks: 3, 2, 2, 1
