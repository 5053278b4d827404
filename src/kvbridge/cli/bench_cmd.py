"""``kvbridge bench plan|transfer|trace|vllm [--quick] [--calls N] [--json] [--plot FILE.png]``
(``vllm`` also ``--trace``): benchmarks that print figures. One progress line per finished
case goes to stderr; the table (or, with ``--json``, one JSON list) to stdout at the end;
``--plot`` (plan, transfer) also draws them into a PNG (``benchmarks.plot``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvbridge.cli import args as types
from kvbridge.errors import ConfigError


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


def checkout() -> Path:
    """The source checkout whose ``benchmarks/`` run (they are not installed with the
    package): the one this kvbridge is installed from in place (``pip install -e``), else
    the working directory's."""
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (root / "benchmarks" / "bench_cli.py").is_file():
            return root
    raise ConfigError(
        "kvbridge bench runs the benchmarks of a source checkout (benchmarks/ is not "
        "installed with the package): run it in a clone of the repository"
    )


def run(args: argparse.Namespace) -> int:
    """Refuse a flag the benchmark has no use for, then run the checkout's
    ``benchmarks.bench_cli`` in a process of its own, in the checkout, with that
    checkout's kvbridge (``src/``) first on its path: this process imports nothing from
    it. A child killed by a signal exits 128 + the signal's number."""
    if args.trace and args.what != "vllm":
        raise ConfigError(f"--trace: bench {args.what} has no trace mode; --trace works with vllm")
    if args.only is not None and args.what != "trace":
        raise ConfigError(f"--only: bench {args.what} has no case filter; --only works with trace")
    root = checkout()  # the flags first: their errors do not need a checkout
    argv = [args.what, *(["--json"] if args.json else []), *(["--quick"] if args.quick else [])]
    plot = str(Path(args.plot).resolve()) if args.plot is not None else None  # from here
    for flag, value in (("--calls", args.calls), ("--only", args.only), ("--plot", plot)):
        argv += [f"{flag}={value}"] if value is not None else []
    argv += ["--trace"] if args.trace else []
    env = dict(os.environ)
    if (root / "src" / "kvbridge").is_dir():
        paths = [str(root / "src"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    child = [sys.executable, "-m", "benchmarks.bench_cli", *argv]
    rc = subprocess.run(child, cwd=root, env=env).returncode
    return rc if rc >= 0 else 128 - rc
