"""Rendering of ``kvbridge plan``: the JSON object and the human tables (docs/plan-cli.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.layout.side import SideConfig
from kvbridge.plan.dry_run import RankPlan
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.model import Kind

KINDS = tuple(str(k) for k in Kind)


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

    @property
    def bytes_total(self) -> int:
        """Bytes all D ranks receive; replicated data counts once per receiving rank."""
        return sum(r.summary.bytes for r in self.ranks)

    @property
    def descriptors_total(self) -> int:
        return sum(r.summary.descriptors for r in self.ranks)

    def bytes_by_kind(self) -> dict[str, int]:
        return {k: sum(r.summary.bytes_by_kind.get(k, 0) for r in self.ranks) for k in KINDS}

    def layers_by_kind(self) -> dict[str, int]:
        layers = self.info.spec.layers
        return {k: sum(1 for lay in layers if str(lay.kind) == k and lay.streams) for k in KINDS}


def _mean(nbytes: int, descriptors: int) -> float:
    return nbytes / descriptors if descriptors else 0.0


def render_json(rep: Report) -> dict[str, Any]:
    return {
        "model": rep.info.spec.name,
        "source": rep.info.source,
        "tokens": rep.tokens,
        "cached_tokens": rep.cached,
        "shuffle_seed": rep.seed,
        "prefill": _side_json(rep.p),
        "decode": _side_json(rep.d),
        "bytes_total": rep.bytes_total,
        "descriptors_total": rep.descriptors_total,
        "mean_run_bytes": _mean(rep.bytes_total, rep.descriptors_total),
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
        "sources": [
            {"rank": src.rank, "bytes": src.bytes, "descriptors": src.descriptors}
            for src in s.sources
        ],
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
        lines += _table(("source", "bytes", "descriptors", "mean run"), rows)
    lines += ["", "by layer kind, all D ranks"]
    layers = rep.layers_by_kind()
    kinds = [(k, b) for k, b in rep.bytes_by_kind().items() if layers[k]]
    lines += _kind_table(kinds, layers)
    total, desc = rep.bytes_total, rep.descriptors_total
    lines += [
        "",
        f"total {total} bytes ({human(total)}) in {desc} descriptors, "
        f"mean run {human(_mean(total, desc))}",
    ]
    if rep.warnings:
        lines += ["", "warnings"] + [f"  ! {w}" for w in rep.warnings]
    return "\n".join(lines)


def _table(head: tuple[str, ...], rows: list[tuple[str, int, int]]) -> list[str]:
    return _grid([head] + [(n, human(b), str(d), human(_mean(b, d))) for n, b, d in rows])


def _kind_table(kinds: list[tuple[str, int]], layers: dict[str, int]) -> list[str]:
    return _grid([("kind", "layers", "bytes")] + [(k, str(layers[k]), human(b)) for k, b in kinds])


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
