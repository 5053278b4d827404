"""``python -m benchmarks.gpu_check``: the check's command line (see ``README.md``).

Exit status: 0 every case ran and every byte verified; 1 a mismatch, a failed method or
a failed case; 2 bad usage (or no GPU without ``--cpu``); 3 cases left out for the budget.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.cases import GPU_CASES, QUICK_CASES, Case
from benchmarks.gpu_check.driver import CaseResult, CaseRun, Options
from refengine.processes import RankError

RESERVE_S = 15.0
"""Kept from the budget for the last case's teardown and the report."""
MIN_CASE_S = 20.0
"""A case starts only with this much of the budget left."""
GRACE_S = 45.0
"""Past the budget by this much, the watchdog kills the rank processes."""
NO_IPC = ("expandable_segments:True", "backend:cudaMallocAsync")
"""Allocator settings whose memory has no CUDA IPC handle (dropped for the ranks)."""
BOOT_S = 180.0
"""Longest wait for rank processes to start (torch, CUDA, NIXL)."""


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="CPU half: torch CPU tensors, NIXL on host memory, P's pools in /dev/shm",
    )
    ap.add_argument("--quick", action="store_true", help="the small case list (the CPU half)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="wall-clock budget, seconds")
    ap.add_argument("--json", metavar="PATH", help="write every sample and row as JSON here")
    ap.add_argument("--only", metavar="TEXT", help="cases whose label contains TEXT")
    ap.add_argument("--requests", type=int, help="requests per case (default: the case's)")
    ap.add_argument("--reps", type=int, help="timed transfers per request and method")
    ap.add_argument("--threads", default="0,4,8", help="UCX thread counts of the vLLM-like path")
    ap.add_argument("--no-sgl", action="store_true", help="leave NIXL_UCX_SGL_ENABLE unset")
    ap.add_argument(
        "--no-prepare", action="store_true", help="kvbridge's first load meets an unprepared pair"
    )
    ap.add_argument(
        "--fresh",
        choices=("auto", "yes", "no"),
        default="auto",
        help="new rank processes per case (auto: on the GPU yes, on the CPU no)",
    )
    return ap.parse_args(argv)


def select(args: argparse.Namespace) -> list[Case]:
    todo = list(QUICK_CASES if args.quick else GPU_CASES)
    if args.only:
        todo = [c for c in todo if args.only in c.label()]
    change: dict[str, Any] = {}
    if args.requests:
        change["requests"] = args.requests
    if args.reps is not None:
        change["reps"] = args.reps
    return [replace(c, **change) for c in todo]


def prepare_env(args: argparse.Namespace) -> None:
    """Environment of the rank processes (spawned: they inherit it)."""
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if not args.no_sgl:
        os.environ["NIXL_UCX_SGL_ENABLE"] = "1"
    if args.cpu:
        os.environ["KVBRIDGE_DEVICE_ON_CPU"] = "1"
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    kept = [o for o in conf.split(",") if o and not o.startswith(NO_IPC)]
    if conf and kept != conf.split(","):  # memory without a CUDA IPC handle: no kernel mover
        print(f"gpu-check: PYTORCH_CUDA_ALLOC_CONF={conf!r} -> {','.join(kept)!r}", file=sys.stderr)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(kept)


class Watchdog:
    """Kills the rank processes once the budget plus :data:`GRACE_S` has passed: a
    command stuck in a rank then fails in the driver, which reports what it has."""

    def __init__(self, limit: float) -> None:
        self.ranks: Any = None
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(limit,), daemon=True)
        self._thread.start()

    def _run(self, limit: float) -> None:
        while not self._stop.wait(0.5):
            if time.monotonic() > limit and self.ranks is not None:
                self.fired = True
                for proc in list(self.ranks.procs.procs):
                    proc.kill()
                return

    def stop(self) -> None:
        self._stop.set()


def run_all(
    cases: list[Case], opts: Options, args: argparse.Namespace, deadline: float, dog: Watchdog
) -> list[CaseResult]:
    """Each case in turn, in rank processes started for it or kept from the one before
    (never after a failed case); a case that cannot start is reported, not raised."""
    from benchmarks.gpu_check.procs import Ranks

    fresh = args.fresh == "yes" or (args.fresh == "auto" and opts.gpu)
    most = (max(c.p_tp for c in cases), max(c.d_tp for c in cases))
    ranks: Ranks | None = None
    out = []
    try:
        for i, case in enumerate(cases):
            left = deadline - time.monotonic()
            if left < MIN_CASE_S:
                out.append(CaseResult(case, skipped="left out: the time budget ran out"))
                continue
            if ranks is None or fresh or not ranks.fits(case.p_tp, case.d_tp):
                if ranks is not None:
                    ranks.close()
                p, d = (case.p_tp, case.d_tp) if fresh else most
                try:
                    ranks = dog.ranks = Ranks(p, d, opts.gpu, min(BOOT_S, left))
                except RankError as e:
                    ranks = dog.ranks = None
                    out.append(CaseResult(case, error=f"rank processes did not start: {e}"))
                    continue
            ordering = not any("request" in r.ordering for r in out)  # once, on a kernel case
            res = CaseRun(ranks, case, opts, deadline, f"c{i}", ordering).run()
            out.append(res)
            print(progress(res), file=sys.stderr, flush=True)
            if res.error:  # a rank may have died or hung: new processes for the next case
                ranks.close()
                ranks = dog.ranks = None
    finally:
        if ranks is not None:
            ranks.close()
    return out


def progress(res: CaseResult) -> str:
    state = res.error or res.skipped or f"{len(res.samples)} transfers"
    return f"gpu-check: {res.case.label()} in {res.seconds:.1f} s: {state}"


def meta(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    import importlib

    import torch

    from kvbridge import envs
    from kvbridge.transport.nixl import NIXL_BUILD

    gpu = not args.cpu
    where = {
        n: str(Path(importlib.import_module(n).__file__ or "").parent)
        for n in ("zmq", "msgspec", NIXL_BUILD)
    }
    return {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "mode": "gpu" if gpu else "cpu (KVBRIDGE_DEVICE_ON_CPU=1, host memory)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nixl": NIXL_BUILD,
        "python": sys.version.split()[0],
        "budget_s": budget,
        "sgl": os.environ.get("NIXL_UCX_SGL_ENABLE", ""),
        "threads": args.threads,
        "kvbridge_ucx_threads": envs.ucx_threads(),
        "imported_from": where,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    t0 = time.monotonic()
    prepare_env(args)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; --cpu runs the CPU half", file=sys.stderr)
        return 2
    cases = select(args)
    if not cases:
        print(f"gpu-check: no case label contains {args.only!r}", file=sys.stderr)
        return 2
    prefix = f"/dev/shm/kvb-gpucheck-{os.getpid()}"
    threads = tuple(int(x) for x in args.threads.split(",") if x.strip())
    opts = Options(
        gpu=not args.cpu, threads=threads, shm_prefix=prefix, prepare=not args.no_prepare
    )
    dog = Watchdog(t0 + args.budget_s + GRACE_S)
    try:
        results = run_all(cases, opts, args, t0 + args.budget_s - RESERVE_S, dog)
    finally:
        dog.stop()
        for left in glob.glob(prefix + "-*"):  # left by a rank that was killed
            os.unlink(left)
    info = meta(args, args.budget_s)
    info["seconds"] = time.monotonic() - t0
    print(report_text(results, info))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        from benchmarks.gpu_check.report import to_json

        path.write_text(json.dumps(to_json(results, info), indent=1, default=str))
    return status(results)


def report_text(results: list[CaseResult], info: dict[str, Any]) -> str:
    from benchmarks.gpu_check.report import table

    return table(results, info) + f"\n{len(results)} cases in {info['seconds']:.0f} s"


def status(results: list[CaseResult]) -> int:
    bad = any(s.bad for r in results for s in r.samples)
    if bad or any(r.error or r.errors for r in results):
        return 1
    return 3 if any(r.skipped for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
