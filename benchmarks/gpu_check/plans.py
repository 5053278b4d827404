"""What the driver knows of a case before any memory exists: the bytes each D rank
receives per request (the contiguous baselines move as many; the staging buffers hold
them) and whether vLLM would read the pairing at all. Planned over stand-in addresses:
a plan's byte count and run structure do not depend on where the regions are."""

from __future__ import annotations

from benchmarks.gpu_check.cases import Case, Request
from benchmarks.gpu_check.vllm_like import Refused, pair_runs
from kvbridge.layout.view import RankLayout
from kvbridge.plan import Bound, Geometry, Side

STAND_IN = 1 << 40
"""Stand-in region addresses start here, each rank 2^36 bytes after the previous one."""


def _bound(layout: RankLayout, slot: int) -> Bound:
    bases, pos = [], STAND_IN + (slot << 36)
    for n in layout.regions:
        bases.append(pos)
        pos += -(-n // 4096) * 4096 + 4096
    return Bound(layout, tuple(bases))


def _bounds(case: Case) -> tuple[list[Bound], list[Bound]]:
    p, d = case.layouts()
    return [_bound(lay, i) for i, lay in enumerate(p)], [
        _bound(lay, len(p) + i) for i, lay in enumerate(d)
    ]


def rank_bytes(case: Case, reqs: list[Request]) -> list[tuple[int, ...]]:
    """Per request, the bytes each D rank receives."""
    p_b, d_b = _bounds(case)
    (sp, sd), (pp, pd) = case.specs(), case.pars()
    geoms = [Geometry(Side(sp, pp, p_b), Side(sd, pd, d_b), d) for d in range(pd.world)]
    return [tuple(g.plan(r.tokens, r.p_tables, r.d_tables).nbytes for g in geoms) for r in reqs]


def vllm_refusal(case: Case) -> str:
    """Why vLLM would not read this pairing ("" if it would)."""
    p_b, d_b = _bounds(case)
    try:
        for d in range(case.d_tp):
            pair_runs(case.specs(), case.pars(), p_b, d_b[d], d)
    except Refused as e:
        return str(e)
    return ""
