"""Per-pair geometry and the per-request plan."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import IncompatibleError, PlanError
from kvbridge.plan.geometry import (
    Bound,
    Bucket,
    Pattern,
    RuleKey,
    concat_fine,
    fine_runs,
    rule_key,
    tile_of,
)
from kvbridge.plan.plan import Plan, Use
from kvbridge.plan.runs import Runs, merge_adjacent
from kvbridge.spec.model import Kind, Layer, ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.topology.sources import sources


@dataclass(frozen=True, slots=True)
class GroupGeom:
    tile: int
    bp: int
    bd: int
    np_: int
    """P blocks per tile."""
    nd: int
    """D blocks per tile."""
    p_blocks: int
    d_blocks: int
    pool: int
    state: bool
    buckets: tuple[Bucket, ...]
    pad: tuple[int, int] | None = None
    """``(bs_P, bs_D)`` where partial blocks may move whole (``pad_blocks``), else None."""


class Geometry:
    """Everything about one (P instance, D rank) pair that does not depend on a request.

    ``p_bound[r]`` is P global rank ``r``'s layout with region addresses; ``d_bound`` the
    D rank's. Build it once at handshake; call :meth:`plan` per request.

    ``pad_blocks``: D's engine never reads a slot of a request's blocks that lies outside
    the tokens it needs before writing it: past the prefilled tokens in its last block
    (true of any engine that computes the next token there, e.g. vLLM), and before a
    sliding window's or chunk's first needed token in that token's block (attention never
    looks there). Then a token group's needed range may run from the later of the two
    sides' block starts around its first token (never below D's cached prefix) to the
    end of the last block both sides hold, ``min(⌈n/bs_P⌉·bs_P, ⌈n/bs_D⌉·bs_D)``: the
    padding slots get what P's blocks hold there, and a partial block costs one run where
    it costs a run per head (or per element, with transposed K) otherwise. A bucket keeps
    the exact range where padding would add runs. No block outside the ones the exact
    range touches is read or written.
    """

    def __init__(
        self,
        spec_p: ModelSpec,
        spec_d: ModelSpec,
        p_par: Parallel,
        d_par: Parallel,
        p_bound: Sequence[Bound],
        d_bound: Bound,
        d_rank: int,
        pad_blocks: bool = False,
    ) -> None:
        if spec_p.compat_hash() != spec_d.compat_hash():
            raise IncompatibleError(
                f"P spec {spec_p.name!r} ({spec_p.compat_hash()}) and D spec "
                f"{spec_d.name!r} ({spec_d.compat_hash()}) store different bytes"
            )
        if len(p_bound) != p_par.world:
            raise IncompatibleError(f"{len(p_bound)} P layouts for P world {p_par.world}")
        self.spec = spec_d
        self.d_rank = d_rank
        parts: dict[tuple[int, RuleKey, int], list[dict[str, np.ndarray]]] = {}
        for pc in sources(spec_p, p_par, d_par, d_rank):
            layer = spec_d.layers[pc.layer]
            g = spec_d.group_of(pc.layer)
            tile, bp, bd = tile_of(spec_p, spec_d, g)
            key = (g, rule_key(layer), pc.src_rank)
            parts.setdefault(key, []).append(
                fine_runs(pc, layer, p_bound[pc.src_rank], d_bound, tile, bp, bd)
            )
        buckets: dict[int, list[Bucket]] = {}
        for key, fines in parts.items():
            g = key[0]
            tile = tile_of(spec_p, spec_d, g)[0]
            single = state_or_equal(spec_p, spec_d, g)
            bucket = Bucket(g, key[2], key[1], tile, single, concat_fine(fines))
            buckets.setdefault(g, []).append(bucket)
        groups = []
        for g in range(len(spec_d.groups)):
            tile, bp, bd = tile_of(spec_p, spec_d, g)
            state = spec_d.is_state_group(g)
            p_blocks = min(b.layout.num_blocks[g] for b in p_bound)
            d_lay = d_bound.layout
            groups.append(
                GroupGeom(
                    1 if state else tile,
                    1 if state else bp,
                    1 if state else bd,
                    1 if state else tile // bp,
                    1 if state else tile // bd,
                    p_blocks,
                    d_lay.num_blocks[g],
                    d_lay.pools[g],
                    state,
                    tuple(buckets.get(g, ())),
                    (bp, bd) if pad_blocks and not state else None,
                )
            )
        self.groups = tuple(groups)

    def plan(
        self,
        n_tokens: int,
        p_tables: Sequence[Sequence[int] | np.ndarray],
        d_tables: Sequence[Sequence[int] | np.ndarray],
        cached: int = 0,
    ) -> Plan:
        """Runs for one request of ``n_tokens`` prefilled tokens, ``cached`` already on D.

        ``p_tables[g]`` / ``d_tables[g]``: block ids of group ``g`` covering tokens
        ``[0, n_tokens)`` (state groups: one slot id). Raises :class:`PlanError`.
        """
        if n_tokens < 1 or not 0 <= cached <= n_tokens:
            raise PlanError(f"n_tokens={n_tokens}, cached={cached}: need 0 ≤ cached ≤ n, n ≥ 1")
        if len(p_tables) != len(self.groups) or len(d_tables) != len(self.groups):
            raise PlanError(
                f"{len(p_tables)} P and {len(d_tables)} D block tables "
                f"for {len(self.groups)} groups"
            )
        uses: list[Use] = []
        chunks: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        written: dict[int, list[np.ndarray]] = {}
        limits: dict[int, int] = {}
        for g, gg in enumerate(self.groups):
            ptab = _table(p_tables[g], gg.p_blocks, n_tokens, gg.bp, gg.np_, gg.state, "P", g)
            dtab = _table(d_tables[g], 0, n_tokens, gg.bd, gg.nd, gg.state, "D", g)
            first = n_tokens
            for b in gg.buckets:
                spans = _spans(b.rule, n_tokens, cached, gg.tile)
                if not spans:
                    continue
                if gg.pad is not None:
                    padded = _spans(b.rule, n_tokens, cached, gg.tile, gg.pad)
                    spans = padded if _runs(b, padded) <= _runs(b, spans) else spans
                first = min(first, spans[0][4])
                out = chunks.setdefault(b.src_rank, [])
                for k_lo, k_hi, s, t, _ in spans:
                    pat = b.pattern(s, t)
                    out.append(_apply(pat, ptab, dtab, k_lo, k_hi, gg.np_, gg.nd))
                    uses.append((b.src_rank, pat, k_hi - k_lo))
            if first < n_tokens:
                lo, hi = (0, 1) if gg.state else (first // gg.bd, -(-n_tokens // gg.bd))
                written.setdefault(gg.pool, []).append(dtab[lo:hi])
                limits[gg.pool] = min(limits.get(gg.pool, gg.d_blocks), gg.d_blocks)
        for pool, ids in written.items():
            _check_written(ids, pool, limits[pool])
        runs = {}
        for src, parts in chunks.items():
            if len(parts) == 1:
                runs[src] = Runs(*parts[0])
            else:
                runs[src] = Runs(*(np.concatenate(c) for c in zip(*parts, strict=True)))
        return Plan(runs, uses)


def state_or_equal(spec_p: ModelSpec, spec_d: ModelSpec, g: int) -> bool:
    """True when a tile holds one block on each side."""
    return spec_d.is_state_group(g) or (spec_p.groups[g].block_size == spec_d.groups[g].block_size)


def _runs(b: Bucket, spans: tuple[tuple[int, ...], ...]) -> int:
    """Runs ``spans`` take before streak joining (pattern runs × tiles)."""
    return sum(b.pattern(s, t).length.shape[0] * (hi - lo) for lo, hi, s, t, _ in spans)


@functools.lru_cache(maxsize=4096)
def _spans(
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
    return tuple((*span, a) for span in _tile_spans(a, e, tile))


def _table(
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

    D's ids are checked where they are written (:func:`_check_written`): only those are
    ever addressed."""
    tab = np.asarray(ids, dtype=np.int64)
    need = 1 if state else -(-n // bs)
    if tab.ndim != 1 or tab.shape[0] < need:
        raise PlanError(
            f"group {g}: {side} table has {tab.shape[0] if tab.ndim == 1 else tab.shape} "
            f"entries; {n} tokens need {need}"
        )
    used = tab[:need]
    if limit and used.view(np.uint64).max() >= limit:  # negative ids wrap to huge values
        lo, hi = int(used.min()), int(used.max())
        raise PlanError(f"group {g}: {side} block ids span [{lo}, {hi}]; valid are [0, {limit})")
    span = -(-need // per_tile) * per_tile
    if span > need:  # pad the last tile; padded ids are never addressed by its pattern
        used = np.concatenate((used, np.zeros(span - need, np.int64)))
    return used


def _tile_spans(a: int, e: int, tile: int) -> list[tuple[int, int, int, int]]:
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


def _apply(
    pat: Pattern, ptab: np.ndarray, dtab: np.ndarray, k_lo: int, k_hi: int, np_: int, nd: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Addresses of ``pat`` over tiles ``[k_lo, k_hi)``, ordered (run, tile).

    Where the pattern is streakable, tiles whose ids continue on both sides join.
    """
    if np_ == 1 and nd == 1:
        pid, did = ptab[k_lo:k_hi], dtab[k_lo:k_hi]
        if pat.streakable and _may_continue(pid, did):
            brk = (pid[1:] != pid[:-1] + 1) | (did[1:] != did[:-1] + 1)
            if not brk.any():  # one streak: one run per pattern run
                src = pat.soff + int(pid[0]) * pat.sstr
                return src, pat.doff + int(did[0]) * pat.dstr, pat.length * pid.shape[0]
            if not brk.all():
                return _streaks(pat, pid, did, brk)
    else:
        praw, draw = ptab[k_lo * np_ : k_hi * np_], dtab[k_lo * nd : k_hi * nd]
        pid = praw.reshape(-1, np_)[:, pat.sbit].T
        did = draw.reshape(-1, nd)[:, pat.dbit].T
        if _may_continue(praw, praw) and _may_continue(draw, draw):
            return _sorted_merge(
                _addresses(pat.soff_c, pid, 0, pat.sstr_c),
                _addresses(pat.doff_c, did, 0, pat.dstr_c),
                pat.lengths(k_hi - k_lo),
            )
    src = _addresses(pat.soff_c, pid, pat.sstride, pat.sstr_c)
    dst = _addresses(pat.doff_c, did, pat.dstride, pat.dstr_c)
    return src, dst, pat.lengths(k_hi - k_lo)


def _sorted_merge(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tiles of several blocks with consecutive ids: runs that continue each other on both
    sides need not be neighbours in (run, tile) order; order by source, then merge."""
    order = np.argsort(src, kind="stable")
    runs = merge_adjacent(src[order], dst[order], length[order])
    return runs.src, runs.dst, runs.length


def _may_continue(pid: np.ndarray, did: np.ndarray) -> bool:
    """Cheap test whether consecutive ids are worth looking for: a sampled neighbour
    pair continues on both sides. Only the descriptor count depends on it, never bytes."""
    n = pid.shape[0]
    for i in (0, (n - 1) // 2, n - 2) if n > 1 else ():
        if pid[i + 1] == pid[i] + 1 and did[i + 1] == did[i] + 1:
            return True
    return False


def _addresses(off_c: np.ndarray, ids: np.ndarray, stride: int, stride_c: np.ndarray) -> np.ndarray:
    """``off + id · stride`` for every (run, tile), flattened run-major."""
    if stride and ids.ndim == 1:
        return (off_c + ids * stride).ravel()
    return (off_c + ids * stride_c).ravel()


def _streaks(
    pat: Pattern, pid: np.ndarray, did: np.ndarray, brk: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    counts = np.diff(np.append(starts, pid.shape[0]))
    src = _addresses(pat.soff_c, pid[starts], pat.sstride, pat.sstr_c)
    dst = _addresses(pat.doff_c, did[starts], pat.dstride, pat.dstr_c)
    return src, dst, (pat.len_c * counts).ravel()


def _check_written(ids: list[np.ndarray], pool: int, limit: int) -> None:
    """D block ids about to be written: in ``[0, limit)`` and each used once per pool."""
    srt = np.sort(np.concatenate(ids) if len(ids) > 1 else ids[0])
    if srt[0] < 0 or srt[-1] >= limit:
        lo, hi = int(srt[0]), int(srt[-1])
        raise PlanError(f"D block ids span [{lo}, {hi}]; valid are [0, {limit})")
    if srt.shape[0] > 1:
        same = srt[1:] == srt[:-1]
        if np.count_nonzero(same):
            dup = int(srt[1:][same][0])
            raise PlanError(f"D block id {dup} is used twice (pool {pool})")
