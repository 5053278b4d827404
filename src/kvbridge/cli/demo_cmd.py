"""``kvbridge demo``: P prefills, kvbridge moves the KV over NIXL, D decodes, and every
output is checked token for token against a colocated run (one instance, TP 1).

    kvbridge demo [--preset kimi-linear] [--prefill "tp=2,pp=1,block=16,layout=hnd"]
        [--decode "tp=1,pp=1,block=32,layout=block-major"] [--mode pull|push]
        [--prompts FILE] [--new-tokens 20] [--cached N] [--quick] [--json]

P and D are reference-engine instances, one process per rank (each rank's cache and NIXL
agent in its own process), with a router in this process. Progress goes to stderr; the
table (or, with ``--json``, one object) to stdout. Exit status: 0 every output matches,
1 a mismatch, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvbridge.cli.demo_report import Row, Summary, render_json, render_text
from kvbridge.cli.plan_cmd import parse_instance
from kvbridge.cli.plan_report import human
from kvbridge.connector.consumer import Mode
from kvbridge.engine import PRESETS, ModelConfig, encode, generate, preset
from kvbridge.engine.pd import DecodeServer, PrefillServer, Router, Side
from kvbridge.errors import ConfigError

DEFAULT_PRESET = "kimi-linear"
DEFAULT_PREFILL = "tp=2,block=16,layout=hnd"
DEFAULT_DECODE = "tp=1,block=32,layout=block-major"
PROMPTS = (
    "Hello, world!",
    "Disaggregated prefill hands the KV cache over to the decode side.",
    "The quick brown fox jumps over the lazy dog.",
    "P computes the prompt; D continues the story, token for token.",
    "Block sizes, layouts and head splits are only data to the planner.",
)
REPEAT_CACHED = 16
"""The built-in set ends with its last prompt again, the first 16 tokens cached on D."""
QUICK = 2
"""``--quick``: prompts 1 and 2, then the cached repeat."""

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DemoRequest:
    req_id: str
    prompt: list[int]
    cached: int
    """Prompt tokens D computes itself (a prefix-cache hit); the rest comes from P."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="P and D instances of the reference engine over NIXL, checked token for token",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--prefill", default=DEFAULT_PREFILL, help=f'P: "{DEFAULT_PREFILL}"')
    p.add_argument("--decode", default=DEFAULT_DECODE, help=f'D: "{DEFAULT_DECODE}"')
    p.add_argument("--mode", default="pull", choices=[m.value for m in Mode])
    p.add_argument("--prompts", type=Path, help="a text file, one prompt per line")
    p.add_argument("--new-tokens", type=int, default=20, help="tokens generated per prompt")
    p.add_argument("--cached", type=int, default=0, help="prompt tokens already cached on D")
    p.add_argument("--quick", action="store_true", help=f"{QUICK} prompts and a cached repeat")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = preset(args.preset)
    p_side, d_side = _side(args.prefill, "--prefill"), _side(args.decode, "--decode")
    if args.new_tokens < 1:
        raise ConfigError(f"--new-tokens: {args.new_tokens} < 1")
    requests = _requests(args)
    longest = max(len(r.prompt) for r in requests) + args.new_tokens
    p_side, d_side = _room(p_side, longest), _room(d_side, longest)
    say: Say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say(f"kvbridge demo: {cfg.name}; P [{p_side}] → D [{d_side}], {args.mode}, NIXL")
    t0 = time.perf_counter()
    rows = serve(cfg, p_side, d_side, Mode(args.mode), requests, args.new_tokens, say)
    summary = Summary(
        cfg.name,
        str(p_side),
        str(d_side),
        args.mode,
        args.new_tokens,
        rows,
        time.perf_counter() - t0,
    )
    print(json.dumps(render_json(summary), indent=1) if args.json else render_text(summary))
    return 0 if summary.all_match else 1


def serve(
    cfg: ModelConfig,
    p_side: Side,
    d_side: Side,
    mode: Mode,
    requests: Sequence[DemoRequest],
    n_new: int,
    say: Say,
) -> list[Row]:
    """Start P and D, run every request through the router, stop them."""
    secret = secrets.token_bytes(16)
    t0 = time.perf_counter()
    with closing(PrefillServer(cfg, p_side, secret)) as p:
        say(f"P ready: {_procs(p_side.world)} ({time.perf_counter() - t0:.1f} s)")
        t0 = time.perf_counter()
        with closing(DecodeServer(cfg, d_side, secret, mode)) as d:
            say(f"D ready: {_procs(d_side.world)} ({time.perf_counter() - t0:.1f} s)")
            router = Router(p, d)
            return [
                _one(router, cfg, r, n_new, f"[{i}/{len(requests)}]", say)
                for i, r in enumerate(requests, 1)
            ]


def _one(router: Router, cfg: ModelConfig, r: DemoRequest, n_new: int, tag: str, say: Say) -> Row:
    out = router.generate(r.req_id, r.prompt, n_new, r.cached)
    matches = out.tokens == generate(cfg, r.prompt, tp=1, n_new_tokens=n_new)
    row = Row(
        r.req_id,
        len(r.prompt),
        r.cached,
        out.bytes,
        out.descriptors,
        out.seconds * 1e3,
        matches,
        out.recomputed,
    )
    verdict = "equals the colocated run" if matches else "DIFFERS from the colocated run"
    how = f"recomputed on D ({out.error})" if out.recomputed else f"{out.descriptors} descriptors"
    say(
        f"{tag} {r.req_id}: {row.prompt_tokens} prompt tokens ({r.cached} cached on D), "
        f"{human(out.bytes)} in {how}, {row.transfer_ms:.1f} ms; output {verdict}"
    )
    return row


def _procs(n: int) -> str:
    return f"{n} rank process" + ("es" if n > 1 else "")


def _side(text: str, flag: str) -> Side:
    inst = parse_instance(text, flag)
    return Side(inst.tp, inst.block, inst.layout, pp=inst.pp)


def _room(side: Side, tokens: int) -> Side:
    """``side`` with enough blocks for one request of ``tokens`` tokens (and spare)."""
    need = -(-tokens // side.block_size) + 8
    return side if side.num_blocks >= need else replace(side, num_blocks=need)


def _requests(args: argparse.Namespace) -> list[DemoRequest]:
    texts = _read_prompts(args.prompts) if args.prompts else list(PROMPTS)
    if args.quick:
        texts = texts[:QUICK]
    prompts = [encode(t) for t in texts]
    if args.cached < 0 or any(args.cached >= len(p) for p in prompts):
        shortest = min(len(p) for p in prompts)
        raise ConfigError(f"--cached {args.cached} must be in [0, {shortest}) (shortest prompt)")
    out = [DemoRequest(f"r{i}", p, args.cached) for i, p in enumerate(prompts, 1)]
    if not (args.prompts or args.cached) and len(prompts[-1]) > REPEAT_CACHED:
        out.append(DemoRequest(f"r{len(out) + 1}", prompts[-1], REPEAT_CACHED))
    return out


def _read_prompts(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {path}: {e}") from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ConfigError(f"--prompts {path}: no non-blank line")
    return texts
