"""Per-request planning time (``kvbridge bench plan``).

Geometry is built once per pair (as at handshake); each timed call plans one request
for one D rank from block tables. Addresses are synthetic: planning touches no memory.
``plan_us`` is the lowest of 5 batch medians (each batch ``calls`` warm calls, 300 by
default; ``--quick`` 50).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks.shapes import llama
from kvbridge.layout import build_layout
from kvbridge.plan import Bound, Geometry, Side
from kvbridge.spec import ModelSpec, Parallel


@dataclass(frozen=True)
class PlanCase:
    model: str
    tokens: int
    p_tp: int
    d_tp: int
    layout: str
    block_ids: str
    plan_us: float
    descriptors: int
    bytes: int
    bytes_per_descriptor: float
    geometry_ms: float
    floor_us: float
    """Same run: bare numpy arithmetic for one address per (layer, block) on both sides
    plus lengths, i.e. what any per-request descriptor builder must at least do."""


def bound_all(spec: ModelSpec, par: Parallel, layout: str, blocks: int, base: int) -> list[Bound]:
    """Layouts of every rank with synthetic, non-overlapping region addresses."""
    out = []
    for r in range(par.world):
        lay = build_layout(spec, par, r, layout, blocks)
        addrs, pos = [], base + (r << 40)
        for n in lay.regions:
            addrs.append(pos)
            pos += n + 4096
        out.append(Bound(lay, tuple(addrs)))
    return out


def run_case(
    spec: ModelSpec,
    p_tp: int,
    d_tp: int,
    layout: str,
    tokens: int,
    shuffled: bool,
    blocks: int = 4000,
    calls: int = 300,
) -> PlanCase:
    p_par, d_par = Parallel(p_tp), Parallel(d_tp)
    p_b = bound_all(spec, p_par, layout, blocks, 1 << 44)
    d_b = bound_all(spec, d_par, layout, blocks, 1 << 45)
    t0 = time.perf_counter()
    geom = Geometry(Side(spec, p_par, p_b), Side(spec, d_par, d_b), 0)
    geo_ms = (time.perf_counter() - t0) * 1e3
    need = -(-tokens // spec.groups[0].block_size)
    rng = np.random.default_rng(0)
    if shuffled:
        p_ids = [rng.permutation(blocks)[:need]]
        d_ids = [rng.permutation(blocks)[:need]]
    else:
        p_ids, d_ids = [np.arange(7, 7 + need)], [np.arange(100, 100 + need)]
    plan = geom.plan(tokens, p_ids, d_ids)
    us = best_median_us(lambda: geom.plan(tokens, p_ids, d_ids), calls)
    floor = _floor_us(len(spec.layers), p_ids[0], d_ids[0], calls)
    return PlanCase(
        spec.name,
        tokens,
        p_tp,
        d_tp,
        layout,
        "shuffled" if shuffled else "consecutive",
        round(us, 2),
        plan.descriptors,
        plan.nbytes,
        round(plan.nbytes / max(plan.descriptors, 1), 1),
        round(geo_ms, 2),
        round(floor, 2),
    )


def _floor_us(layers: int, p_ids: np.ndarray, d_ids: np.ndarray, calls: int) -> float:
    offs = (np.arange(layers, dtype=np.int64) << 32)[:, None]
    length = np.full(layers, 65536, np.int64)

    def floor() -> None:
        (offs + p_ids * 65536).ravel()
        (offs + d_ids * 65536).ravel()
        np.repeat(length, p_ids.shape[0])

    return best_median_us(floor, calls)


def best_median_us(fn: Callable[[], object], calls: int, batches: int = 5) -> float:
    """Lowest of ``batches`` medians of ``calls`` warm calls each (µs): a burst of load
    from elsewhere on a shared machine spoils a batch, not the figure."""
    medians = []
    for _ in range(batches):
        times = []
        for _ in range(calls + 20):
            t = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t)
        medians.append(float(np.median(times[20:])) / 1e3)
    return min(medians)


def cases(
    calls: int = 300, quick: bool = False, progress: Callable[[str], None] | None = None
) -> list[PlanCase]:
    """Every case, ``calls`` timed calls per batch (the 32k-token cases at most 200);
    ``quick`` leaves those out. ``progress`` gets one line per finished case."""
    l8, l70 = llama(32), llama(80)
    todo = [
        (l8, 1, d_tp, layout, 1024, shuffled, calls)
        for shuffled in (False, True)
        for d_tp, layout in ((1, "nhd"), (1, "hnd"), (2, "hnd"), (2, "nhd"))
    ]
    if not quick:  # last: its large arrays slow later small allocations
        todo += [(l70, 2, 4, "hnd", 32768, shuffled, min(calls, 200)) for shuffled in (False, True)]
    out = []
    for i, (spec, p_tp, d_tp, layout, tokens, shuffled, n) in enumerate(todo, 1):
        row = run_case(spec, p_tp, d_tp, layout, tokens, shuffled, calls=n)
        out.append(row)
        if progress is not None:
            progress(
                f"[{i}/{len(todo)}] {row.model} {tokens} tokens TP {p_tp}→{d_tp} {layout} "
                f"{row.block_ids}: {row.plan_us:.0f} µs, {row.descriptors} descriptors"
            )
    return out


def as_dicts(rows: list[PlanCase]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]
