"""``kvbridge bench plan|transfer|trace|vllm [--quick] [--calls N] [--json] [--plot FILE.png]``
(``vllm`` also ``--trace``): benchmarks that print figures. One progress line per finished
case goes to stderr; the table (or, with ``--json``, one JSON list) to stdout at the end;
``--plot`` (plan, transfer) also draws them into a PNG (``benchmarks.plot``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvbridge.cli import args as types

QUICK_CALLS = 50
"""``bench plan --quick``: timed calls per batch, unless ``--calls`` says otherwise."""


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its figures")
    p.add_argument("what", choices=["plan", "transfer", "trace", "vllm"])
    p.add_argument("--json", action="store_true", help="one JSON list, one object per case")
    p.add_argument(
        "--calls",
        type=types.positive,
        help="timed calls per batch (plan; default 300, with --quick 50); timed requests "
        "per connector and case (vllm; default 8, with --quick 4); requests per case "
        "(trace; default 12, with --quick 4)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller, faster run: plan leaves out the 32k-token cases and times 50 calls; "
        "transfer runs 1024 tokens only; trace runs three cases of four requests; vllm runs the "
        "three llama block-size cases (with --trace: llama 128->128 and granite)",
    )
    p.add_argument(
        "--only",
        metavar="CASE",
        help="trace only: the case labelled CASE (e.g. 'llama-3.1-8b TP 1→2 nhd'), else "
        "those whose label contains it",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="vllm only: engines with small block pools, churned by a seeded warm-up so "
        "block ids are fragmented on P and D as in a busy engine; adds block-run figures "
        "(benchmarks.vllm_trace)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the figures into FILE.png (plan, transfer): transfer's GB/s and "
        "descriptors against run size, plan's time against its floor; needs matplotlib "
        "(pip install 'kvbridge[plot]')",
    )
    p.set_defaults(run=run)


def _checkout() -> None:
    """Make the checkout's ``benchmarks/`` importable: benchmarks live beside the package in
    the source tree and are not installed with it."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "benchmarks" / "__init__.py").is_file():
        from kvbridge.errors import ConfigError

        raise ConfigError(
            "kvbridge bench runs the benchmarks of a source checkout (benchmarks/ is not "
            "installed with the package): clone the repository and `pip install -e .` there"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def run(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(f"bench {args.what} {line}", file=sys.stderr, flush=True)

    if args.trace and args.what != "vllm":
        from kvbridge.errors import ConfigError

        raise ConfigError(f"--trace: bench {args.what} has no trace mode; --trace works with vllm")
    if args.only is not None and args.what != "trace":
        from kvbridge.errors import ConfigError

        raise ConfigError(f"--only: bench {args.what} has no case filter; --only works with trace")
    _checkout()  # the flags first: their errors do not need a checkout
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
            from kvbridge.errors import ConfigError

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
        from kvbridge.errors import ConfigError

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
