"""What the per-request choice (:func:`kvbridge.connector.movers.choice.choose`) costs and what it
picks, for gpu-check's cases: each request planned once (shuffled block ids), then the
choice timed on its runs (µs, best median), under three measured pairs: host memory on
this VM, GPU memory between two processes without RDMA (READ over TCP), and RDMA across
nodes (public figures, docs/performance.md "Across nodes, on paper"). Target (issue 33):
≤ 20 µs per choice.

Usage: python -m benchmarks.bench_choice [--calls N]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from benchmarks.plan_bench import best_median_us
from kvbridge.connector.movers.choice import PairCosts, choose, price, slow
from kvbridge.connector.movers.staging import Link
from kvbridge.layout.side import SideConfig
from kvbridge.plan.dry_run import _bound, _tables, pool_size
from kvbridge.plan.geometry import Geometry, Side
from kvbridge.spec.load import load_model
from kvbridge.spec.parallel import Parallel

CASES = [  # name, model, tokens, P TP, D TP, P layout, D layout, P block, D block
    ("llama-8b 1k 1→1 nhd", "llama-3.1-8b", 1024, 1, 1, "nhd", "nhd", 16, 16),
    ("llama-8b 8k 1→1 nhd", "llama-3.1-8b", 8192, 1, 1, "nhd", "nhd", 16, 16),
    ("llama-8b 1k 1→2 nhd", "llama-3.1-8b", 1024, 1, 2, "nhd", "nhd", 16, 16),
    ("llama-8b 1k 2→1 hnd", "llama-3.1-8b", 1024, 2, 1, "hnd", "hnd", 16, 16),
    ("1k block-major 16→32", "llama-3.1-8b", 1024, 1, 1, "block-major", "block-major", 16, 32),
    ("jamba 1k 1→1 hnd", "jamba-1.5-mini", 1024, 1, 1, "hnd", "hnd", 16, 16),
]

PAIRS = {  # (READ, WRITE): round, descriptor, byte
    "host, this VM": (Link(45e-6, 0.7e-6, 0.14e-9), Link(190e-6, 1.35e-6, 0.27e-9)),
    "GPU, no RDMA": (Link(150e-6, 4.5e-6, 1.0e-9), Link(500e-6, 4.5e-6, 1e-12)),
    "RDMA": (Link(20e-6, 0.25e-6, 0.02e-9), Link(150e-6, 0.25e-6, 0.02e-9)),
}


@dataclass(frozen=True)
class Staging:
    """A D rank's stager as the choice sees it: 64 MiB slots, numpy's copies here."""

    slot_bytes: int = 64 << 20
    per_run: float = 60e-9
    per_byte: float = 0.08e-9


def plan_runs(model: str, tokens: int, tp: tuple[int, int], lays: tuple[str, str], blocks):  # type: ignore[no-untyped-def]
    info = load_model(model)
    p, d = (
        SideConfig(tp=t, block_size=b, layout=lay)
        for t, b, lay in zip(tp, blocks, lays, strict=True)
    )
    p_spec = info.spec.with_block_sizes(p.block_size)
    d_spec = info.spec.with_block_sizes(d.block_size)
    p_par, d_par = Parallel(p.tp), Parallel(d.tp)
    pool = max(pool_size(p_spec, tokens), pool_size(d_spec, tokens))
    rng = np.random.default_rng(0)
    p_t, d_t = _tables(p_spec, tokens, pool, rng, True), _tables(d_spec, tokens, pool, rng, True)
    p_b = [_bound(p_spec, p_par, r, p.layout, pool, 1 << 44) for r in range(p_par.world)]
    d_side = Side(d_spec, d_par, {0: _bound(d_spec, d_par, 0, d.layout, pool, 1 << 46)})
    return Geometry(Side(p_spec, p_par, p_b), d_side, 0).plan(tokens, p_t, d_t).runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    staging = Staging()
    print("each pair: pull ms / push ms as priced (ranks staged) → the choice (its time)")
    print(f"{'case':<22} {'runs':>6} | " + " | ".join(f"{p:<36}" for p in PAIRS))
    for name, model, tokens, p_tp, d_tp, p_lay, d_lay, p_blk, d_blk in CASES:
        runs = plan_runs(model, tokens, (p_tp, d_tp), (p_lay, d_lay), (p_blk, d_blk))
        cells = []
        for read, write in PAIRS.values():
            costs = PairCosts(read, write, never=slow(read, write, 8 << 20))
            us = best_median_us(lambda c=costs, r=runs: choose(c, r, staging), args.calls)
            mode, why = choose(costs, runs, staging)
            (pull_s, pull_n), (push_s, push_n) = (
                price(link, runs, push, staging) for link, push in ((read, False), (write, True))
            )
            never = " never READ" if "never READ" in why else ""
            cells.append(
                f"{pull_s * 1e3:.2f} ({pull_n}) / {push_s * 1e3:.2f} ({push_n}) → "
                f"{mode.value}{never} ({us:.1f} µs)"
            )
        n = sum(len(r) for r in runs.values())
        print(f"{name:<22} {n:>6} | " + " | ".join(f"{c:<36}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
