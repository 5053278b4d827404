"""Change-walk "a new layer kind" (docs/structure.md), performed here: a state kind made
up in this file from the public spec pieces only, planned P→D across TP sizes and
layouts and checked byte-exact against the element-wise reference; and, on the reference
engine's side, a mixer of that kind registered from this file and found by the engine's
spec and model."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.api import DType, Kind, Layer, ModelSpec, Parallel, Segment, Stream, attention
from kvbridge.api import group_by_kind as group
from refengine.config import ModelConfig
from refengine.mixers import MixerKind, mixer_names, register_mixer
from refengine.model import Model
from refengine.ops import Shard
from refengine.spec import model_spec
from tests.support.reference import held_units
from tests.support.scenario import Side, run_scenario

DT = DType.FP32


def walk_state(index: int, heads: int, head_dim: int, groups: int, width: int) -> Layer:
    """A made-up state kind: ``mix_state [3, a | b]`` (a: heads × head_dim, b: groups ×
    width, each segment sharded over TP on its own) and ``scale_state [1, width]``
    (replicated: every rank keeps all of it)."""
    isz = DT.itemsize
    mix = Stream("mix_state", (Segment(heads, head_dim * isz), Segment(groups, width * isz)), DT, 3)
    scale = Stream("scale_state", (Segment(1, width * isz),), DT, rows=1, replicated=True)
    return Layer(index, Kind.STATE, (mix, scale))


HEADS, HEAD_DIM, GROUPS, WIDTH = 4, 8, 2, 6


def state_read(d_tp: int) -> int:
    """Bytes of one sequence's walk state the D ranks read together (both walk layers),
    counted unit by unit with the reference's sharding rule: a segment of fewer units
    than ranks is held (and read) by several, the replicated stream by every rank."""
    per_rank = 0
    for r in range(d_tp):
        a = len(held_units(HEADS, d_tp, r, False)) * HEAD_DIM
        b = len(held_units(GROUPS, d_tp, r, False)) * WIDTH
        per_rank += 3 * (a + b) + len(held_units(1, d_tp, r, True)) * WIDTH
    return 2 * per_rank * DT.itemsize


def hybrid(block: int) -> ModelSpec:
    layers = [
        attention(0, 4, 16, DT),
        walk_state(1, HEADS, HEAD_DIM, GROUPS, WIDTH),
        attention(2, 4, 16, DT),
        walk_state(3, HEADS, HEAD_DIM, GROUPS, WIDTH),
    ]
    return group("walk-hybrid", layers, block)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_lay", "d_lay"),
    [
        (1, 1, "nhd", "hnd"),
        (1, 2, "hnd", "nhd"),
        (2, 1, "block-major", "hnd"),
        (2, 4, "nhd", "block-major"),
        (4, 2, "shared-pool", "shared-pool"),
    ],
)
def test_a_new_state_kind_moves_byte_exact_across_tp_and_layouts(
    p_tp: int, d_tp: int, p_lay: str, d_lay: str
) -> None:
    p = Side(hybrid(16), Parallel(p_tp), p_lay, 40)
    d = Side(hybrid(8), Parallel(d_tp), d_lay, 60)
    plans = run_scenario(p, d, 70, 0, np.random.default_rng(5))  # asserts every byte
    state = sum(pl.summary().bytes_by_kind.get("state", 0) for pl in plans.values())
    assert state == state_read(d_tp)
    whole = 3 * (HEADS * HEAD_DIM + GROUPS * WIDTH) + WIDTH
    assert d.spec.state_bytes == 2 * whole * DT.itemsize


def test_a_new_state_kind_moves_into_a_prefix_cached_d() -> None:
    p = Side(hybrid(16), Parallel(2), "hnd", 40)
    d = Side(hybrid(16), Parallel(2), "nhd", 40)
    plans = run_scenario(p, d, 70, 32, np.random.default_rng(6))
    state = sum(pl.summary().bytes_by_kind.get("state", 0) for pl in plans.values())
    assert state == state_read(2)  # state moves whole whatever D cached


class _Passthrough:
    """The torch side of the walk kind, as small as the engine accepts: its output is
    zero (the residual stream carries on)."""

    def __init__(self, cfg: ModelConfig, layer: int, group: int, shard: Shard):
        self.layer, self.group, self.shard = layer, group, shard

    def forward(self, x, step, cache):  # type: ignore[no-untyped-def]
        return x * 0


def _cache(i: int, c: ModelConfig) -> Layer:
    return walk_state(i, HEADS, HEAD_DIM, GROUPS, WIDTH)


if "walk" not in mixer_names():
    register_mixer(MixerKind("walk", _cache, _Passthrough))


def test_the_reference_engine_finds_a_mixer_registered_here() -> None:
    cfg = ModelConfig("walk-engine", ("full", "walk", "full", "walk"))
    spec = model_spec(cfg, 16)
    walk = [layer for layer in spec.layers if layer.kind is Kind.STATE]
    assert [layer.index for layer in walk] == [1, 3]
    assert [s.name for s in walk[0].streams] == ["mix_state", "scale_state"]
    model = Model(cfg, spec, Shard(1, 0), lambda x: x, range(4))
    assert [type(m) for m in model.mixers][1::2] == [_Passthrough, _Passthrough]
    assert model.mixers[1].group == spec.group_of(1)  # type: ignore[attr-defined]
    # the engine's spec plans like the one built by hand
    p = Side(spec, Parallel(1), "nhd", 30)
    d = Side(spec, Parallel(2), "hnd", 30)
    plans = run_scenario(p, d, 40, 0, np.random.default_rng(7))
    state = sum(pl.summary().bytes_by_kind.get("state", 0) for pl in plans.values())
    assert state == state_read(2)
