"""Parallel configuration of one instance (TP size, PP stages as layer ranges), and which
units of a segment a TP rank holds.

Global rank numbering: ``rank = stage * tp + tp_rank``. ``units`` split over ``tp`` ranks:
rank ``r`` holds ``[r·U/T, (r+1)·U/T)`` when T divides U; when U < T and U divides T each
unit is replicated on T/U ranks (rank r holds unit ``r·U // T``); replicated streams (MLA)
hold everything on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, pairwise

from kvbridge.errors import SpecError


@dataclass(frozen=True, slots=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    stages: tuple[tuple[int, int], ...] = ()
    """Explicit ``[start, stop)`` layer range per PP stage; empty: split evenly."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise SpecError(f"tp={self.tp} and pp={self.pp} must be ≥ 1")
        if self.stages and len(self.stages) != self.pp:
            raise SpecError(f"{len(self.stages)} stage ranges given for pp={self.pp}")

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pp_stage, tp_rank)`` of a global rank."""
        if not 0 <= rank < self.world:
            raise SpecError(f"rank {rank} outside world size {self.world}")
        return divmod(rank, self.tp)

    def stage_ranges(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """Layer range of every stage; earlier stages take the remainder."""
        if self.stages:
            ends = [r[1] for r in self.stages]
            starts = [r[0] for r in self.stages]
            if starts[0] != 0 or ends[-1] != num_layers or starts[1:] != ends[:-1]:
                raise SpecError(f"stages {self.stages} do not tile layers [0, {num_layers})")
            return self.stages
        if self.pp > num_layers:
            raise SpecError(f"pp={self.pp} exceeds the {num_layers} layers")
        return split_evenly(num_layers, self.pp)

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        for s, (a, b) in enumerate(self.stage_ranges(num_layers)):
            if a <= layer < b:
                return s
        raise SpecError(f"layer {layer} outside [0, {num_layers})")


def split_evenly(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``parts`` consecutive ``[start, stop)`` ranges over ``n`` items; earlier ranges take
    the remainder."""
    base, extra = divmod(n, parts)
    sizes = (base + 1 if s < extra else base for s in range(parts))
    return tuple(pairwise(accumulate(sizes, initial=0)))


def shard_interval(units: int, tp: int, rank: int, replicated: bool = False) -> tuple[int, int]:
    """Global unit interval ``[start, stop)`` held by TP ``rank`` of ``tp``."""
    if tp < 1 or not 0 <= rank < tp:
        raise SpecError(f"tp rank {rank} outside tp size {tp}")
    if replicated:
        return (0, units)
    if units % tp == 0:
        n = units // tp
        return (rank * n, rank * n + n)
    if tp % units == 0:
        u = rank * units // tp
        return (u, u + 1)
    raise SpecError(f"{units} units cannot be split over TP {tp} (neither divides the other)")
