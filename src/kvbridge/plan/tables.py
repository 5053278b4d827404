"""Per request: block tables as checked int64 arrays, and the tile spans a needed token
range falls into."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.errors import PlanError
from kvbridge.plan.pattern import RuleKey
from kvbridge.spec.model import Kind, Layer

SMALL = 256
"""Up to this many ids, sorting a copy is cheaper than numpy's reductions."""


@dataclass(frozen=True, slots=True)
class Tables:
    """Block tables checked where they enter (:func:`checked_tables`): one read-only 1-D
    int64 array per group (a copy: the caller may reuse its buffer), every id in
    ``[0, limits[g])``. The planner takes them as they are only when
    :func:`checked_tables` made them (``seal``), or a map that keeps ids in range passed
    the seal on (an engine adapter's slot cut and kernel-block split); any other instance
    is checked again. Pickled, a sealed one stays sealed and read-only."""

    ids: tuple[np.ndarray, ...]
    limits: tuple[int, ...]
    seal: object = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, g: int) -> np.ndarray:
        return self.ids[g]

    def lists(self) -> list[list[int]]:
        """As the handle and the lease carry them."""
        return [t.tolist() for t in self.ids]

    @classmethod
    def unchecked(cls, tables: Sequence[Sequence[int]], limits: Sequence[int]) -> Tables:
        """``tables`` as arrays, unsealed: whoever plans with them checks them."""
        return cls(tuple(map(_raw, tables)), tuple(limits))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return _unpickled, (self.ids, self.limits, self.seal is _SEAL)


def _unpickled(ids: tuple[np.ndarray, ...], limits: tuple[int, ...], sealed: bool) -> Tables:
    """A pickled :class:`Tables`; sealed again only if its ids still hold what the seal
    promises (one O(n) pass: a pickle is bytes anyone may have made)."""
    for t in ids:
        t.flags.writeable = False
    sealed = sealed and len(ids) == len(limits) and all(map(_within, ids, limits))
    return Tables(tuple(ids), tuple(limits), _SEAL if sealed else None)


def _raw(t: Sequence[int]) -> np.ndarray:
    try:
        return np.array(t, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):  # refused by the check as well
        return np.array(t, dtype=object)


def _within(t: np.ndarray, limit: int) -> bool:
    if not (isinstance(t, np.ndarray) and t.ndim == 1 and t.dtype == np.int64):
        return False
    return not t.size or int(t.view(np.uint64).max()) < limit  # negative: huge


def checked_tables(tables: object, num_blocks: Sequence[int], who: str) -> Tables:
    """``tables`` (one list of ints or 1-D integer array per group) as :class:`Tables`,
    each id in ``[0, num_blocks[g])``; :class:`PlanError` naming the first offending
    value otherwise. Nothing is coerced: ``0.9``, ``"3"`` and ``True`` are refused, not
    read as blocks 0, 3 and 1."""
    if isinstance(tables, Tables):
        sealed = tables.seal is _SEAL and len(tables.limits) == len(num_blocks)
        if sealed and all(a <= b for a, b in zip(tables.limits, num_blocks, strict=True)):
            return tables
        tables = tables.ids  # checked against other limits, or not by us: check again
    if not isinstance(tables, Sequence | np.ndarray) or len(tables) != len(num_blocks):
        got = len(tables) if isinstance(tables, Sequence | np.ndarray) else type(tables).__name__
        raise PlanError(f"{who}: need {len(num_blocks)} block tables (one per group), got {got}")
    pairs = enumerate(zip(tables, num_blocks, strict=True))
    return Tables(tuple(_ids(t, lim, who, g) for g, (t, lim) in pairs), tuple(num_blocks), _SEAL)


_SEAL = object()
"""What only :func:`checked_tables` puts in a :class:`Tables`."""


def _ids(t: object, limit: int, who: str, g: int) -> np.ndarray:
    """One group's ids as a checked int64 array (:func:`checked_tables`)."""
    if isinstance(t, np.ndarray):
        if t.ndim != 1 or t.dtype.kind not in "iu":
            raise PlanError(f"{who}: table {g} is a {t.dtype} array of shape {t.shape}")
        arr = np.array(t, dtype=np.int64)  # a copy: checked ids cannot change later
        if arr.size and arr.view(np.uint64).max() >= limit:  # negative ids wrap to huge ones
            _outside(who, g, int(t.min()), int(t.max()), limit)
        arr.flags.writeable = False
        return arr
    if not isinstance(t, Sequence) or isinstance(t, str | bytes):
        raise PlanError(f"{who}: table {g} is a {type(t).__name__}, not a list of block ids")
    if not {*map(type, t)} <= {int}:  # the rare case: numpy integers, or no block id
        t = [int(x) if isinstance(x, np.integer) else x for x in t]
        odd = [x for x in t if type(x) is not int][:1]
        if odd:
            bad, kind = odd[0], type(odd[0]).__name__
            raise PlanError(f"{who}: table {g} holds {bad!r} ({kind}), not a block id")
    if t and not (min(t) >= 0 and max(t) < limit):
        _outside(who, g, min(t), max(t), limit)
    arr = np.array(t, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def _outside(who: str, g: int, lo: int, hi: int, limit: int) -> None:
    worst = lo if lo < 0 else hi
    raise PlanError(f"{who}: table {g} holds block {worst}, outside [0, {limit})")


def unchecked(tables: object, g: int, limit: int) -> int:
    """The limit :func:`table` checks group ``g``'s ids against: 0 (none) where
    ``tables`` were checked against at most ``limit``."""
    ok = isinstance(tables, Tables) and tables.seal is _SEAL and 0 < tables.limits[g] <= limit
    return 0 if ok else limit


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
    """Block ids as int64, range-checked (if ``limit``; 0 for :class:`Tables`) over the
    entries ``n`` tokens use, padded to whole tiles. D's ids are checked where they are
    written (:func:`kvbridge.plan.joins.check_written`): only those are ever addressed."""
    tab = np.asarray(ids, dtype=np.int64)
    need = 1 if state else -(-n // bs)
    if tab.ndim != 1 or tab.shape[0] < need:
        raise PlanError(
            f"group {g}: {side} table has {tab.shape[0] if tab.ndim == 1 else tab.shape} "
            f"entries; {n} tokens need {need}"
        )
    used = tab[:need]
    if tab is ids and tab.flags.writeable:  # the caller's own array: a plan's grids keep
        used = used.copy()  # ids (not addresses), so a later change there must not reach it
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
    lo, hi = k0 + (s0 > 0), k1 + (t1 == tile)
    head = [(k0, k0 + 1, s0, tile)] if s0 else []
    tail = [(k1, k1 + 1, 0, t1)] if t1 != tile else []
    return head + ([(lo, hi, 0, tile)] if hi > lo else []) + tail
