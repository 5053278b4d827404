"""Host time per request of the kernel mover: plan (in the geometry over the spans'
offsets, as :meth:`KernelMover.geometry` makes it) + the mover's checks (every run inside
its span) + runs cut to equal lengths, without the copy itself. For comparison, the
address-based way (plan over P's and D's addresses, then each run's region looked up).

Llama-3.1-8B shapes (bf16, block 16, 4,000 blocks), shuffled block ids, synthetic
addresses (nothing is touched: the spans' tensors are stand-ins). Target (issue 23):
plan + choose ≤ 100 µs per request at 8k tokens. The last column is the host scan each
copy call made of its runs before the kernel mover told the copy its facts from the
geometry (``checked_copy``): time no request pays any more.

Usage: python -m benchmarks.bench_kernel_host [--calls N]
"""

from __future__ import annotations

import argparse
from unittest import mock

import numpy as np
import torch

from benchmarks.plan_bench import best_median_us, bound_all
from benchmarks.shapes import llama
from kvbridge.connector.movers import device_copies, memory
from kvbridge.connector.movers.kernel import copy_groups
from kvbridge.connector.movers.memory import Span, equal_runs
from kvbridge.layout.tensor import Region
from kvbridge.plan import Geometry, Side
from kvbridge.plan.pattern import Bound
from kvbridge.plan.runs import Runs
from kvbridge.spec import Parallel


def spans_of(bounds: list) -> list[Span]:
    """One span per rank over its synthetic regions (no tensor over them is made)."""

    def stand_in(r: Region) -> torch.Tensor:  # the right size, no memory
        return torch.empty(r.nbytes, dtype=torch.uint8, device="meta")

    with mock.patch.object(memory, "byte_tensor", stand_in):
        return [
            Span([Region(a, n) for a, n in zip(b.bases, b.layout.regions, strict=True)])
            for b in bounds
        ]


def case(tokens: int, p_tp: int, d_tp: int, layout: str, calls: int) -> str:
    spec = llama(32)
    p_b = bound_all(spec, Parallel(p_tp), layout, 4000, 1 << 44)
    d_b = bound_all(spec, Parallel(d_tp), layout, 4000, 1 << 45)
    geom = Geometry(Side(spec, Parallel(p_tp), p_b), Side(spec, Parallel(d_tp), d_b), 0)
    p_spans, d_span = spans_of(p_b), spans_of(d_b[:1])[0]
    need = -(-tokens // spec.groups[0].block_size)
    rng = np.random.default_rng(0)
    p_ids, d_ids = [rng.permutation(4000)[:need]], [rng.permutation(4000)[:need]]

    def by_address() -> int:
        plan = geom.plan(tokens, p_ids, d_ids)
        calls_ = 0
        for src, r in plan.runs.items():
            s_off = p_spans[src].offsets(r.src, r.length, "P")
            d_off = d_span.offsets(r.dst, r.length, "D")
            calls_ += len(equal_runs(d_off, s_off, r.length))
        return calls_

    p_off = [Bound(b.layout, s.bases) for b, s in zip(p_b, p_spans, strict=True)]
    d_off = Bound(d_b[0].layout, d_span.bases)
    d_side = Side(spec, Parallel(d_tp), [d_off])
    in_offsets = Geometry(Side(spec, Parallel(p_tp), p_off), d_side, 0)

    def request() -> int:
        plan = in_offsets.plan(tokens, p_ids, d_ids)
        calls_ = 0
        for src, r in plan.runs.items():
            calls_ += len(copy_groups(p_spans[src], d_span, r, "P"))
        return calls_

    def expanded() -> int:  # every run's offsets made and checked (before grids)
        calls_ = 0
        for src, r in in_offsets.plan(tokens, p_ids, d_ids).runs.items():
            calls_ += len(copy_groups(p_spans[src], d_span, Runs(r.src, r.dst, r.length), "P"))
        return calls_

    def rescan() -> None:  # what rows_copy scanned per call before checked_copy
        for src, r in in_offsets.plan(tokens, p_ids, d_ids).runs.items():
            flat = Runs(r.src, r.dst, r.length)
            for d, s, size in copy_groups(p_spans[src], d_span, flat, "P"):  # type: ignore[misc]
                device_copies._inspect_host(d_span.tensor, d, p_spans[src].tensor, s, size)

    runs = sum(len(r) for r in geom.plan(tokens, p_ids, d_ids).runs.values())
    plan_us = best_median_us(lambda: in_offsets.plan(tokens, p_ids, d_ids), calls)
    total_us = best_median_us(request, calls)
    flat_us = best_median_us(expanded, calls)
    old_us = best_median_us(by_address, calls)
    rescan_us = best_median_us(rescan, calls) - flat_us
    return (
        f"{tokens:>6} tokens TP {p_tp}→{d_tp} {layout:4s}: {runs:>6} runs, "
        f"{request()} copy calls | plan {plan_us:7.1f} µs | plan + checks + cuts "
        f"{total_us:7.1f} µs | every run expanded (before grids) {flat_us:7.1f} µs | "
        f"by address (before) {old_us:7.1f} µs | rows_copy's re-scan (gone) {rescan_us:7.1f} µs"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    for tokens, p_tp, d_tp, layout in [
        (1024, 1, 1, "hnd"),
        (8192, 1, 1, "hnd"),
        (8192, 1, 1, "nhd"),
        (8192, 1, 2, "hnd"),
        (1024, 1, 2, "nhd"),
    ]:
        print(case(tokens, p_tp, d_tp, layout, args.calls), flush=True)


if __name__ == "__main__":
    main()
