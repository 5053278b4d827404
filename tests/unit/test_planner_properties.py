"""Property tests: random specs, TP/PP pairs, block sizes, layouts, token counts."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbridge.spec import DType, Kind, ModelSpec, Parallel, attention, group_by_kind, mamba2, mla
from tests.support.scenario import Side, run_scenario

LAYOUTS = ["nhd", "hnd", "block-major"]


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    heads = draw(st.sampled_from([1, 2, 4, 6, 12]))
    n = draw(st.integers(1, 4))
    layers = []
    for i in range(n):
        kind = draw(st.sampled_from(["full", "sliding", "chunked", "mla", "mamba"]))
        if kind == "mla":
            layers.append(mla(i, draw(st.sampled_from([8, 20])), DType.FP16))
        elif kind == "mamba":
            layers.append(mamba2(i, heads, 4, draw(st.sampled_from([1, 2])), 4, 3))
        else:
            k = Kind(kind)
            w = draw(st.integers(2, 40))
            layers.append(attention(i, heads, draw(st.sampled_from([4, 8])), DType.BF16, k, w, w))
    return group_by_kind("random", layers)


def tp_ok(spec: ModelSpec, tp: int) -> bool:
    try:
        spec.check_tp(tp)
    except Exception:
        return False
    return True


PAIRS = {
    "spec": specs(),
    "p_bs": st.sampled_from([1, 4, 8, 16, 12]),
    "d_bs": st.sampled_from([4, 8, 16, 6]),
    "p_lay": st.sampled_from(LAYOUTS),
    "d_lay": st.sampled_from(LAYOUTS),
    "n": st.integers(1, 70),
    "cached_frac": st.floats(0, 1),
    "shuffle": st.booleans(),
    "seed": st.integers(0, 2**16),
}
"""Strategies shared by the property tests: model, block sizes, layouts, request."""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_tp=st.sampled_from([1, 2, 3, 4]),
    d_tp=st.sampled_from([1, 2, 3, 4]),
    p_pp=st.integers(1, 2),
    d_pp=st.integers(1, 2),
    **PAIRS,
)
def test_random_plans_match_the_reference(
    spec, p_tp, d_tp, p_pp, d_pp, p_bs, d_bs, p_lay, d_lay, n, cached_frac, shuffle, seed
):
    assume(tp_ok(spec, p_tp) and tp_ok(spec, d_tp))
    p_pp, d_pp = min(p_pp, len(spec.layers)), min(d_pp, len(spec.layers))
    p = Side(spec.with_block_sizes(p_bs), Parallel(p_tp, p_pp), p_lay, 300)
    d = Side(spec.with_block_sizes(d_bs), Parallel(d_tp, d_pp), d_lay, 300)
    cached = int(cached_frac * n)
    plans = run_scenario(p, d, n, cached, np.random.default_rng(seed), shuffle)
    for plan in plans.values():
        for runs in plan.runs.values():
            assert (runs.length > 0).all()
        assert plan.summary().bytes == sum(r.nbytes for r in plan.runs.values())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p_tp=st.sampled_from([1, 2, 3]), d_tp=st.sampled_from([1, 2, 4]), **PAIRS)
def test_padded_blocks_match_the_reference_and_never_add_descriptors(
    spec, p_tp, d_tp, p_bs, d_bs, p_lay, d_lay, n, cached_frac, shuffle, seed
):
    """``pad_blocks``: the needed tokens exact, a padding slot either untouched or holding
    P's bytes for it (P's padding slots are filled, so where they land is checked),
    nothing else touched; and no plan posts more descriptors than the exact one."""
    assume(tp_ok(spec, p_tp) and tp_ok(spec, d_tp))
    p = Side(spec.with_block_sizes(p_bs), Parallel(p_tp), p_lay, 300)
    d = Side(spec.with_block_sizes(d_bs), Parallel(d_tp), d_lay, 300)
    cached = int(cached_frac * n)
    exact = run_scenario(p, d, n, cached, np.random.default_rng(seed), shuffle)
    padded = run_scenario(p, d, n, cached, np.random.default_rng(seed), shuffle, pad_blocks=True)
    for r, plan in padded.items():
        assert plan.descriptors <= exact[r].descriptors
        assert plan.nbytes >= exact[r].nbytes
