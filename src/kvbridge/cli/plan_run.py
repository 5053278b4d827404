"""The work of ``kvbridge plan`` (its flags: :mod:`kvbridge.cli.plan_cmd`): sides
resolved, resource guards, the dry run, the report (JSON or tables, docs/plan-cli.md)
and its warnings.

The memory guard plans every D rank at two small token counts and extrapolates each
rank's descriptor count linearly (descriptors grow at most linearly with the blocks a
request spans; windowed layers grow slower, so the estimate errs high). Ranks are planned
one at a time, so the peak is the largest rank's runs plus the block tables of both sides.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvbridge.cli.args import SideSpec
from kvbridge.errors import ConfigError, SpecError
from kvbridge.jsonio import dumps
from kvbridge.layout.side import SideConfig
from kvbridge.plan.dry_run import RankPlan, dry_run, pool_size
from kvbridge.spec.dtypes import DType, parse_dtype
from kvbridge.spec.hf import load_config
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.load import load_model, model_path
from kvbridge.spec.model import Kind

SMALL_RUN = 16 * 1024
"""Mean run size (bytes) below which descriptor count dominates (docs/performance.md)."""
PROGRESS_DESCRIPTORS = 2_000_000
"""Estimated descriptors (largest D rank) from which each rank's plan gets a line."""
SHARED_KEYS = ("block", "layout")
"""Keys one side takes from the other when left out (TP and PP default to 1)."""
KINDS = tuple(str(k) for k in Kind)
BYTES_PER_DESCRIPTOR = 128
"""Peak bytes per descriptor of the largest rank while it is planned and summarised
(measured under tracemalloc: 48 to 82; a test keeps the bound honest)."""
FIXED_BYTES = 16 << 20
"""Geometry, layouts and small tables, whatever the token count."""
BYTES_PER_BLOCK_ID = 40
"""Block tables: the shuffled pool, P's and D's tables and their int64 copies."""
SAMPLE_TOKENS = (2048, 4096)
"""Token counts planned to extrapolate from; at or below the larger, no estimate."""


def run(args: argparse.Namespace) -> int:
    info = load_model(
        args.model, _dtype(args.kv_dtype, "--kv-dtype"), _dtype(args.ssm_dtype, "--ssm-dtype")
    )
    p, d = sides(args.prefill, args.decode)
    if args.cached_tokens > args.tokens:
        raise ConfigError(f"--cached-tokens: {args.cached_tokens} not in [0, {args.tokens}]")
    est = estimate(info, p, d, args.tokens, args.shuffle_blocks)
    if est.bytes > args.max_memory:
        seed = args.shuffle_blocks
        shuffled = f" --shuffle-blocks {seed}" if seed is not None else ""
        raise ConfigError(
            f"--tokens {args.tokens}{shuffled}: planning would need about {human(est.bytes)} "
            f"({est.descriptors:,} descriptors on the largest D rank), over the limit of "
            f"{human(args.max_memory)} (--max-memory); plan fewer tokens or raise the limit"
        )
    ranks = plan_ranks(info, p, d, args, progress=est.descriptors >= PROGRESS_DESCRIPTORS)
    report = Report(info, p, d, args.tokens, args.cached_tokens, args.shuffle_blocks, ranks)
    limit = context_length(args.model)
    if limit is not None and args.tokens > limit:
        report.warnings.append(
            f"--tokens {args.tokens} exceeds the model's context length of {limit} tokens "
            f"(max_position_embeddings): no real request is this long"
        )
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
    out.extend(
        f"{name}={units} < D TP {d.tp}: each unit is replicated on {d.tp // units} "
        f"D ranks, which all receive it (a smaller D TP moves fewer bytes)"
        for name, units in report.info.sharded
        if units < d.tp
    )
    return out


def _layout_advice(report: Report, max_memory: int | None) -> list[str]:
    """If runs are short, the best other choice of nhd/hnd per side for D rank 0."""
    first = report.ranks[0].summary
    if first.descriptors == 0 or first.bytes_per_descriptor >= SMALL_RUN:
        return []
    p, d, request = report.p, report.d, (report.tokens, report.cached, report.seed)
    alts = []
    for p_lay, d_lay in itertools.product(("nhd", "hnd"), repeat=2):
        alt_p, alt_d = replace(p, layout=p_lay), replace(d, layout=d_lay)
        if (p_lay, d_lay) == (p.layout, d.layout) or (
            max_memory is not None
            and estimate(report.info, alt_p, alt_d, report.tokens, report.seed).bytes > max_memory
        ):
            continue
        alt = dry_run(report.info, alt_p, alt_d, *request, d_ranks=[report.ranks[0].rank])[0]
        alts.append((alt.summary.bytes_per_descriptor, alt_p, alt_d, alt))
    if not alts:
        return []
    mean, alt_p, alt_d, alt = max(alts, key=lambda a: a[0])
    if mean < 2 * first.bytes_per_descriptor:
        return []
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


@dataclass
class Report:
    info: ModelInfo
    p: SideConfig
    d: SideConfig
    tokens: int
    cached: int
    seed: int | None
    ranks: list[RankPlan]
    warnings: list[str] = field(default_factory=list)

    def totals(self) -> tuple[int, int]:
        """Bytes all D ranks receive (replicated data once per receiving rank), and
        their descriptors."""
        return sum(r.summary.bytes for r in self.ranks), sum(
            r.summary.descriptors for r in self.ranks
        )

    def bytes_by_kind(self) -> dict[str, int]:
        return {k: sum(r.summary.bytes_by_kind.get(k, 0) for r in self.ranks) for k in KINDS}

    def layers_by_kind(self) -> dict[str, int]:
        layers = self.info.spec.layers
        return {k: sum(1 for lay in layers if str(lay.kind) == k and lay.streams) for k in KINDS}


def _mean(nbytes: int, descriptors: int) -> float:
    return nbytes / descriptors if descriptors else 0.0


def render_json(rep: Report) -> dict[str, Any]:
    total, desc = rep.totals()
    return {
        "model": rep.info.spec.name,
        "source": rep.info.source,
        "tokens": rep.tokens,
        "cached_tokens": rep.cached,
        "shuffle_seed": rep.seed,
        "prefill": _side_json(rep.p),
        "decode": _side_json(rep.d),
        "bytes_total": total,
        "descriptors_total": desc,
        "mean_run_bytes": _mean(total, desc),
        "bytes_by_kind": rep.bytes_by_kind(),
        "layers_by_kind": rep.layers_by_kind(),
        "decode_ranks": [_rank_json(r) for r in rep.ranks],
        "warnings": list(rep.warnings),
    }


def _rank_json(r: RankPlan) -> dict[str, Any]:
    s = r.summary
    return {
        "rank": r.rank,
        "stage": r.stage,
        "tp_rank": r.tp_rank,
        "bytes": s.bytes,
        "descriptors": s.descriptors,
        "mean_run_bytes": s.bytes_per_descriptor,
        "bytes_by_kind": {k: s.bytes_by_kind.get(k, 0) for k in KINDS},
        "sources": [asdict(src) for src in s.sources],
    }


def render_text(rep: Report) -> str:
    spec = rep.info.spec
    blocks = "consecutive" if rep.seed is None else f"shuffled (seed {rep.seed})"
    lines = [
        f"{spec.name} · {rep.info.source} · {rep.info.num_model_layers} layers · "
        f"{rep.tokens} tokens, {rep.cached} cached · {blocks} block ids",
        f"P  {_describe(rep.p)}",
        f"D  {_describe(rep.d)}",
    ]
    for r in rep.ranks:
        lines += ["", f"D rank {r.rank} (stage {r.stage}, tp {r.tp_rank})"]
        rows = [(f"P{s.rank}", s.bytes, s.descriptors) for s in r.summary.sources]
        rows.append(("all", r.summary.bytes, r.summary.descriptors))
        cells = [(n, human(b), str(d), human(_mean(b, d))) for n, b, d in rows]
        lines += _grid([("source", "bytes", "descriptors", "mean run"), *cells])
    lines += ["", "by layer kind, all D ranks"]
    layers = rep.layers_by_kind()
    kinds = [(k, str(layers[k]), human(b)) for k, b in rep.bytes_by_kind().items() if layers[k]]
    lines += _grid([("kind", "layers", "bytes"), *kinds])
    total, desc = rep.totals()
    lines += [
        "",
        f"total {total} bytes ({human(total)}) in {desc} descriptors, "
        f"mean run {human(_mean(total, desc))}",
    ]
    if rep.warnings:
        lines += ["", "warnings"] + [f"  ! {w}" for w in rep.warnings]
    return "\n".join(lines)


def _grid(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells, the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


def human(nbytes: float) -> str:
    """``1536`` → ``"1.5 KiB"``; bytes below 1 KiB as ``"512 B"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _side_json(s: SideConfig) -> dict[str, int | str]:
    return {"tp": s.tp, "pp": s.pp, "block": s.block_size, "layout": s.layout}


def _describe(s: SideConfig) -> str:
    return f"tp={s.tp} pp={s.pp} block={s.block_size} layout={s.layout}"


@dataclass(frozen=True, slots=True)
class Estimate:
    descriptors: int
    """Of the largest D rank."""
    bytes: int


def estimate(
    info: ModelInfo, p: SideConfig, d: SideConfig, tokens: int, seed: int | None
) -> Estimate:
    """The memory planning ``tokens`` tokens needs, from plans at :data:`SAMPLE_TOKENS`."""
    t1, t2 = SAMPLE_TOKENS
    if tokens <= t2:
        t1 = t2 = tokens
    one = [r.summary.descriptors for r in dry_run(info, p, d, t1, 0, seed)]
    two = [r.summary.descriptors for r in dry_run(info, p, d, t2, 0, seed)] if t2 != t1 else one
    slope = [max(b - a, 0) / (t2 - t1) if t2 > t1 else 0.0 for a, b in zip(one, two, strict=True)]
    # shuffled ids join by chance where they happen to be consecutive, less often in the
    # small samples' pools than in a large one: a 10 % margin keeps this a bound
    desc = max(int((b + s * (tokens - t2)) * 1.1) + 1 for b, s in zip(two, slope, strict=True))
    pool = max(pool_size(info.spec.with_block_sizes(x.block_size), tokens) for x in (p, d))
    return Estimate(desc, FIXED_BYTES + desc * BYTES_PER_DESCRIPTOR + pool * BYTES_PER_BLOCK_ID)


def context_length(model: str) -> int | None:
    """``max_position_embeddings`` of the model's ``config.json`` (top level, or in
    ``text_config``); None for spec files and configs without one."""
    try:
        data = load_config(model_path(model))
    except ConfigError:
        return None
    for cfg in (data, data.get("text_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("max_position_embeddings"), int):
            return int(cfg["max_position_embeddings"])
    return None
