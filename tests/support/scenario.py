"""Run one P→D transfer scenario in process and compare D with the reference."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbridge.connector.movers.pull import read_runs
from kvbridge.layout.build import build_layout
from kvbridge.layout.view import RankLayout
from kvbridge.plan.geometry import Geometry
from kvbridge.plan.geometry import Side as PlanSide
from kvbridge.plan.pattern import Bound
from kvbridge.plan.plan import Plan
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.transport.base import Region
from kvbridge.transport.loopback import Fabric, LoopbackTransport
from tests.support.reference import expected_dest, fill_source


@dataclass
class Side:
    spec: ModelSpec
    par: Parallel
    layout: str
    num_blocks: int | Mapping[str, int]
    """Blocks (state: slots) for all groups, or per group name (then one pool per group)."""
    kv_packed: bool = True
    layouts: list[RankLayout] = field(default_factory=list)
    """Built from ``layout`` by name, unless given (one per rank)."""
    bufs: list[list[np.ndarray]] = field(default_factory=list)

    def allocate(self, rng: np.random.Generator) -> None:
        if not self.layouts:
            self.layouts = [
                build_layout(self.spec, self.par, r, self.layout, self.num_blocks, self.kv_packed)
                for r in range(self.par.world)
            ]
        for lay in self.layouts:
            self.bufs.append([rng.integers(0, 256, n, dtype=np.uint8) for n in lay.regions])

    def bound(self, r: int) -> Bound:
        return Bound(self.layouts[r], tuple(int(b.ctypes.data) for b in self.bufs[r]))


def random_tables(
    spec: ModelSpec,
    n: int,
    num_blocks: int | Mapping[str, int],
    rng: np.random.Generator,
    shuffle: bool = True,
) -> list[list[int]]:
    """Distinct block ids per pool: all groups drawn from one pool of ``num_blocks``, or,
    given per group name, each group from its own."""
    need = spec.blocks_needed(n)
    if not isinstance(num_blocks, int):
        pools = [num_blocks[grp.name] for grp in spec.groups]
        return [_draw(p, k, rng, shuffle) for p, k in zip(pools, need, strict=True)]
    ids = rng.permutation(num_blocks) if shuffle else np.arange(num_blocks)
    out, pos = [], 0
    for k in need:
        out.append([int(x) for x in ids[pos : pos + k]])
        pos += k
    return out


def _draw(pool: int, k: int, rng: np.random.Generator, shuffle: bool) -> list[int]:
    ids = rng.permutation(pool)[:k] if shuffle else np.arange(k)
    return [int(x) for x in ids]


def run_scenario(
    p: Side,
    d: Side,
    n: int,
    cached: int,
    rng: np.random.Generator,
    shuffle: bool = True,
    tables: tuple[list[list[int]], list[list[int]]] | None = None,
    pad_blocks: bool = False,
) -> dict[int, Plan]:
    """Fill P, plan and execute for every D rank, assert D bytes equal the reference.

    ``pad_blocks``: P's last blocks are filled to their end; in each token group a slot
    of the blocks around the first and last needed token (see ``reference.needed``) may
    hold P's bytes or keep its own, every other byte is checked as without padding."""
    p.allocate(rng)
    d.allocate(rng)
    if tables is None:
        p_tabs = random_tables(p.spec, n, p.num_blocks, rng, shuffle)
        d_tabs = random_tables(d.spec, n, d.num_blocks, rng, shuffle)
    else:
        p_tabs, d_tabs = tables
    p_ends = [-(-n // g.block_size) * g.block_size for g in p.spec.groups] if pad_blocks else None
    pads = [(a.block_size, b.block_size) for a, b in zip(p.spec.groups, d.spec.groups, strict=True)]
    fabric = Fabric()
    p_agents = []
    for r in range(p.par.world):
        fill_source(p.spec, p.par, r, p.layouts[r], p.bufs[r], n, p_tabs, p_ends)
        agent = LoopbackTransport(f"p{r}", fabric)
        agent.register([Region(int(b.ctypes.data), b.nbytes) for b in p.bufs[r]])
        p_agents.append(agent)
    p_bound = [p.bound(r) for r in range(p.par.world)]
    plans = {}
    for r in range(d.par.world):
        before = [b.copy() for b in d.bufs[r]]
        agent = LoopbackTransport(f"d{r}", fabric)
        agent.register([Region(int(b.ctypes.data), b.nbytes) for b in d.bufs[r]])
        d_side = PlanSide(d.spec, d.par, {r: d.bound(r)})
        geom = Geometry(PlanSide(p.spec, p.par, p_bound), d_side, r, pad_blocks)
        plan = geom.plan(n, p_tabs, d_tabs, cached)
        for src, runs in plan.runs.items():  # what the kernel mover's copies rely on
            k = geom.divisor(src)
            for col in (runs.src, runs.dst, runs.length):
                assert not (col % k).any(), f"divisor {k}"
        peers = {src: agent.add_peer(p_agents[src].register([])) for src in plan.runs}
        read_runs(agent, peers, plan.runs, time.monotonic() + 60.0, [])
        _check_dest(d, r, before, n, cached, d_tabs, pads if pad_blocks else None)
        plans[r] = plan
    return plans


def _check_dest(
    d: Side,
    r: int,
    before: list[np.ndarray],
    n: int,
    cached: int,
    d_tabs: list[list[int]],
    pads: list[tuple[int, int]] | None,
) -> None:
    """D rank ``r``'s bytes equal the reference; with ``pads``, a padding slot may keep
    its bytes (the planner pads a bucket only where that saves runs) or hold P's."""
    want = expected_dest(d.spec, d.par, r, d.layouts[r], before, n, cached, d_tabs)
    alt = want
    if pads is not None:
        alt = expected_dest(d.spec, d.par, r, d.layouts[r], before, n, cached, d_tabs, pads)
    for i, (got, exp, pad) in enumerate(zip(d.bufs[r], want, alt, strict=True)):
        if not np.array_equal(got, exp) and not ((got == exp) | (got == pad)).all():
            bad = np.flatnonzero((got != exp) & (got != pad))
            raise AssertionError(
                f"D rank {r} region {i}: {bad.shape[0]} bytes differ, first at {bad[0]}"
            )
