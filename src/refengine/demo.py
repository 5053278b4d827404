"""The work of ``kvbridge demo`` (its flags: :mod:`kvbridge.cli.demo_cmd`): requests
checked against the demo's limits, P and D started, every request routed and compared
with a colocated run."""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path

from kvbridge.api import ConfigError, Mode, Parallel, SideConfig, SpecError
from kvbridge.cli.args import SideSpec, side
from kvbridge.cli.demo_cmd import DEFAULT_DECODE, DEFAULT_PREFILL, QUICK
from kvbridge.cli.plan_run import human
from kvbridge.jsonio import dumps
from refengine import ModelConfig, encode, generate, model_spec, preset
from refengine.demo_report import Row, Summary, render_json, render_text
from refengine.model import Model
from refengine.ops import Shard
from refengine.pd import DecodeServer, PrefillServer, Router

PROMPTS = (
    "Hello, world!",
    "Disaggregated prefill hands the KV cache over to the decode side.",
    "The quick brown fox jumps over the lazy dog.",
    "P computes the prompt; D continues the story, token for token.",
    "Block sizes, layouts and head splits are only data to the planner.",
)
REPEAT_CACHED = 16
"""The built-in set ends with its last prompt again, the first 16 tokens cached on D."""
REFERENCE_BLOCKS, REFERENCE_BLOCK = 64, 16
"""The colocated run that checks D's output: :func:`refengine.generate`'s pool."""
MAX_TOKENS = REFERENCE_BLOCKS * REFERENCE_BLOCK
"""Prompt plus new tokens of one request: what the colocated run's pool holds."""

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DemoRequest:
    req_id: str
    prompt: list[int]
    cached: int
    """Prompt tokens D computes itself (a prefix-cache hit); the rest comes from P."""


def run(args: argparse.Namespace) -> int:
    cfg = preset(args.preset)
    p_side = _side(args.prefill, DEFAULT_PREFILL)
    d_side = _side(args.decode, DEFAULT_DECODE)
    check_side(cfg, "--prefill", args.prefill, p_side)
    check_side(cfg, "--decode", args.decode, d_side)
    requests = _requests(args)
    longest = max(len(r.prompt) for r in requests) + args.new_tokens
    p_side, d_side = _room(p_side, longest), _room(d_side, longest)
    say: Say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say(f"kvbridge demo: {cfg.name}; P [{p_side}] → D [{d_side}], {args.mode}, NIXL")
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        host = "127.0.0.1"
        if getattr(args, "two_hosts", False):
            from refengine.netns import Hosts, unavailable

            if why := unavailable():
                say(f"--two-hosts: {why}")
                return 2
            hosts = stack.enter_context(Hosts())
            p_side, d_side = replace(p_side, netns=hosts.p), replace(d_side, netns=hosts.d)
            host = hosts.p_addr
            say(f"P on {hosts.p} ({hosts.p_addr}), D on {hosts.d} ({hosts.d_addr})")
        mode = Mode(args.mode)
        rows = serve(cfg, p_side, d_side, mode, requests, args.new_tokens, say, host)
    summary = Summary(
        cfg.name,
        str(p_side),
        str(d_side),
        args.mode,
        args.new_tokens,
        rows,
        time.perf_counter() - t0,
    )
    print(dumps(render_json(summary)) if args.json else render_text(summary))
    return 0 if summary.all_match else 1


def serve(
    cfg: ModelConfig,
    p_side: SideConfig,
    d_side: SideConfig,
    mode: Mode,
    requests: Sequence[DemoRequest],
    n_new: int,
    say: Say,
    host: str = "127.0.0.1",
) -> list[Row]:
    """Start P (its side channel on ``host``) and D, run every request through the
    router, stop them."""
    secret = secrets.token_bytes(16)
    t0 = time.perf_counter()
    with closing(PrefillServer(cfg, p_side, secret, host=host)) as p:
        say(f"P ready: {_procs(p_side.world)} ({time.perf_counter() - t0:.1f} s)")
        t0 = time.perf_counter()
        with closing(DecodeServer(cfg, d_side, secret, mode)) as d:
            say(f"D ready: {_procs(d_side.world)} ({time.perf_counter() - t0:.1f} s)")
            assert p.producer is not None
            t0 = time.perf_counter()
            failed = d.prepare(p.producer.endpoint, p.engine_id)  # not in the first request
            ms = (time.perf_counter() - t0) * 1e3
            if failed:  # the first request connects itself
                say(f"D could not prepare for P {p.engine_id} ({ms:.0f} ms): {failed[0]}")
            else:
                say(f"D prepared for P {p.engine_id} ({ms:.0f} ms)")
            router = Router(p, d)
            return [
                _one(router, cfg, r, n_new, f"[{i}/{len(requests)}]", say)
                for i, r in enumerate(requests, 1)
            ]


LONG = 128
"""New tokens from which a request also gets a line when it starts."""


def _one(router: Router, cfg: ModelConfig, r: DemoRequest, n_new: int, tag: str, say: Say) -> Row:
    if n_new >= LONG:
        say(
            f"{tag} {r.req_id}: {len(r.prompt)} prompt tokens; prefill on P, transfer, "
            f"{n_new} tokens decoded on D, then the colocated check ..."
        )
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


def _side(given: SideSpec, default: str) -> SideConfig:
    """The side as given, a key left out keeping the demo's default for that side."""
    values, _ = given.resolve(dict(side(default).given), {"tp": 1, "pp": 1})
    tp, pp, block = (int(values[k]) for k in ("tp", "pp", "block"))
    return SideConfig(tp, block, str(values["layout"]), pp=pp)


def check_side(cfg: ModelConfig, flag: str, given: SideSpec, s: SideConfig) -> None:
    """Refuse, before anything starts or is printed, a side the preset cannot run: a
    head or state axis that TP does not split, more PP stages than layers."""
    try:
        Parallel(tp=s.tp, pp=s.pp).stage_ranges(len(cfg.pattern))
        spec = model_spec(cfg, s.block_size)
        Model(cfg, spec, Shard(s.tp, 0), lambda x: x, range(len(cfg.pattern)))
        spec.check_tp(s.tp)
    except SpecError as e:
        text = ",".join(f"{k}={v}" for k, v in given.given) or "(default)"
        raise ConfigError(f"{flag} {text}: {e} (preset {cfg.name})") from None


def _room(side: SideConfig, tokens: int) -> SideConfig:
    """``side`` with enough blocks for one request of ``tokens`` tokens (and spare)."""
    need = -(-tokens // side.block_size) + 8
    return side if side.num_blocks >= need else replace(side, num_blocks=need)


def _requests(args: argparse.Namespace) -> list[DemoRequest]:
    texts = _read_prompts(args.prompts) if args.prompts else list(PROMPTS)
    if args.quick:
        texts = texts[:QUICK]
    prompts = [encode(t) for t in texts]
    _check_lengths(prompts, args)
    if any(args.cached >= len(p) for p in prompts):
        shortest = min(len(p) for p in prompts)
        raise ConfigError(f"--cached {args.cached} must be in [0, {shortest}) (shortest prompt)")
    out = [DemoRequest(f"r{i}", p, args.cached) for i, p in enumerate(prompts, 1)]
    if not (args.prompts or args.cached) and len(prompts[-1]) > REPEAT_CACHED:
        out.append(DemoRequest(f"r{len(out) + 1}", prompts[-1], REPEAT_CACHED))
    return out


def _check_lengths(prompts: Sequence[Sequence[int]], args: argparse.Namespace) -> None:
    """Refuse, before any process starts, a request the colocated check cannot hold."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    n = len(prompts[longest])
    if n + args.new_tokens <= MAX_TOKENS:
        return
    if args.prompts and n >= MAX_TOKENS:
        lead = f"--prompts {args.prompts}: prompt {longest + 1} has {n} tokens"
    else:
        where = f"prompt {longest + 1} of --prompts" if args.prompts else "a built-in prompt"
        lead = f"--new-tokens {args.new_tokens}: {where} has {n} tokens"
    raise ConfigError(
        f"{lead}; {n} + {args.new_tokens} new > {MAX_TOKENS} tokens, the most one demo "
        f"request holds (the colocated run that checks D's output has {REFERENCE_BLOCKS} "
        f"blocks of {REFERENCE_BLOCK} tokens)"
    )


def _read_prompts(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {path}: {e}") from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ConfigError(f"--prompts {path}: no non-blank line")
    return texts
