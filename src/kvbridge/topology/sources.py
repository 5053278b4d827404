"""Who serves what: for one D rank, the P rank serving each unit interval.

Computed once per (P instance, D rank) pair. Units a D rank needs are intersected with
every P rank's holdings; a unit held by several P ranks (replicated heads, MLA latents)
is read from exactly one, chosen by ``(layer + d_tp_rank) % holders`` to spread load.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvbridge.errors import TopologyError
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel, shard_interval


@dataclass(frozen=True, slots=True)
class Piece:
    """Units ``[start, stop)`` of one segment of (layer, stream), read from ``src_rank``."""

    layer: int
    stream: str
    segment: int
    src_rank: int
    start: int
    stop: int


def sources(spec: ModelSpec, p_par: Parallel, d_par: Parallel, d_rank: int) -> list[Piece]:
    """Every piece D rank ``d_rank`` needs, with the P global rank that serves it."""
    spec.check_tp(p_par.tp)
    spec.check_tp(d_par.tp)
    d_stage, d_tp = d_par.coords(d_rank)
    n_layers = len(spec.layers)
    pieces: list[Piece] = []
    for li in range(*d_par.stage_ranges(n_layers)[d_stage]):
        p_stage = p_par.stage_of_layer(li, n_layers)
        for s in spec.layers[li].streams:
            for seg_i, seg in enumerate(s.segments):
                a, b = shard_interval(seg.units, d_par.tp, d_tp, s.replicated)
                held = [
                    shard_interval(seg.units, p_par.tp, r, s.replicated) for r in range(p_par.tp)
                ]
                # [a, b) cut where the set of P ranks holding a unit changes
                cuts = sorted({a, b} | {x for lo, hi in held for x in (lo, hi) if a < x < b})
                own: list[Piece] = []  # pieces merge within this segment only
                for start, stop in itertools.pairwise(cuts):
                    holders = [r for r, (lo, hi) in enumerate(held) if lo <= start < hi]
                    if not holders:
                        raise TopologyError(f"layer {li} {s.name}: no P rank holds unit {start}")
                    src = p_stage * p_par.tp + holders[(li + d_tp) % len(holders)]
                    if own and own[-1].src_rank == src and own[-1].stop == start:
                        start = own.pop().start
                    own.append(Piece(li, s.name, seg_i, src, start, stop))
                pieces += own
    return pieces
