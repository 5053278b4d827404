"""Tile patterns: the byte runs of one tile (``lcm(bs_P, bs_D)`` tokens; a state group's:
one slot), computed once per pair; layers with one needed-range rule share a bucket per
source rank (``docs/planner.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvbridge.layout.view import RankLayout, View
from kvbridge.spec.model import Kind, Layer, ModelSpec
from kvbridge.topology.sources import Piece

FIELDS = ("token", "p_bit", "soff", "sstr", "d_bit", "doff", "dstr", "length", "kind")
KIND_CODES = tuple(Kind)


@dataclass(frozen=True, slots=True)
class Bound:
    """A rank's layout with the address of each of its regions."""

    layout: RankLayout
    bases: tuple[int, ...]

    def base(self, v: View) -> int:
        return self.bases[v.region] + v.offset


@dataclass(slots=True)
class Pattern:
    """Coalesced runs of one tile restricted to token range ``[s, e)``; arrays of length R."""

    p_bit: np.ndarray
    """Per run: which of the tile's P blocks it lies in (0 … P blocks per tile − 1)."""
    soff: np.ndarray
    """Source address of the run in P block id 0 (region base + offsets)."""
    sstr: np.ndarray
    """P block stride of the run's view: its address is ``soff + id · sstr``."""
    d_bit: np.ndarray
    doff: np.ndarray
    dstr: np.ndarray
    """The same three on D's side."""
    length: np.ndarray
    nbytes: int
    kind_bytes: dict[Kind, int]
    streakable: bool = False
    """Every run fills its whole block stride on both sides, one block per side and
    tile: runs of consecutive tiles with consecutive ids on both sides join."""
    soff_c: np.ndarray = field(init=False, repr=False)
    """``*_c``: the arrays above as columns (shape ``(R, 1)``), to broadcast over tiles."""
    sstr_c: np.ndarray = field(init=False, repr=False)
    doff_c: np.ndarray = field(init=False, repr=False)
    dstr_c: np.ndarray = field(init=False, repr=False)
    len_c: np.ndarray = field(init=False, repr=False)
    sstride: int = field(init=False)
    """The block stride shared by every run on the P side, or 0 if they differ."""
    dstride: int = field(init=False)

    _lengths: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def lengths(self, tiles: int) -> np.ndarray:
        """Run lengths over ``tiles`` tiles, run-major; cached and read-only."""
        out = self._lengths.get(tiles)
        if out is None:
            out = np.repeat(self.length, tiles)
            out.flags.writeable = False
            if len(self._lengths) < 4096:
                self._lengths[tiles] = out
        return out

    def __post_init__(self) -> None:
        us, ud = np.unique(self.sstr), np.unique(self.dstr)
        self.sstride = int(us[0]) if us.shape[0] == 1 else 0
        self.dstride = int(ud[0]) if ud.shape[0] == 1 else 0
        self.soff_c, self.sstr_c = self.soff[:, None], self.sstr[:, None]
        self.doff_c, self.dstr_c = self.doff[:, None], self.dstr[:, None]
        self.len_c = self.length[:, None]


@dataclass
class Bucket:
    """Layers of one group with the same needed-range rule, served by one source rank."""

    group: int
    src_rank: int
    rule: RuleKey
    tile: int
    single: bool
    """One block per side per tile."""
    fine: dict[str, np.ndarray]
    _patterns: dict[tuple[int, int], Pattern] = field(default_factory=dict)

    def pattern(self, s: int, e: int) -> Pattern:
        """Runs for tokens ``[s, e)`` of the tile, coalesced; memoised per range."""
        pat = self._patterns.get((s, e))
        if pat is None:
            pat = self._patterns[(s, e)] = _coalesce(self.fine, s, e, self.single)
        return pat


RuleKey = tuple[str, int, int]
"""``(kind, window, chunk)``: what a layer's needed token range depends on."""


def rule_key(layer: Layer) -> RuleKey:
    """Layers with equal keys need the same token range (full and MLA share one)."""
    if layer.kind in (Kind.FULL, Kind.MLA):
        return (str(Kind.FULL), 0, 0)
    return (str(layer.kind), layer.window, layer.chunk)


def tile_of(spec_p: ModelSpec, spec_d: ModelSpec, g: int) -> tuple[int, int, int]:
    """``(tile tokens, bs_P, bs_D)`` of group ``g``."""
    bp, bd = spec_p.groups[g].block_size, spec_d.groups[g].block_size
    return (math.lcm(bp, bd), bp, bd)


def state_or_equal(spec_p: ModelSpec, spec_d: ModelSpec, g: int) -> bool:
    """True when a tile holds one block on each side."""
    return spec_d.is_state_group(g) or (spec_p.groups[g].block_size == spec_d.groups[g].block_size)


def fine_runs(
    piece: Piece, layer: Layer, src: Bound, dst: Bound, tile: int, bp: int, bd: int
) -> dict[str, np.ndarray]:
    """Runs of one piece over one tile, one unit per run (coalesced later)."""
    sv = src.layout.view(piece.layer, piece.stream)
    dv = dst.layout.view(piece.layer, piece.stream)
    seg = piece.segment
    if layer.kind is Kind.STATE:
        rows = np.arange(sv.rows, dtype=np.int64)
        token = np.zeros_like(rows)
        srow, drow, p_bit, d_bit = rows, rows, token, token
    else:
        token = np.arange(tile, dtype=np.int64)
        srow, p_bit = token % bp, token // bp
        drow, d_bit = token % bd, token // bd
    units = np.arange(piece.start, piece.stop, dtype=np.int64)
    su = units - sv.seg_units[seg][0]
    du = units - dv.seg_units[seg][0]
    soff = src.base(sv) + sv.seg_offsets[seg] + srow * sv.row_strides[seg]
    doff = dst.base(dv) + dv.seg_offsets[seg] + drow * dv.row_strides[seg]
    soff = (soff[:, None] + su[None, :] * sv.unit_strides[seg]).ravel()
    doff = (doff[:, None] + du[None, :] * dv.unit_strides[seg]).ravel()
    sadd, dadd, part = _part_offsets(sv, dv, seg)
    soff = (soff[:, None] + sadd[None, :]).ravel()
    doff = (doff[:, None] + dadd[None, :]).ravel()
    n = soff.shape[0]
    reps = units.shape[0] * sadd.shape[0]
    return {
        "token": np.repeat(token, reps),
        "p_bit": np.repeat(p_bit, reps),
        "soff": soff,
        "sstr": np.full(n, sv.block_stride, np.int64),
        "d_bit": np.repeat(d_bit, reps),
        "doff": doff,
        "dstr": np.full(n, dv.block_stride, np.int64),
        "length": np.full(n, part, np.int64),
        "kind": np.full(n, KIND_CODES.index(layer.kind), np.int64),
    }


def _part_offsets(sv: View, dv: View, seg: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Offsets within a unit of the parts both sides keep contiguous, and their size: a
    unit split in parts on one side (say ``[head_dim][tokens]``) and whole on the other is
    copied in parts of the finer split (runs continuing on both sides join later)."""
    _, ps, pstr = sv.piece(seg)
    _, pd, dstr = dv.piece(seg)
    part = math.gcd(ps, pd)
    k = np.arange(0, sv.unit_bytes[seg], part, dtype=np.int64)
    return (k // ps) * pstr + k % ps, (k // pd) * dstr + k % pd, part


def concat_fine(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate fine runs and coalesce within each token (keeps the token column)."""
    fine = {k: np.concatenate([p[k] for p in parts]) for k in FIELDS}
    return _merge(fine, same=("token", "p_bit", "d_bit", "sstr", "dstr", "kind"))


def _merge(f: dict[str, np.ndarray], same: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Runs sorted by (P bit, D bit, strides, source), each merged into its predecessor
    where both sides continue it and the ``same`` columns agree."""
    order = np.lexsort((f["soff"], f["sstr"], f["dstr"], f["d_bit"], f["p_bit"]))
    f = {k: v[order] for k, v in f.items()}
    n = f["soff"].shape[0]
    if n <= 1:
        return f
    ln = f["length"]
    cont = (f["soff"][:-1] + ln[:-1] == f["soff"][1:]) & (f["doff"][:-1] + ln[:-1] == f["doff"][1:])
    for k in same:
        cont &= f[k][:-1] == f[k][1:]
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    out = {k: v[starts] for k, v in f.items()}
    out["length"] = np.add.reduceat(ln, starts)
    return out


def _coalesce(fine: dict[str, np.ndarray], s: int, e: int, single: bool) -> Pattern:
    sel = (fine["token"] >= s) & (fine["token"] < e)
    f = {k: v[sel] for k, v in fine.items()}
    kind_bytes = {
        KIND_CODES[c]: int(f["length"][f["kind"] == c].sum()) for c in np.unique(f["kind"])
    }
    m = _merge(f, same=("p_bit", "d_bit", "sstr", "dstr"))
    ln = m["length"]
    streak = bool((m["p_bit"] == 0).all() and (m["d_bit"] == 0).all() and single)
    streak = streak and bool(((ln == m["sstr"]) & (ln == m["dstr"])).all())
    arrays = (m["p_bit"], m["soff"], m["sstr"], m["d_bit"], m["doff"], m["dstr"], ln)
    return Pattern(*arrays, int(ln.sum()), kind_bytes, streak)
