"""Per request: block tables as checked int64 arrays, and the tile spans a needed token
range falls into."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvbridge.errors import PlanError
from kvbridge.plan.pattern import RuleKey
from kvbridge.spec.model import Kind, Layer

SMALL = 256
"""Up to this many ids, sorting a copy is cheaper than numpy's reductions."""


@functools.lru_cache(maxsize=4096)
def spans(
    rule: RuleKey, n: int, cached: int, tile: int, pad: tuple[int, int] | None = None
) -> tuple[tuple[int, ...], ...]:
    """Tile spans ``(k_lo, k_hi, s, t, first token)`` of a rule's needed token range;
    with ``pad = (bs_P, bs_D)`` widened to whole blocks (``pad_blocks``)."""
    kind, window, chunk = rule
    a, e = Layer(0, Kind(kind), (), window, chunk).needed_tokens(n, cached)
    if a >= e:
        return ()
    if pad is not None:
        bp, bd = pad
        e = max(e, min(-(-n // bp) * bp, -(-n // bd) * bd))
        a = max(cached, a - a % bp, a - a % bd)
    return tuple((*span, a) for span in tile_spans(a, e, tile))


def table(
    ids: Sequence[int] | np.ndarray,
    limit: int,
    n: int,
    bs: int,
    per_tile: int,
    state: bool,
    side: str,
    g: int,
) -> np.ndarray:
    """Block ids as int64, range-checked (if ``limit``) over the entries ``n`` tokens use.

    D's ids are checked where they are written (:func:`kvbridge.plan.joins.check_written`):
    only those are ever addressed."""
    tab = np.asarray(ids, dtype=np.int64)
    need = 1 if state else -(-n // bs)
    if tab.ndim != 1 or tab.shape[0] < need:
        raise PlanError(
            f"group {g}: {side} table has {tab.shape[0] if tab.ndim == 1 else tab.shape} "
            f"entries; {n} tokens need {need}"
        )
    used = tab[:need]
    if limit:
        if need <= SMALL:  # sorting a copy is cheaper than numpy's reductions
            srt = used.copy()
            srt.sort()
            bad = srt[0] < 0 or srt[-1] >= limit
        else:
            bad = used.view(np.uint64).max() >= limit  # negative ids wrap to huge values
        if bad:
            lo, hi = int(used.min()), int(used.max())
            raise PlanError(
                f"group {g}: {side} block ids span [{lo}, {hi}]; valid are [0, {limit})"
            )
    span = -(-need // per_tile) * per_tile
    if span > need:  # pad the last tile; padded ids are never addressed by its pattern
        used = np.concatenate((used, np.zeros(span - need, np.int64)))
    return used


def tile_spans(a: int, e: int, tile: int) -> list[tuple[int, int, int, int]]:
    """Split tokens ``[a, e)`` into tile spans ``(k_lo, k_hi, s, t)`` sharing a pattern."""
    k0, k1 = a // tile, (e - 1) // tile
    s0, t1 = a - k0 * tile, e - k1 * tile
    if k0 == k1:
        return [(k0, k0 + 1, s0, t1)]
    spans = []
    lo, hi = k0, k1 + 1
    if s0:
        spans.append((k0, k0 + 1, s0, tile))
        lo = k0 + 1
    if t1 != tile:
        hi = k1
    if hi > lo:
        spans.append((lo, hi, 0, tile))
    if t1 != tile:
        spans.append((k1, k1 + 1, 0, t1))
    return spans
