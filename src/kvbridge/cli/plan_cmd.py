"""``kvbridge plan``: what one request moves between a P and a D configuration.

    kvbridge plan --model PATH --prefill "tp=2,pp=1,block=16,layout=hnd" \\
        --decode "tp=4,block=32,layout=nhd" --tokens 5000 [--cached-tokens K] \\
        [--shuffle-blocks SEED] [--kv-dtype fp8] [--max-memory 4GiB] [--json]

``PATH``: a directory with ``config.json``, a ``config.json``, a kvbridge spec file, or
the name of a built-in catalog model (``llama-3.1-8b``). A key left out of one side's
spec takes the other side's value (block and layout), else the default (tp=1, pp=1,
block=16, layout=nhd); the output's ``P``/``D`` lines show what was used.
Output (``docs/plan-cli.md``): per D rank its sources, bytes, descriptors and mean run
size; totals by layer kind; warnings worth acting on. Before planning, the memory the
plan needs is estimated; over ``--max-memory`` the command stops with exit status 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvbridge.cli import args as types

DEFAULT_MAX_MEMORY = 4 << 30


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="show the transfer plan of one request between two configurations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="config.json, its directory, a spec file, or a catalog model name",
    )
    side = types.side
    p.add_argument(
        "--prefill", type=side, default=side(""), help='P: "tp=2,pp=1,block=16,layout=hnd"'
    )
    p.add_argument(
        "--decode", type=side, default=side(""), help='D: "tp=4,pp=1,block=32,layout=nhd"'
    )
    p.add_argument("--tokens", type=types.positive, required=True, help="tokens P prefilled")
    p.add_argument(
        "--cached-tokens", type=types.non_negative, default=0, help="prefix already on D"
    )
    p.add_argument("--shuffle-blocks", type=types.seed, metavar="SEED", help="shuffled block ids")
    p.add_argument("--kv-dtype", help="K/V (and MLA latent) dtype, e.g. fp8 (default: model)")
    p.add_argument("--ssm-dtype", help="recurrent/SSM state dtype (default: config or model)")
    p.add_argument(
        "--max-memory",
        type=types.size,
        default=DEFAULT_MAX_MEMORY,
        metavar="SIZE",
        help="refuse plans estimated to need more memory than this (default 4GiB)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object (docs/plan-cli.md)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.cli.plan_run import run as plan

    return plan(args)
