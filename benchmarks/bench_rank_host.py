"""Why a rank plans 5-10x slower than a benchmark loop: the same planning work, timed
per request, in this process and in a rank process (spawned, one request per message
over a pipe, as gpu-check's ranks and an engine's workers get them), each either back to
back or paced (the process idle ``--gap-ms`` between requests, as a rank between loads);
paced, the rank either blocks on its pipe or polls it as vLLM's workers wait for their
next step (vLLM 0.32 ``shm_broadcast.SpinCondition``: 1 s of polling after each step).

Work per request: the kernel mover's host path (plan in the geometry over the spans'
offsets, bounds checks, cuts to equal lengths: ``bench_kernel_host``), Llama-3.1-8B shapes,
a new shuffled request each time. The figures are medians (µs) of one run; compare the
columns with each other, not with another machine.

Usage: python -m benchmarks.bench_rank_host [--requests N] [--gap-ms MS] [--quick]
(``--quick``: the first case, 5 requests: what ``make test`` runs)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

SHAPES = [(1024, 1, 1, "nhd"), (8192, 1, 1, "nhd"), (1024, 1, 2, "nhd")]
CASES = [(*c, grids) for grids in (True, False) for c in SHAPES]
"""Each shape as the kernel mover takes it (the plan's grids) and with every run's offsets
made and checked (as before grids)."""
Case = tuple[int, int, int, str, bool]


def host_path(
    tokens: int, p_tp: int, d_tp: int, layout: str, grids: bool = True
) -> Callable[[int], float]:
    """``run(seed)``: one request's host work → seconds it took."""
    from benchmarks.bench_kernel_host import spans_of
    from benchmarks.plan_bench import bound_all
    from benchmarks.shapes import llama
    from kvbridge.connector.movers.kernel import copy_groups
    from kvbridge.plan import Bound, Geometry, Side
    from kvbridge.plan.runs import Runs
    from kvbridge.spec import Parallel

    spec = llama(32)
    p_b = bound_all(spec, Parallel(p_tp), layout, 4000, 1 << 44)
    d_b = bound_all(spec, Parallel(d_tp), layout, 4000, 1 << 45)
    p_spans, d_span = spans_of(p_b), spans_of(d_b[:1])[0]
    p_off = [Bound(b.layout, s.bases) for b, s in zip(p_b, p_spans, strict=True)]
    d_side = Side(spec, Parallel(d_tp), [Bound(d_b[0].layout, d_span.bases)])
    geom = Geometry(Side(spec, Parallel(p_tp), p_off), d_side, 0)
    need = -(-tokens // spec.groups[0].block_size)

    def run(seed: int) -> float:
        rng = np.random.default_rng(seed)
        p_ids, d_ids = [rng.permutation(4000)[:need]], [rng.permutation(4000)[:need]]
        t0 = time.perf_counter()
        plan = geom.plan(tokens, p_ids, d_ids)
        for src, r in plan.runs.items():
            copy_groups(p_spans[src], d_span, r if grids else Runs(r.src, r.dst, r.length), "P")
        return time.perf_counter() - t0

    return run


def timed(run: Callable[[int], float], requests: int, gap_s: float) -> float:
    """Median µs of ``requests`` requests, ``gap_s`` idle before each (after 3 warm-ups)."""
    for seed in range(3):
        run(seed)
    out = []
    for seed in range(requests):
        if gap_s:
            time.sleep(gap_s)
        out.append(run(100 + seed))
    return statistics.median(out) * 1e6


def rank_main(conn: Connection, case: Case, spin: bool) -> None:
    """A rank: builds the case once, then times one request per message. ``spin``: it
    waits for a message as vLLM's workers wait for a step (polling, yielding the CPU
    between polls, never blocking: the gaps here are under their 1 s busy loop), else
    blocks on the pipe."""
    run = host_path(*case)
    for seed in range(3):
        run(seed)
    conn.send("ready")
    while True:
        while spin and not conn.poll(0):
            os.sched_yield()
        if (seed := conn.recv()) is None:
            return
        conn.send(run(seed))


def in_rank(case: Case, requests: int, gap_s: float, spin: bool = False) -> float:
    """Median µs of the requests as a spawned rank process timed them itself."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=rank_main, args=(there, case, spin), daemon=True)
    proc.start()
    try:
        if here.recv() != "ready":
            raise RuntimeError("the rank process did not start")
        out = []
        for seed in range(requests):
            if gap_s:
                time.sleep(gap_s)
            here.send(100 + seed)
            out.append(here.recv())
        here.send(None)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return statistics.median(out) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=50.0)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cases = CASES[:1] if args.quick else CASES
    if args.quick:
        args.requests = 5
    gap = args.gap_ms / 1e3
    print(
        f"host time per request (µs, median of {args.requests}); paced: idle "
        f"{args.gap_ms:g} ms before each request"
    )
    print(
        f"{'case':38s} {'alone, back to back':>20s} {'alone, paced':>13s} "
        f"{'rank, back to back':>19s} {'rank, paced':>12s} {'rank, paced, polls':>19s}"
    )
    for case in cases:
        run = host_path(*case)
        cols = [
            timed(run, args.requests, 0.0),
            timed(run, args.requests, gap),
            in_rank(case, args.requests, 0.0),
            in_rank(case, args.requests, gap),
            in_rank(case, args.requests, gap, spin=True),
        ]
        tokens, p_tp, d_tp, layout, grids = case
        label = f"{tokens} tokens TP {p_tp}→{d_tp} {layout}{'' if grids else ', expanded'}"
        print(
            f"{label:38s} {cols[0]:20.1f} {cols[1]:13.1f} {cols[2]:19.1f} {cols[3]:12.1f} "
            f"{cols[4]:19.1f}"
        )


if __name__ == "__main__":
    main()
