"""Plan one request between two instance configurations without any memory
(``kvbridge plan``, ``docs/plan-cli.md``): layouts get synthetic, non-overlapping region
addresses; block tables are consecutive or shuffled ids from one pool for every group,
so ids never collide across groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.layout import SideConfig, build_layout
from kvbridge.plan.geometry import Geometry, Side
from kvbridge.plan.pattern import Bound
from kvbridge.plan.plan import PlanSummary
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel

_P_BASE = 1 << 44
_D_BASE = 1 << 53
_RANK_SPAN = 1 << 40
_ALIGN = 4096


@dataclass(frozen=True, slots=True)
class RankPlan:
    """The plan summary of one D rank."""

    rank: int
    stage: int
    tp_rank: int
    summary: PlanSummary


def dry_run(
    info: ModelInfo,
    p: SideConfig,
    d: SideConfig,
    tokens: int,
    cached: int = 0,
    shuffle_seed: int | None = None,
    d_ranks: Sequence[int] | None = None,
) -> list[RankPlan]:
    """Plan a request of ``tokens`` prefilled tokens (``cached`` on D) for every D rank
    (or those in ``d_ranks``). Raises the library's typed errors on bad input."""
    for inst in (p, d):
        info.check_tp(inst.tp)
    p_par = Parallel(p.tp, p.pp, info.stages(p.pp))
    d_par = Parallel(d.tp, d.pp, info.stages(d.pp))
    p_spec = info.spec.with_block_sizes(p.block_size)
    d_spec = info.spec.with_block_sizes(d.block_size)
    pool = max(pool_size(p_spec, tokens), pool_size(d_spec, tokens))
    rng = np.random.default_rng(shuffle_seed)
    shuffle = shuffle_seed is not None
    p_tables = _tables(p_spec, tokens, pool, rng, shuffle)
    d_tables = _tables(d_spec, tokens, pool, rng, shuffle)
    p_bounds = [_bound(p_spec, p_par, r, p.layout, pool, _P_BASE) for r in range(p_par.world)]
    p_side, out = Side(p_spec, p_par, p_bounds), []
    for r in range(d_par.world) if d_ranks is None else d_ranks:
        d_side = Side(d_spec, d_par, {r: _bound(d_spec, d_par, r, d.layout, pool, _D_BASE)})
        plan = Geometry(p_side, d_side, r).plan(tokens, p_tables, d_tables, cached)
        stage, tp_rank = d_par.coords(r)
        out.append(RankPlan(r, stage, tp_rank, plan.summary()))
    return out


def pool_size(spec: ModelSpec, tokens: int) -> int:
    return sum(spec.blocks_needed(tokens))


def _tables(
    spec: ModelSpec, tokens: int, pool: int, rng: np.random.Generator, shuffle: bool
) -> list[np.ndarray]:
    ids = rng.permutation(pool) if shuffle else np.arange(pool)
    return [t.astype(np.int64) for t in np.split(ids, np.cumsum(spec.blocks_needed(tokens)))[:-1]]


def _bound(spec: ModelSpec, par: Parallel, rank: int, layout: str, pool: int, base: int) -> Bound:
    lay = build_layout(spec, par, rank, layout, pool)
    addrs, pos = [], base + rank * _RANK_SPAN
    for n in lay.regions:
        addrs.append(pos)
        pos += -(-n // _ALIGN) * _ALIGN + _ALIGN
    return Bound(lay, tuple(addrs))
