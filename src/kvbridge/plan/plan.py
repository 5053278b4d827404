"""A request's plan: runs per source rank, and its summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.plan.pattern import Pattern
from kvbridge.plan.runs import Runs
from kvbridge.spec.model import Kind

Use = tuple[int, Pattern, int]
"""``(source rank, pattern, tiles)``: a pattern applied to that many tiles."""


@dataclass(frozen=True, slots=True)
class SourceSummary:
    rank: int
    bytes: int
    descriptors: int


@dataclass(frozen=True, slots=True)
class PlanSummary:
    bytes: int
    descriptors: int
    bytes_by_kind: dict[str, int]
    sources: tuple[SourceSummary, ...]

    @property
    def bytes_per_descriptor(self) -> float:
        return self.bytes / self.descriptors if self.descriptors else 0.0


@dataclass(slots=True)
class Plan:
    """Runs to execute, keyed by source (P global) rank."""

    runs: dict[int, Runs]
    uses: list[Use] = field(default_factory=list)

    @property
    def descriptors(self) -> int:
        return sum(len(r) for r in self.runs.values())

    @property
    def nbytes(self) -> int:
        return sum(pat.nbytes * tiles for _, pat, tiles in self.uses)

    def summary(self) -> PlanSummary:
        by_kind = {str(k): 0 for k in Kind}
        for _, pat, tiles in self.uses:
            for k, b in pat.kind_bytes.items():
                by_kind[str(k)] += b * tiles
        srcs = tuple(
            SourceSummary(r, runs.nbytes, len(runs)) for r, runs in sorted(self.runs.items())
        )
        return PlanSummary(self.nbytes, self.descriptors, by_kind, srcs)
