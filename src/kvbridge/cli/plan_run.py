"""The work of ``kvbridge plan`` (its flags: :mod:`kvbridge.cli.plan_cmd`): sides
resolved, resource guards, the dry run, the report and its warnings."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from kvbridge.cli.args import SideSpec
from kvbridge.cli.plan_guards import Estimate, context_length, estimate
from kvbridge.cli.plan_report import Report, human, render_json, render_text
from kvbridge.errors import ConfigError, SpecError
from kvbridge.jsonio import dumps
from kvbridge.layout.side import SideConfig
from kvbridge.plan.dry_run import RankPlan, dry_run
from kvbridge.spec.dtypes import DType, parse_dtype
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.load import load_model

SMALL_RUN = 16 * 1024
"""Mean run size (bytes) below which descriptor count dominates (docs/performance.md)."""
PROGRESS_DESCRIPTORS = 2_000_000
"""Estimated descriptors (largest D rank) from which each rank's plan gets a line."""
SHARED_KEYS = ("block", "layout")
"""Keys one side takes from the other when left out (TP and PP default to 1)."""


def run(args: argparse.Namespace) -> int:
    info = load_model(
        args.model, _dtype(args.kv_dtype, "--kv-dtype"), _dtype(args.ssm_dtype, "--ssm-dtype")
    )
    p, d = sides(args.prefill, args.decode)
    if args.cached_tokens > args.tokens:
        raise ConfigError(f"--cached-tokens: {args.cached_tokens} not in [0, {args.tokens}]")
    est = _check_memory(info, p, d, args)
    ranks = plan_ranks(info, p, d, args, progress=est.descriptors >= PROGRESS_DESCRIPTORS)
    report = Report(info, p, d, args.tokens, args.cached_tokens, args.shuffle_blocks, ranks)
    report.warnings.extend(_context_warning(args.model, args.tokens))
    report.warnings.extend(warnings(report, args.max_memory))
    print(dumps(render_json(report)) if args.json else render_text(report))
    return 0


def sides(prefill: SideSpec, decode: SideSpec) -> tuple[SideConfig, SideConfig]:
    """Both sides, a key left out taken from the other side (block, layout), else the
    default; says on stderr what was taken, so no value is chosen silently."""
    out = []
    for flag, own, other, other_flag in (
        ("--prefill", prefill, decode, "--decode"),
        ("--decode", decode, prefill, "--prefill"),
    ):
        shared = {k: v for k, v in other.given if k in SHARED_KEYS}
        values, filled = own.resolve(shared)
        if filled:
            taken = ", ".join(f"{k}={values[k]}" for k in filled)
            print(f"kvbridge plan: {flag}: {taken} taken from {other_flag}", file=sys.stderr)
        tp, pp = int(values.get("tp", 1)), int(values.get("pp", 1))
        block, layout = int(values.get("block", 16)), str(values.get("layout", "nhd"))
        out.append(SideConfig(tp, block, layout, pp=pp))
    return out[0], out[1]


def plan_ranks(
    info: ModelInfo, p: SideConfig, d: SideConfig, args: argparse.Namespace, progress: bool
) -> list[RankPlan]:
    """Every D rank's plan; with ``progress``, one rank at a time with a line on stderr
    each (the seeded block tables are the same in every call, so are the plans)."""
    request = (args.tokens, args.cached_tokens, args.shuffle_blocks)
    if not progress:
        return dry_run(info, p, d, *request)
    world, out, t0 = d.tp * d.pp, [], time.perf_counter()
    for r in range(world):
        out += dry_run(info, p, d, *request, d_ranks=[r])
        took = time.perf_counter() - t0
        print(f"kvbridge plan: D rank {r + 1}/{world} planned ({took:.1f} s)", file=sys.stderr)
    return out


def _check_memory(
    info: ModelInfo, p: SideConfig, d: SideConfig, args: argparse.Namespace
) -> Estimate:
    est = estimate(info, p, d, args.tokens, args.shuffle_blocks)
    if est.bytes > args.max_memory:
        shuffled = (
            f" --shuffle-blocks {args.shuffle_blocks}" if args.shuffle_blocks is not None else ""
        )
        raise ConfigError(
            f"--tokens {args.tokens}{shuffled}: planning would need about {human(est.bytes)} "
            f"({est.descriptors:,} descriptors on the largest D rank), over the limit of "
            f"{human(args.max_memory)} (--max-memory); plan fewer tokens or raise the limit"
        )
    return est


def _context_warning(model: str, tokens: int) -> list[str]:
    limit = context_length(model)
    if limit is None or tokens <= limit:
        return []
    return [
        f"--tokens {tokens} exceeds the model's context length of {limit} tokens "
        f"(max_position_embeddings): no real request is this long"
    ]


def _dtype(name: str | None, flag: str) -> DType | None:
    if name is None:
        return None
    try:
        return parse_dtype(name)
    except SpecError as e:
        raise ConfigError(f"{flag}: {e}") from None


def warnings(report: Report, max_memory: int | None = None) -> list[str]:
    """Advice worth acting on: layouts that would keep runs long, replicated heads,
    block sizes that cut runs at both sides' boundaries. Alternatives whose plan would
    need more than ``max_memory`` bytes are not tried."""
    out = _layout_advice(report, max_memory)
    p, d = report.p, report.d
    lo, hi = sorted((p.block_size, d.block_size))
    if hi % lo:
        out.append(
            f"block sizes {p.block_size} (P) and {d.block_size} (D) do not divide each other: runs "
            f"break at both sides' block boundaries; equal or dividing sizes keep them long"
        )
    out.extend(_replication_notes(report.info, d))
    return out


def _layout_advice(report: Report, max_memory: int | None) -> list[str]:
    """If runs are short, the best other choice of nhd/hnd per side for D rank 0."""
    first = report.ranks[0].summary
    if first.descriptors == 0 or first.bytes_per_descriptor >= SMALL_RUN:
        return []
    p, d = report.p, report.d
    best: tuple[float, SideConfig, SideConfig, RankPlan] | None = None
    for p_lay in ("nhd", "hnd"):
        for d_lay in ("nhd", "hnd"):
            if (p_lay, d_lay) == (p.layout, d.layout):
                continue
            alt_p, alt_d = replace(p, layout=p_lay), replace(d, layout=d_lay)
            if max_memory is not None:
                est = estimate(report.info, alt_p, alt_d, report.tokens, report.seed)
                if est.bytes > max_memory:
                    continue
            alt = dry_run(
                report.info,
                alt_p,
                alt_d,
                report.tokens,
                report.cached,
                report.seed,
                d_ranks=[report.ranks[0].rank],
            )[0]
            mean = alt.summary.bytes_per_descriptor
            if best is None or mean > best[0]:
                best = (mean, alt_p, alt_d, alt)
    if best is None or best[0] < 2 * first.bytes_per_descriptor:
        return []
    mean, alt_p, alt_d, alt = best
    split = f" with a head split (TP {p.tp}→{d.tp})" if p.tp != d.tp else ""
    return [
        f"{_sides(p.layout, d.layout)}{split} yields {human(first.bytes_per_descriptor)} "
        f"runs; {_sides(alt_p.layout, alt_d.layout)} keeps {human(mean)} runs "
        f"(D rank {alt.rank}: {first.descriptors} → {alt.summary.descriptors} descriptors)"
    ]


def _sides(p_layout: str, d_layout: str) -> str:
    if p_layout == d_layout:
        return f"{p_layout.upper()} on P and D"
    return f"{p_layout.upper()} on P, {d_layout.upper()} on D"


def _replication_notes(info: ModelInfo, d: SideConfig) -> list[str]:
    out = []
    for field, units in info.sharded:
        if units < d.tp:
            out.append(
                f"{field}={units} < D TP {d.tp}: each unit is replicated on {d.tp // units} "
                f"D ranks, which all receive it (a smaller D TP moves fewer bytes)"
            )
    return out
