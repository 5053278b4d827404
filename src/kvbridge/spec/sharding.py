"""Which units of a segment a TP rank holds.

``units`` split over ``tp`` ranks: rank ``r`` holds ``[r·U/T, (r+1)·U/T)`` when T divides U;
when U < T and U divides T each unit is replicated on T/U ranks (rank r holds unit
``r·U // T``); replicated streams (MLA) hold everything on every rank.
"""

from __future__ import annotations

from kvbridge.errors import SpecError


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
