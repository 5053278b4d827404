"""Rendering of ``kvbridge demo``: one row per request, a table or one JSON object."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvbridge.cli.plan_run import human


@dataclass(frozen=True, slots=True)
class Row:
    """One request: what moved (summed over D ranks) and whether D's output equals the
    colocated run's. ``transfer_ms``: the slowest D rank, from its load to P's lease
    confirmation (the first request of a D rank includes the handshake)."""

    request: str
    prompt_tokens: int
    cached_tokens: int
    bytes: int
    descriptors: int
    transfer_ms: float
    output_matches: bool
    recomputed: bool

    @property
    def gb_per_s(self) -> float:
        return self.bytes / (self.transfer_ms * 1e6) if self.transfer_ms > 0 else 0.0

    @property
    def latency_bound(self) -> bool:
        """Too few bytes for bandwidth to matter: the time is the round trip."""
        return self.bytes < LATENCY_BOUND


@dataclass(frozen=True, slots=True)
class Summary:
    preset: str
    prefill: str
    decode: str
    mode: str
    new_tokens: int
    rows: Sequence[Row]
    wall_s: float

    @property
    def all_match(self) -> bool:
        return all(r.output_matches for r in self.rows)


LATENCY_BOUND = 1 << 20
"""Transfers below this many bytes take about one round trip whatever their size (the
load, the lease, the completion notification): their GB/s says little."""
HEADER = (
    "request",
    "prompt",
    "cached",
    "bytes",
    "descriptors",
    "B/desc",
    "latency ms",
    "GB/s",
    "output",
)


def render_text(s: Summary) -> str:
    cells = [HEADER, *(_cells(r) for r in s.rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    matched = sum(r.output_matches for r in s.rows)
    lines.append(
        f"{matched} of {len(s.rows)} outputs equal the colocated run "
        f"({s.new_tokens} tokens each); {s.wall_s:.1f} s in all"
    )
    lines.append(
        "latency ms: load to outcome (lease held), slowest D rank (D prepared for P before "
        "the first: handshake and NIXL connections); GB/s = bytes / latency"
    )
    if any(r.latency_bound for r in s.rows):
        lines.append(
            f"* under {human(LATENCY_BOUND)}: latency-bound, the time is the round trip "
            f"(load, lease, notification), not the bandwidth; `kvbridge bench transfer` "
            f"measures bandwidth"
        )
    return "\n".join(lines)


def _cells(r: Row) -> tuple[str, ...]:
    per_desc = human(r.bytes // r.descriptors) if r.descriptors else "-"
    verdict = "match" if r.output_matches else "MISMATCH"
    if r.recomputed:
        verdict += " (recomputed on D)"
    return (
        r.request,
        str(r.prompt_tokens),
        str(r.cached_tokens),
        human(r.bytes),
        str(r.descriptors),
        per_desc,
        f"{r.transfer_ms:.1f}",
        f"{r.gb_per_s:.2g}" + ("*" if r.latency_bound else ""),
        verdict,
    )


def render_json(s: Summary) -> dict[str, Any]:
    requests = [
        {**asdict(r), "gb_per_s": round(r.gb_per_s, 6), "latency_bound": r.latency_bound}
        for r in s.rows
    ]
    return {
        "preset": s.preset,
        "prefill": s.prefill,
        "decode": s.decode,
        "mode": s.mode,
        "new_tokens": s.new_tokens,
        "requests": requests,
        "all_match": s.all_match,
        "wall_s": round(s.wall_s, 3),
    }
