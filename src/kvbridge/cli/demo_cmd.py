"""``kvbridge demo``: P prefills, kvbridge moves the KV over NIXL, D decodes, and every
output is checked token for token against a colocated run (one instance, TP 1).

    kvbridge demo [--preset kimi-linear] [--prefill "tp=2,pp=1,block=16,layout=hnd"]
        [--decode "tp=1,pp=1,block=32,layout=block-major"] [--mode pull|push|auto]
        [--prompts FILE] [--new-tokens 20] [--cached N] [--quick] [--json]

P and D are reference-engine instances, one process per rank (each rank's cache and NIXL
agent in its own process), with a router in this process. A key left out of
``--prefill``/``--decode`` keeps that side's default shown above (``--decode tp=2`` is
TP 2, block 32, block-major); the first progress line shows both sides as used. A
request holds at most 1024 tokens (prompt and new tokens): longer input is refused
before any process starts. Progress goes to stderr; the table (or, with ``--json``, one
object) to stdout. Exit status: 0 every output matches, 1 a mismatch, 2 bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvbridge.cli import args as types

DEFAULT_PRESET = "kimi-linear"
PRESET_NAMES = ("deepseek", "gemma", "jamba", "kimi-linear", "llama", "qwen3-next")
"""The reference engine's presets (a test checks them against ``refengine.PRESETS``,
which is not imported here: it loads torch)."""
MODES = ("pull", "push", "auto")
DEFAULT_PREFILL = "tp=2,block=16,layout=hnd"
DEFAULT_DECODE = "tp=1,block=32,layout=block-major"
QUICK = 2
"""``--quick``: prompts 1 and 2, then the cached repeat."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="P and D instances of the reference engine over NIXL, checked token for token",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    side = types.side
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=PRESET_NAMES)
    p.add_argument("--prefill", type=side, default=side(""), help=f'P: "{DEFAULT_PREFILL}"')
    p.add_argument("--decode", type=side, default=side(""), help=f'D: "{DEFAULT_DECODE}"')
    p.add_argument("--mode", default="pull", choices=MODES)
    p.add_argument("--prompts", type=Path, help="a text file, one prompt per line")
    p.add_argument(
        "--new-tokens", type=types.positive, default=20, help="tokens generated per prompt"
    )
    p.add_argument(
        "--cached", type=types.non_negative, default=0, help="prompt tokens already cached on D"
    )
    p.add_argument("--quick", action="store_true", help=f"{QUICK} prompts and a cached repeat")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument(
        "--two-hosts",
        action="store_true",
        help="P and D on two simulated hosts: network namespaces on a veth link (root, ip)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from refengine.demo import run as demo

    return demo(args)
