"""Per-pair geometry and the per-request plan."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import IncompatibleError, PlanError
from kvbridge.plan.joins import (
    FM,
    PAIR_LIMIT,
    Fast,
    Keys,
    M,
    Tab,
    Triple,
    addresses,
    chains,
    check_written,
    merge_all,
    realize,
    streak_runs,
)
from kvbridge.plan.links import Link, RankLinks, rank_links
from kvbridge.plan.pattern import (
    Bound,
    Bucket,
    Pattern,
    RuleKey,
    concat_fine,
    fine_runs,
    rule_key,
    state_or_equal,
    tile_of,
)
from kvbridge.plan.plan import Plan, Use
from kvbridge.plan.runs import Grid, Runs
from kvbridge.plan.tables import Tables, table, unchecked
from kvbridge.plan.tables import spans as tile_spans_of
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.topology.sources import sources


@dataclass(frozen=True, slots=True)
class GroupGeom:
    tile: int
    bp: int
    bd: int
    p_per_tile: int
    d_per_tile: int
    p_blocks: int
    d_blocks: int
    pool: int
    state: bool
    buckets: tuple[Bucket, ...]
    pad: tuple[int, int] | None = None
    """``(bs_P, bs_D)`` where partial blocks may move whole (``pad_blocks``), else None."""


@dataclass(frozen=True, slots=True)
class Checks:
    """How a source rank's links are told per request: by a gap count of their pool's
    keys (``fast``) or by comparing the keys of two tile sets (``slow``); ``one``: the
    group of its only link when that is a streak told by a count, else -1."""

    fast: tuple[Fast, ...]
    slow: tuple[Link, ...]
    one: int = -1


ALWAYS = Checks((), ())
"""The source rank's runs are merged on every request."""

Ids = Sequence[int] | np.ndarray
Job = tuple[int, Bucket, Pattern, int, int]
"""``(group, bucket, pattern, k_lo, k_hi)``: a pattern applied to tiles ``[k_lo, k_hi)``."""


@dataclass(frozen=True, slots=True)
class Side:
    """One instance of a pair: its spec, parallelism and ranks' :class:`Bound` by global
    rank (P: every rank; D: at least the geometry's ``d_rank``)."""

    spec: ModelSpec
    parallel: Parallel
    bounds: Sequence[Bound] | Mapping[int, Bound]


class Geometry:
    """Everything about one (P instance, D rank ``d_rank``) pair that does not depend on a
    request. Build it once at handshake; call :meth:`plan` per request.

    ``pad_blocks``: partial blocks may move whole where D's engine never reads their
    padding slots before writing them (``docs/planner.md``).
    """

    def __init__(self, p: Side, d: Side, d_rank: int, pad_blocks: bool = False) -> None:
        spec_p, spec_d, p_par, d_par = p.spec, d.spec, p.parallel, d.parallel
        if spec_p.compat_hash() != spec_d.compat_hash():
            raise IncompatibleError(
                f"P spec {spec_p.name!r} ({spec_p.compat_hash()}) and D spec "
                f"{spec_d.name!r} ({spec_d.compat_hash()}) store different bytes"
            )
        if len(p.bounds) != p_par.world:
            raise IncompatibleError(f"{len(p.bounds)} P layouts for P world {p_par.world}")
        try:
            d_bound = d.bounds[d_rank] if 0 <= d_rank < d_par.world else None
        except (KeyError, IndexError):
            d_bound = None
        if d_bound is None:
            raise IncompatibleError(f"D rank {d_rank} of world {d_par.world}: no layout for it")
        if isinstance(p.bounds, Mapping) and (lost := sorted({*range(p_par.world)} - {*p.bounds})):
            raise IncompatibleError(f"P rank {lost[0]} of world {p_par.world}: no layout for it")
        p_bound = [p.bounds[r] for r in range(p_par.world)]
        self.spec = spec_d
        self.d_rank = d_rank
        parts: dict[tuple[int, RuleKey, int], list[dict[str, np.ndarray]]] = {}
        for pc in sources(spec_p, p_par, d_par, d_rank):
            layer, g = spec_d.layers[pc.layer], spec_d.group_of(pc.layer)
            fine = fine_runs(pc, layer, p_bound[pc.src_rank], d_bound, *tile_of(spec_p, spec_d, g))
            parts.setdefault((g, rule_key(layer), pc.src_rank), []).append(fine)
        buckets: dict[int, list[Bucket]] = {}
        for (g, rule, src), fines in parts.items():
            single = state_or_equal(spec_p, spec_d, g)
            tile = tile_of(spec_p, spec_d, g)[0]
            buckets.setdefault(g, []).append(Bucket(g, src, rule, tile, single, concat_fine(fines)))
        groups = []
        for g in range(len(spec_d.groups)):
            (tile, bp, bd), state = tile_of(spec_p, spec_d, g), spec_d.is_state_group(g)
            pb = min(b.layout.num_blocks[g] for b in p_bound)
            nb, pool = d_bound.layout.num_blocks[g], d_bound.layout.pools[g]
            t, b1, d1 = (1, 1, 1) if state else (tile, bp, bd)  # a state group's tile: one slot
            pad = (bp, bd) if pad_blocks and not state else None
            bkts = tuple(buckets.get(g, ()))
            groups.append(GroupGeom(t, b1, d1, t // b1, t // d1, pb, nb, pool, state, bkts, pad))
        self.groups = tuple(groups)
        self.links = self._links()

    def divisor(self, src: int) -> int:
        """A number (bytes, > 0) dividing every source and destination address and every
        length of the runs :meth:`plan` can give source rank ``src``: the gcd of its tile
        patterns' offsets, block strides and lengths (a run starts at ``offset + id ·
        stride`` and joins whole runs). Copies take word widths from it, not from a scan."""
        cols = [
            b.fine[k]
            for gg in self.groups
            for b in gg.buckets
            if b.src_rank == src
            for k in ("soff", "sstr", "doff", "dstr", "length")
        ]
        if not cols:
            return 1
        return int(np.gcd.reduce(np.abs(np.concatenate(cols)))) or 1

    def _links(self) -> dict[int, RankLinks]:
        """Links per source rank, and how each is told per request (:mod:`.joins`)."""
        tiles = [gg.tile for gg in self.groups]
        p_blocks = np.array([gg.p_blocks for gg in self.groups], np.int64)
        d_blocks = np.array([gg.d_blocks for gg in self.groups], np.int64)
        by_rank: dict[int, list[Bucket]] = {}
        for gg in self.groups:
            for b in gg.buckets:
                by_rank.setdefault(b.src_rank, []).append(b)
        links = {r: rank_links(bs, tiles, p_blocks, d_blocks) for r, bs in by_rank.items()}
        big = {gg.pool for gg in self.groups if gg.d_blocks > PAIR_LIMIT or gg.p_blocks >= M // 2}
        values: dict[int, list[float]] = {}  # per paired pool; first 2³² + 1 (streaks)
        for ln in (ln for rl in links.values() for ln in rl.links):
            if _told_by_gap(ln, self.groups, big):
                vs = values.setdefault(self.groups[ln.g].pool, [FM + 1])
                vs += [] if FM + ln.dp * ln.dd in vs else [FM + ln.dp * ln.dd]
        self.values = {gg.pool: tuple(values.get(gg.pool, ())) for gg in self.groups}
        self.modes = [  # how each group's written D ids are keyed (:func:`.joins.written_keys`)
            (1 if gg.p_per_tile == gg.d_per_tile == 1 else 2) if gg.pool in values else 0
            for gg in self.groups
        ]
        self.per_tile = [(gg.p_per_tile, gg.d_per_tile) for gg in self.groups]
        self.limits = [gg.d_blocks for gg in self.groups]
        self.checks: dict[int, Checks | None] = {}
        for r, rl in links.items():
            fast, slow = [], []  # told by a gap count, else by comparing keys
            for ln in rl.links:
                if _told_by_gap(ln, self.groups, big):
                    pool = self.groups[ln.g].pool
                    fast.append(Fast(ln.g, pool, values[pool].index(FM + ln.dp * ln.dd), ln.streak))
                else:
                    slow.append(ln)
            f = fast[0] if len(fast) == 1 and not slow else None
            one = f.group if f is not None and f.value == 0 and f.streak else -1
            chk = Checks(tuple(fast), tuple(slow), one) if fast or slow else None
            self.checks[r] = ALWAYS if rl.always else chk
        return links

    def plan(
        self,
        n_tokens: int,
        p_tables: Sequence[Sequence[int] | np.ndarray] | Tables,
        d_tables: Sequence[Sequence[int] | np.ndarray] | Tables,
        cached: int = 0,
    ) -> Plan:
        """The fewest runs per source rank for one request of ``n_tokens`` prefilled
        tokens, ``cached`` already on D. ``p_tables[g]`` / ``d_tables[g]``: block ids of group
        ``g`` covering tokens ``[0, n_tokens)`` (state groups: one slot id); ``Tables`` are
        not checked again. Raises :class:`PlanError`."""
        if n_tokens < 1 or not 0 <= cached <= n_tokens:
            raise PlanError(f"n_tokens={n_tokens}, cached={cached}: need 0 ≤ cached ≤ n, n ≥ 1")
        if len(p_tables) != len(self.groups) or len(d_tables) != len(self.groups):
            n_p, n_d, n_g = len(p_tables), len(d_tables), len(self.groups)
            raise PlanError(f"{n_p} P and {n_d} D block tables for {n_g} groups")
        if len(self.groups) == 1:
            lim = unchecked(p_tables, 0, self.groups[0].p_blocks)
            return self._plan_one(n_tokens, p_tables[0], d_tables[0], cached, lim)
        uses: list[Use] = []
        jobs: dict[int, list[Job]] = {}
        tabs: dict[int, Tab] = {}
        written: dict[int, list[int]] = {}
        for g, gg in enumerate(self.groups):
            lim = unchecked(p_tables, g, gg.p_blocks)
            ptab = table(p_tables[g], lim, n_tokens, gg.bp, gg.p_per_tile, gg.state, "P", g)
            dtab = table(d_tables[g], 0, n_tokens, gg.bd, gg.d_per_tile, gg.state, "D", g)
            first = _jobs(gg, g, n_tokens, cached, jobs, uses)
            if first < n_tokens:
                tabs[g] = _tab(gg, ptab, dtab, first, n_tokens)
                written.setdefault(gg.pool, []).append(g)
        keys = {}
        for pool, gs in written.items():
            limit = min(self.limits[g] for g in gs)
            keys[pool] = check_written(pool, gs, tabs, self.modes, limit, self.values[pool])
        runs = {src: self._rank(src, js, tabs, keys) for src, js in jobs.items()}
        return Plan(runs, uses)

    def _plan_one(self, n: int, p_ids: Ids, d_ids: Ids, cached: int, lim: int) -> Plan:
        """:meth:`plan` for one group (a dense model): the same steps, less bookkeeping."""
        gg = self.groups[0]
        ptab = table(p_ids, lim, n, gg.bp, gg.p_per_tile, gg.state, "P", 0)
        dtab = table(d_ids, 0, n, gg.bd, gg.d_per_tile, gg.state, "D", 0)
        jobs: dict[int, list[Job]] = {}
        uses: list[Use] = []
        first = _jobs(gg, 0, n, cached, jobs, uses)
        if first >= n:
            return Plan({}, uses)
        tab = _tab(gg, ptab, dtab, first, n)
        tabs = {0: tab}
        w = check_written(gg.pool, [0], tabs, self.modes, gg.d_blocks, self.values[gg.pool])
        if len(jobs) == 1:
            ((src, js),) = jobs.items()
            chk = self.checks[src]
            if len(js) == 1 and (chk is None or (chk.one >= 0 and not (w and w[2][0]))):
                # as they come: nothing can or does continue
                return Plan({src: _as_they_come(js, tabs, self.groups)}, uses)
        keys = {gg.pool: w}
        return Plan({src: self._rank(src, js, tabs, keys) for src, js in jobs.items()}, uses)

    def _rank(
        self, src: int, jobs: list[Job], tabs: dict[int, Tab], keys: dict[int, Keys | None]
    ) -> Runs:
        """One source rank's runs: as they come where nothing can continue or nothing
        this request's ids realize (the usual case), else :meth:`_joined`."""
        chk = self.checks[src]
        if chk is not None:
            one = chk.one  # its only link, a streak told by a count, or -1
            if one < 0 or (one in tabs and (w := keys[chk.fast[0].pool]) is not None and w[2][0]):
                return self._joined(chk, jobs, tabs, keys)
        return _as_they_come(jobs, tabs, self.groups)

    def _joined(
        self, chk: Checks, jobs: list[Job], tabs: dict[int, Tab], keys: dict[int, Keys | None]
    ) -> Runs:
        """One source rank's runs, merged where the request's ids realize a link."""
        if chk is ALWAYS:
            return merge_all(*_applied(jobs, tabs, self.groups))
        if chk.one >= 0:  # its only link, a streak, is realized
            streak, other = {chk.one}, False
        else:
            streak, other = realize(chk.fast, chk.slow, keys, tabs, self.per_tile)
        if not streak:
            out = _applied(jobs, tabs, self.groups)
            return merge_all(*out) if other else Runs(*out)
        parts = []
        for g, _, pat, k_lo, k_hi in jobs:
            w = keys[self.groups[g].pool]
            found = _chains(w, g, tabs[g], k_lo, k_hi) if g in streak and pat.streakable else None
            if found is None:
                parts.append(_apply(pat, tabs[g], k_lo, k_hi, self.groups[g]))
            else:
                parts.append(streak_runs(pat, *found))
        out = parts[0] if len(parts) == 1 else _concat(parts)
        if other or not _sole(jobs, streak):
            return merge_all(*out)
        return Runs(*out)


def _tab(gg: GroupGeom, ptab: np.ndarray, dtab: np.ndarray, first: int, n: int) -> Tab:
    if gg.state:
        return (ptab, dtab, 0, 0, 1)
    return (ptab, dtab, first // gg.tile, first // gg.bd, -(-n // gg.bd))


def _told_by_gap(ln: Link, groups: Sequence[GroupGeom], big: set[int]) -> bool:
    """A link that a key gap of its pool tells (:func:`.joins.check_written`): both groups
    one block per side and tile, in one pool, ``dd = ±1``. Between two groups the gap may
    be two tiles of one: then the rank is merged for nothing, never wrongly."""
    g, h = groups[ln.g], groups[ln.h]
    single = g.p_per_tile == g.d_per_tile == h.p_per_tile == h.d_per_tile == 1 and g.pool == h.pool
    return single and ln.dd in (1, -1) and g.pool not in big


def _applied(jobs: list[Job], tabs: dict[int, Tab], groups: Sequence[GroupGeom]) -> Triple:
    if len(jobs) == 1:
        g, _, pat, k_lo, k_hi = jobs[0]
        return _apply(pat, tabs[g], k_lo, k_hi, groups[g])
    return _concat([_apply(p, tabs[g], lo, hi, groups[g]) for g, _, p, lo, hi in jobs])


def _chains(
    w: Keys | None, g: int, tab: Tab, k_lo: int, k_hi: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Chains of a job's tiles (one block per side): from its pool's sorted keys where
    they are the job's, else sorted here."""
    if w is not None and w[1] == [g] and tab[3] == k_lo and tab[4] == k_hi:
        return chains(w[0], w[3])
    srt = tab[1][k_lo:k_hi] * FM
    srt += tab[0][k_lo:k_hi]
    srt.sort()
    return chains(srt)


def _concat(parts: list[Triple]) -> Triple:
    src, dst, length = zip(*parts, strict=True)
    return np.concatenate(src), np.concatenate(dst), np.concatenate(length)


def _sole(jobs: list[Job], streak: set[int]) -> bool:
    """Streak joins alone merge everything realized: every job of a streak group is
    streakable, the only one of its bucket."""
    mine = [(b, pat) for g, b, pat, _, _ in jobs if g in streak]
    return all(pat.streakable for _, pat in mine) and len({id(b) for b, _ in mine}) == len(mine)


def _jobs(
    gg: GroupGeom, g: int, n: int, cached: int, jobs: dict[int, list[Job]], uses: list[Use]
) -> int:
    """Add group ``g``'s jobs (per source rank) and uses; return its first needed token
    (``n`` if none)."""
    first = n
    for b in gg.buckets:
        spans = tile_spans_of(b.rule, n, cached, gg.tile)
        if not spans:
            continue
        if gg.pad is not None:
            padded = tile_spans_of(b.rule, n, cached, gg.tile, gg.pad)
            spans = padded if _count(b, padded) <= _count(b, spans) else spans
        first = spans[0][4] if spans[0][4] < first else first
        out = jobs.setdefault(b.src_rank, [])
        for k_lo, k_hi, s, t, _ in spans:
            pat = b.pattern(s, t)
            out.append((g, b, pat, k_lo, k_hi))
            uses.append((b.src_rank, pat, k_hi - k_lo))
    return first


def _count(b: Bucket, spans: tuple[tuple[int, ...], ...]) -> int:
    """Runs ``spans`` take before any merge (pattern runs × tiles)."""
    return sum(b.pattern(s, t).length.shape[0] * (hi - lo) for lo, hi, s, t, _ in spans)


def _as_they_come(jobs: list[Job], tabs: dict[int, Tab], groups: Sequence[GroupGeom]) -> Runs:
    """One source rank's runs, nothing merged: a :class:`Grid` per job (expanded only if
    a mover asks) where every job has one block per side and tile and one stride per
    side, else applied."""
    grids = []
    for g, _, pat, k_lo, k_hi in jobs:
        gg, tab = groups[g], tabs[g]
        if not (gg.p_per_tile == 1 and gg.d_per_tile == 1 and pat.sstride and pat.dstride):
            return Runs(*_applied(jobs, tabs, groups))
        pid, did = tab[0][k_lo:k_hi], tab[1][k_lo:k_hi]
        grids.append(Grid(pat.soff, pat.doff, pat.length, pat.sstride, pat.dstride, pid, did))
    return Runs.of(*grids)


def _apply(pat: Pattern, tab: Tab, k_lo: int, k_hi: int, gg: GroupGeom) -> Triple:
    """Addresses of ``pat`` over tiles ``[k_lo, k_hi)``, ordered (run, tile)."""
    pt, dt = gg.p_per_tile, gg.d_per_tile  # blocks per tile
    if pt == 1 and dt == 1:
        pid, did = tab[0][k_lo:k_hi], tab[1][k_lo:k_hi]
        if pat.sstride and pat.dstride:  # one stride per side: ``off + id · stride``
            src = pat.soff_c + pid * pat.sstride
            return src.ravel(), (pat.doff_c + did * pat.dstride).ravel(), pat.lengths(k_hi - k_lo)
    else:
        pid = tab[0][k_lo * pt : k_hi * pt].reshape(-1, pt)[:, pat.p_bit].T
        did = tab[1][k_lo * dt : k_hi * dt].reshape(-1, dt)[:, pat.d_bit].T
    src = addresses(pat.soff_c, pid, pat.sstride, pat.sstr_c)
    dst = addresses(pat.doff_c, did, pat.dstride, pat.dstr_c)
    return src, dst, pat.lengths(k_hi - k_lo)
