"""The work of ``kvbridge bench`` (its flags: ``kvbridge.cli.bench_cmd``, which runs
this module in a process of its own, in the checkout: ``python -m benchmarks.bench_cli
WHAT [flags]``): run the benchmark, print its table or JSON, draw its figure."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvbridge.errors import ConfigError

QUICK_CALLS = 50
"""``bench plan --quick``: timed calls per batch, unless ``--calls`` says otherwise."""


def run(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(f"bench {args.what} {line}", file=sys.stderr, flush=True)

    if args.plot is not None:
        _check_plot(args.what, args.plot)
    if args.what == "trace":
        return _trace(args)
    if args.what == "plan":
        from benchmarks.plan_bench import as_dicts, cases

        calls = args.calls or (QUICK_CALLS if args.quick else 300)
        rows = as_dicts(cases(calls, quick=args.quick, progress=say))
    elif args.what == "vllm" and args.trace:
        from benchmarks.vllm_trace import run_trace

        rows = run_trace(quick=args.quick, calls=args.calls, progress=say)
    elif args.what == "vllm":
        from benchmarks.vllm_bench import run_all as run_vllm

        rows = run_vllm(quick=args.quick, calls=args.calls, progress=say)
    else:
        if args.calls is not None:
            raise ConfigError("--calls: bench transfer times 5 repeats per case; no --calls")
        from benchmarks.transfer_bench import run_all

        rows = run_all(quick=args.quick, progress=say)
    if args.json:
        from kvbridge.jsonio import dumps

        print(dumps(rows))
    else:
        print_table(rows)
    if args.plot is not None:
        from benchmarks.plot import draw

        draw(args.what, rows, args.plot)
        say(f"figure written to {args.plot}")
    return 0


def _check_plot(what: str, path: str) -> None:
    """Refuse a ``--plot`` before the bench runs rather than after."""
    if what in ("vllm", "trace"):
        raise ConfigError(f"--plot: bench {what} draws no figure; --plot works with plan, transfer")
    from benchmarks.plot import check_target

    check_target(path)


def _trace(args: argparse.Namespace) -> int:
    """``bench trace``: transfers on an allocator trace (``benchmarks/trace_bench.py``)."""
    from benchmarks.trace_bench import main as trace_main

    argv = [*(["--quick"] if args.quick else []), *(["--json"] if args.json else [])]
    argv += ["--only", args.only] if args.only else []
    argv += ["--requests", str(args.calls)] if args.calls else []
    return trace_main(argv)


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[k]).rjust(w) for k, w in zip(keys, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    """``kvbridge bench``'s flags (``argv``: what follows ``bench``), parsed by the same
    parser; typed errors as the CLI prints them."""
    from kvbridge.cli.main import build_parser
    from kvbridge.errors import KVBridgeError

    try:
        args = build_parser().parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        return run(args)
    except KVBridgeError as e:
        print(f"kvbridge: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
