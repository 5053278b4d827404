"""``kvbridge bench plan|transfer [--json]``: benchmarks that print figures."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its figures")
    p.add_argument("what", choices=["plan", "transfer"])
    p.add_argument("--json", action="store_true", help="one JSON list, one object per case")
    p.add_argument("--calls", type=int, default=300, help="timed calls per case (plan)")
    p.add_argument("--quick", action="store_true", help="smaller, faster run (transfer)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.what == "plan":
        from kvbridge.bench.plan_bench import as_dicts, cases

        rows = as_dicts(cases(max(args.calls, 200)))
    else:
        from kvbridge.bench.transfer_bench import run_all

        rows = run_all(quick=args.quick)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[k]).rjust(w) for k, w in zip(keys, widths, strict=True)))
