"""Who serves what (``topology.sources``) against a unit-by-unit reference: every unit a
D rank needs is read from exactly one P rank that holds it, the one the spreading rule
names, for every catalog model and TP/PP pair (3→2 and 1→4 among them)."""

from __future__ import annotations

import itertools

import pytest

from kvbridge import catalog
from kvbridge.errors import KVBridgeError
from kvbridge.spec.load import load_model
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel, shard_interval
from kvbridge.topology.sources import sources

PAIRS = [((1, 1), (2, 1)), ((2, 1), (1, 1)), ((3, 1), (2, 1)), ((1, 1), (4, 1)), ((2, 2), (4, 1))]


def reference(
    spec: ModelSpec, p_par: Parallel, d_par: Parallel, d_rank: int
) -> dict[tuple[int, str, int, int], int]:
    """(layer, stream, segment, unit) → P global rank, one unit at a time."""
    d_stage, d_tp = d_par.coords(d_rank)
    out: dict[tuple[int, str, int, int], int] = {}
    for li in range(*d_par.stage_ranges(len(spec.layers))[d_stage]):
        stage = p_par.stage_of_layer(li, len(spec.layers))
        for s in spec.layers[li].streams:
            for k, seg in enumerate(s.segments):
                a, b = shard_interval(seg.units, d_par.tp, d_tp, s.replicated)
                held = [
                    shard_interval(seg.units, p_par.tp, r, s.replicated) for r in range(p_par.tp)
                ]
                for u in range(a, b):
                    holders = [r for r, (lo, hi) in enumerate(held) if lo <= u < hi]
                    out[(li, s.name, k, u)] = stage * p_par.tp + holders[(li + d_tp) % len(holders)]
    return out


@pytest.mark.parametrize("name", catalog.names())
def test_every_unit_from_the_rank_the_rule_names(name: str) -> None:
    info = load_model(name)
    spec, tried = info.spec, 0
    for (p_tp, p_pp), (d_tp, d_pp) in PAIRS:
        try:
            info.check_tp(p_tp)
            info.check_tp(d_tp)
            p_par = Parallel(p_tp, p_pp, info.stages(p_pp))
            d_par = Parallel(d_tp, d_pp, info.stages(d_pp))
        except KVBridgeError:
            continue
        tried += 1
        for d_rank in range(d_par.world):
            got: dict[tuple[int, str, int, int], int] = {}
            pieces = sources(spec, p_par, d_par, d_rank)
            for pc in pieces:
                assert pc.start < pc.stop
                for u in range(pc.start, pc.stop):
                    key = (pc.layer, pc.stream, pc.segment, u)
                    assert key not in got  # no unit twice
                    got[key] = pc.src_rank
            assert got == reference(spec, p_par, d_par, d_rank)
            # pieces are maximal: two in a row never continue each other from one rank
            for x, y in itertools.pairwise(pieces):
                same = (x.layer, x.stream, x.segment, x.src_rank) == (
                    y.layer, y.stream, y.segment, y.src_rank
                )  # fmt: skip
                assert not (same and x.stop == y.start)
    assert tried >= 2
