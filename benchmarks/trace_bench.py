"""Transfers on a realistic allocator trace (``python -m benchmarks.trace_bench
[--quick] [--json]``): block ids from a seeded trace of ~32 live requests per side
(:mod:`benchmarks.trace_alloc`), pools sized like an engine's within a memory
budget, every transfer end to end (plan + post + land) and byte-checked, each followed by
a contiguous READ of the same bytes, beside a vLLM-like read path.

Per case a P process (every P rank's memory, one NIXL agent) and a D process (rank 0 of
D's TP) start; see :mod:`benchmarks.trace_worker` for the measurement,
:mod:`benchmarks.trace_report` for the row fields. A line per finished case goes to
stderr. Memory: P's pool, D's pool (``--pool-mib`` each at most) and two scratch
buffers of the longest request (1/8 of a pool): about 2.9 GiB with the default.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from benchmarks import trace_report
from benchmarks.trace_case import Case, model_spec, sizing
from benchmarks.trace_worker import CaseResult, d_main, p_main
from kvbridge.jsonio import dumps

MODELS = ("llama-3.1-8b", "jamba-1.5-mini")
TP_PAIRS = ((1, 1), (1, 2), (2, 1))
LAYOUT_PAIRS = (("nhd", "nhd"), ("hnd", "hnd"), ("block-major", "block-major"), ("nhd", "hnd"))
EXTRA = (Case("deepseek-v2-lite", 3, 2, "nhd", "nhd"),)
"""3→2 where the heads allow it: only MLA (the latent is replicated) in the catalog."""
QUICK = (
    ("llama-3.1-8b", 1, 2, "nhd", "nhd"),
    ("llama-3.1-8b", 1, 1, "hnd", "hnd"),
    ("jamba-1.5-mini", 1, 2, "nhd", "hnd"),
)


def cases(quick: bool = False, pool_mib: int | None = None) -> list[Case]:
    """The full grid, or the three ``quick`` cases (fewer requests, same pools)."""
    pool = (pool_mib or 1280) << 20
    if quick:
        return [Case(*c, requests=4, pool_bytes=pool, budget_s=6.0) for c in QUICK]
    grid = [
        Case(m, p, d, pl, dl, pool_bytes=pool)
        for m in MODELS
        for p, d in TP_PAIRS
        for pl, dl in LAYOUT_PAIRS
    ]
    return grid + [replace(c, pool_bytes=pool) for c in EXTRA]


def run_case(case: Case, timeout_s: float = 600.0) -> CaseResult:
    """Run one case in a fresh P and D process pair; a failure comes back as the
    result's ``error``."""
    spec = model_spec(case.model)
    size = sizing(spec, case)  # a case that cannot be sized fails here, not in a child
    ctx = mp.get_context("spawn")
    p_end, d_end = ctx.Pipe()
    out, child_out = ctx.Pipe(duplex=False)
    p = ctx.Process(target=p_main, args=(p_end, case), daemon=True)
    d = ctx.Process(target=d_main, args=(d_end, child_out, case), daemon=True)
    p.start()
    d.start()
    for end in (p_end, d_end, child_out):  # the children hold them: EOF when one dies
        end.close()
    failed = CaseResult(case, size.num_blocks, size.trace.median_tokens, size.trace.max_tokens, 0)
    try:
        deadline = time.monotonic() + timeout_s
        while not out.poll(1.0):
            if not d.is_alive() or time.monotonic() > deadline:
                raise EOFError if not d.is_alive() else TimeoutError
        res: CaseResult = out.recv()
        return res
    except (EOFError, TimeoutError) as e:
        why = "timed out" if isinstance(e, TimeoutError) else f"ended (exit code {d.exitcode})"
        failed.error = f"D process {why} without a result"
        return failed
    finally:
        for proc in (d, p):
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def run_all(
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    todo: Sequence[Case] | None = None,
) -> list[dict[str, Any]]:
    """Rows of every case (two per case: ``direct`` and ``staged``)."""
    todo = list(todo if todo is not None else cases(quick))
    out: list[dict[str, Any]] = []
    for i, case in enumerate(todo, 1):
        res = run_case(case)
        rows = trace_report.rows(res)
        out += rows
        if progress is not None:
            progress(f"bench trace [{i}/{len(todo)}] {case.label()}: {_summary(res, rows)}")
    return out


def _summary(res: CaseResult, rows: list[dict[str, Any]]) -> str:
    if res.error:
        return f"FAILED ({res.error})"
    d, s = rows
    v = d.get("vllm_ms_median")
    vs = f", vLLM-like {v} ms" if v is not None else ""
    return (
        f"{d['requests']} requests, direct {d['e2e_ms_median']} ms ({d['descriptors_median']:.0f}"
        f" descriptors), staged {s['e2e_ms_median']} ms{vs}, {d['verified_transfers']} "
        f"transfers verified in {res.seconds:.0f} s"
    )


def select(todo: list[Case], only: str | None, requests: int | None) -> list[Case]:
    """The case labelled ``only``, else those whose label contains it (all: None);
    ``requests`` measured per case, with a budget of a second each at least. ValueError
    if no case matches."""
    if only:
        only = only.replace("TP ", "")  # the table's names leave "TP" out

        def name(c: Case) -> str:
            return c.label().replace("TP ", "")

        exact = [c for c in todo if name(c) == only]
        todo = exact or [c for c in todo if only in name(c)]
        if not todo:
            raise ValueError(f"no case label contains {only!r}")
    if requests:
        todo = [replace(c, requests=requests, budget_s=max(c.budget_s, requests)) for c in todo]
    return todo


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvbridge bench trace",
        description="Transfers on a realistic allocator trace (docs/performance.md).",
    )
    ap.add_argument(
        "--quick", action="store_true", help="three cases, four requests each (< 2 min)"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per case and strategy")
    ap.add_argument("--pool-mib", type=int, default=None, help="cache memory per instance")
    ap.add_argument(
        "--only",
        metavar="TEXT",
        help="the case labelled TEXT, else those whose label contains it "
        "(e.g. 'llama-3.1-8b TP 1→2 nhd', '1→1 block-major', 'jamba')",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests measured per case (default 12, with --quick 4)",
    )
    args = ap.parse_args(argv)
    try:
        todo = select(cases(args.quick, args.pool_mib), args.only, args.requests)
    except ValueError as e:
        ap.error(str(e))
    t0 = time.perf_counter()
    rows = run_all(args.quick, lambda line: print(line, file=sys.stderr, flush=True), todo)
    if args.json:
        print(dumps(rows))
    else:
        print(trace_report.table(rows))
        print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
