"""``kvbridge plan``: what one request moves between a P and a D configuration.

    kvbridge plan --model PATH --prefill "tp=2,pp=1,block=16,layout=hnd" \\
        --decode "tp=4,block=32,layout=nhd" --tokens 5000 [--cached-tokens K] \\
        [--shuffle-blocks SEED] [--kv-dtype fp8] [--json]

``PATH``: a directory with ``config.json``, a ``config.json``, or a kvbridge spec file.
Output (``docs/plan-cli.md``): per D rank its sources, bytes, descriptors and mean run
size; totals by layer kind; warnings worth acting on.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from kvbridge.cli.plan_report import Report, human, render_json, render_text
from kvbridge.errors import ConfigError, SpecError
from kvbridge.layout.build import LAYOUTS
from kvbridge.plan.dry_run import Instance, RankPlan, dry_run
from kvbridge.spec.dtypes import DType, parse_dtype
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.load import load_model

_SIDE_KEYS = ("tp", "pp", "block", "layout")
SMALL_RUN = 16 * 1024
"""Mean run size (bytes) below which descriptor count dominates (shared/NIXL_NOTES.md)."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="show the transfer plan of one request between two configurations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="config.json, its directory, or a spec file")
    p.add_argument("--prefill", default="", help='P: "tp=2,pp=1,block=16,layout=hnd"')
    p.add_argument("--decode", default="", help='D: "tp=4,pp=1,block=32,layout=nhd"')
    p.add_argument("--tokens", type=int, required=True, help="tokens P prefilled")
    p.add_argument("--cached-tokens", type=int, default=0, help="prefix already on D")
    p.add_argument("--shuffle-blocks", type=int, metavar="SEED", help="shuffled block ids")
    p.add_argument("--kv-dtype", help="K/V (and MLA latent) dtype, e.g. fp8 (default: model)")
    p.add_argument("--ssm-dtype", help="recurrent/SSM state dtype (default: config or model)")
    p.add_argument("--json", action="store_true", help="one JSON object (docs/plan-cli.md)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    info = load_model(
        args.model, _dtype(args.kv_dtype, "--kv-dtype"), _dtype(args.ssm_dtype, "--ssm-dtype")
    )
    p = parse_instance(args.prefill, "--prefill")
    d = parse_instance(args.decode, "--decode")
    if args.tokens < 1:
        raise ConfigError(f"--tokens: {args.tokens} < 1")
    if not 0 <= args.cached_tokens <= args.tokens:
        raise ConfigError(f"--cached-tokens: {args.cached_tokens} not in [0, {args.tokens}]")
    ranks = dry_run(info, p, d, args.tokens, args.cached_tokens, args.shuffle_blocks)
    report = Report(info, p, d, args.tokens, args.cached_tokens, args.shuffle_blocks, ranks)
    report.warnings.extend(warnings(report))
    print(json.dumps(render_json(report), indent=1) if args.json else render_text(report))
    return 0


def _dtype(name: str | None, flag: str) -> DType | None:
    if name is None:
        return None
    try:
        return parse_dtype(name)
    except SpecError as e:
        raise ConfigError(f"{flag}: {e}") from None


def parse_instance(text: str, flag: str) -> Instance:
    """``"tp=2,pp=1,block=16,layout=hnd"`` → :class:`Instance` (omitted keys: defaults)."""
    values: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _SIDE_KEYS:
            raise ConfigError(f"{flag}: {item!r} is not key=value with key in {_SIDE_KEYS}")
        if key in values:
            raise ConfigError(f"{flag}: {key} given twice")
        values[key] = _side_value(key, value.strip(), flag)
    return Instance(**values)


def _side_value(key: str, value: str, flag: str) -> int | str:
    if key == "layout":
        if value not in LAYOUTS:
            raise ConfigError(f"{flag}: layout={value!r}; known: {', '.join(LAYOUTS)}")
        return value
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{flag}: {key}={value!r} is not an integer") from None
    if number < 1:
        raise ConfigError(f"{flag}: {key}={number} must be ≥ 1")
    return number


def warnings(report: Report) -> list[str]:
    """Advice worth acting on: layouts that would keep runs long, replicated heads,
    block sizes that cut runs at both sides' boundaries."""
    out = _layout_advice(report)
    p, d = report.p, report.d
    lo, hi = sorted((p.block, d.block))
    if hi % lo:
        out.append(
            f"block sizes {p.block} (P) and {d.block} (D) do not divide each other: runs "
            f"break at both sides' block boundaries; equal or dividing sizes keep them long"
        )
    out.extend(_replication_notes(report.info, d))
    return out


def _layout_advice(report: Report) -> list[str]:
    """If runs are short, the best other choice of nhd/hnd per side for D rank 0."""
    first = report.ranks[0].summary
    if first.descriptors == 0 or first.bytes_per_descriptor >= SMALL_RUN:
        return []
    p, d = report.p, report.d
    best: tuple[float, Instance, Instance, RankPlan] | None = None
    for p_lay in ("nhd", "hnd"):
        for d_lay in ("nhd", "hnd"):
            if (p_lay, d_lay) == (p.layout, d.layout):
                continue
            alt_p, alt_d = replace(p, layout=p_lay), replace(d, layout=d_lay)
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


def _replication_notes(info: ModelInfo, d: Instance) -> list[str]:
    out = []
    for field, units in info.sharded:
        if units < d.tp:
            out.append(
                f"{field}={units} < D TP {d.tp}: each unit is replicated on {d.tp // units} "
                f"D ranks, which all receive it (a smaller D TP moves fewer bytes)"
            )
    return out
