"""The vLLM-like path: one NIXL descriptor per block × layer × K/V, prepared once per
pair of ranks (``prep_xfer_dlist``), a request posted as index lists
(``make_prepped_xfer``), READ by D or WRITE by P, with raw NIXL agents of ``threads`` UCX
worker threads (vLLM's ``num_threads``). Written from the description of vLLM's
NixlConnector, no code of vLLM's.

A descriptor is what one source rank holds of one (layer, stream) in one block pair,
contiguous on both sides: K of a block in NHD, V likewise. Where K and V of a head slice
interleave inside a block (the ``hnd`` layout: ``[heads][K|V][tokens][dim]``, vLLM's CPU
cache), vLLM registers one region per layer and posts one descriptor per block × layer:
so does this path. A pairing where neither is contiguous (NHD under a head split) is one
vLLM refuses: :class:`Refused`. Block sizes may differ (a tile of ``lcm(bs_P, bs_D)``
tokens: a descriptor per smaller block). Lists are run-major, as vLLM's are per region::

    P list: index(run j, P block b) = p_base[j] + b      (p_base[j] = j-th run's offset)
    D list: index(run j, D block b) = d_base[j] + b
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import PlanError
from kvbridge.layout.view import RankLayout
from kvbridge.plan.pattern import (
    Bound,
    Bucket,
    concat_fine,
    fine_runs,
    rule_key,
    state_or_equal,
    tile_of,
)
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.topology.sources import sources


class Refused(PlanError):
    """vLLM would not read this pairing (why in the message)."""


@dataclass(frozen=True, slots=True)
class GroupRuns:
    """One spec group's descriptor runs for one (P rank, D rank) pair: per run ``j`` the
    P block in the tile it lies in (``p_bit``), its address in P block 0 (``soff``) and P's
    block stride (``sstr``); the same for D; its length (bytes)."""

    group: int
    state: bool
    tile: int
    p_per_tile: int
    d_per_tile: int
    p_blocks: int
    d_blocks: int
    p_bit: np.ndarray
    soff: np.ndarray
    sstr: np.ndarray
    d_bit: np.ndarray
    doff: np.ndarray
    dstr: np.ndarray
    length: np.ndarray


Key = tuple[int, int, str, int]
"""``(group, layer, stream, source rank)``; stream "" once K and V are joined."""


def _fine(
    specs: tuple[ModelSpec, ModelSpec],
    pars: tuple[Parallel, Parallel],
    p_bounds: Sequence[Bound],
    d_bound: Bound,
    d_rank: int,
) -> dict[Key, list[dict[str, np.ndarray]]]:
    """kvbridge's fine runs (one unit × token of a tile each) per (group, layer, stream, src)."""
    sp, sd = specs
    out: dict[Key, list[dict[str, np.ndarray]]] = {}
    for pc in sources(sp, pars[0], pars[1], d_rank):
        g = sd.group_of(pc.layer)
        tile, bp, bd = tile_of(sp, sd, g)
        fine = fine_runs(pc, sd.layers[pc.layer], p_bounds[pc.src_rank], d_bound, tile, bp, bd)
        out.setdefault((g, pc.layer, pc.stream, pc.src_rank), []).append(fine)
    return out


def _descriptors(
    specs: tuple[ModelSpec, ModelSpec], fine: dict[Key, list[dict[str, np.ndarray]]]
) -> dict[Key, np.ndarray] | None:
    """Per key, the tile's runs as rows ``(p_bit, soff, sstr, d_bit, doff, dstr, length)``,
    or None if some key's bytes are not one run per block pair."""
    sp, sd = specs
    out = {}
    for key, parts in fine.items():
        g, layer = key[0], key[1]
        tile = tile_of(sp, sd, g)[0]
        rule = rule_key(sd.layers[layer])
        pat = Bucket(g, key[3], rule, tile, state_or_equal(sp, sd, g), concat_fine(parts))
        pat_runs = pat.pattern(0, tile)
        pairs = set(zip(pat_runs.p_bit.tolist(), pat_runs.d_bit.tolist(), strict=True))
        if len(pairs) != pat_runs.length.shape[0]:
            return None
        out[key] = np.stack(
            [
                pat_runs.p_bit,
                pat_runs.soff,
                pat_runs.sstr,
                pat_runs.d_bit,
                pat_runs.doff,
                pat_runs.dstr,
                pat_runs.length,
            ],
            axis=1,
        )
    return out


def pair_runs(
    specs: tuple[ModelSpec, ModelSpec],
    pars: tuple[Parallel, Parallel],
    p_bounds: Sequence[Bound],
    d_bound: Bound,
    d_rank: int,
) -> dict[int, list[GroupRuns]]:
    """Per source rank, the descriptor runs of D rank ``d_rank``'s pairing (per group);
    :class:`Refused` where vLLM would not read it."""
    fine = _fine(specs, pars, p_bounds, d_bound, d_rank)
    rows = _descriptors(specs, fine)
    if rows is None:  # K and V interleave per head: one descriptor per block × layer
        joined: dict[Key, list[dict[str, np.ndarray]]] = {}
        for (g, layer, _, src), parts in fine.items():
            joined.setdefault((g, layer, "", src), []).extend(parts)
        rows = _descriptors(specs, joined)
    if rows is None:
        raise Refused(
            "a block's bytes for this D rank are not contiguous per layer (vLLM "
            "needs HND under a head split)"
        )
    return _by_source(specs, rows, p_bounds[0].layout, d_bound.layout)


def _by_source(
    specs: tuple[ModelSpec, ModelSpec],
    rows: dict[Key, np.ndarray],
    p_layout: RankLayout,
    d_layout: RankLayout,
) -> dict[int, list[GroupRuns]]:
    sp, sd = specs
    out: dict[int, list[GroupRuns]] = {}
    for src in sorted({k[3] for k in rows}):
        for g in range(len(sd.groups)):
            keys = sorted(k for k in rows if k[3] == src and k[0] == g)
            if not keys:
                continue
            r = np.concatenate([rows[k] for k in keys]).astype(np.int64)
            tile, bp, bd = tile_of(sp, sd, g)
            state = sd.is_state_group(g)
            pb, db = p_layout.num_blocks[g], d_layout.num_blocks[g]
            per_p, per_d = (1, 1) if state else (tile // bp, tile // bd)
            out.setdefault(src, []).append(
                GroupRuns(g, state, 1 if state else tile, per_p, per_d, pb, db, *r.T)
            )
    return out


def list_rows(groups: list[GroupRuns], side: str, device: int) -> np.ndarray:
    """The prepared list of one side (``"P"`` or ``"D"``): ``(addr, len, device)`` uint64
    rows, run-major (every block of run 0, then run 1, ...)."""
    parts = []
    for gr in groups:
        off, stride, n = (
            (gr.soff, gr.sstr, gr.p_blocks) if side == "P" else (gr.doff, gr.dstr, gr.d_blocks)
        )
        addr = off[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride[:, None]
        block = np.empty((addr.size, 3), np.uint64)
        block[:, 0], block[:, 1], block[:, 2] = addr.ravel(), np.repeat(gr.length, n), device
        parts.append(block)
    return np.concatenate(parts)


def indices(
    groups: list[GroupRuns], p_tables: Sequence[np.ndarray], d_tables: Sequence[np.ndarray], n: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(P indices, D indices, bytes)`` of a request of ``n`` tokens: every run of every
    block pair the request holds on both sides (whole blocks, as vLLM moves them)."""
    p_idx, d_idx, nbytes = [], [], 0
    p_base = d_base = 0
    for gr in groups:
        ptab, dtab = np.asarray(p_tables[gr.group]), np.asarray(d_tables[gr.group])
        tiles = np.arange(1 if gr.state else -(-n // gr.tile), dtype=np.int64)[None, :]
        pb = tiles * gr.p_per_tile + gr.p_bit[:, None]
        db = tiles * gr.d_per_tile + gr.d_bit[:, None]
        ok = (pb < ptab.shape[0]) & (db < dtab.shape[0])
        runs = np.arange(gr.length.shape[0], dtype=np.int64)[:, None]
        pi = p_base + runs * gr.p_blocks + ptab[np.minimum(pb, ptab.shape[0] - 1)]
        di = d_base + runs * gr.d_blocks + dtab[np.minimum(db, dtab.shape[0] - 1)]
        p_idx.append(pi[ok])
        d_idx.append(di[ok])
        nbytes += int((ok * gr.length[:, None]).sum())
        p_base += gr.length.shape[0] * gr.p_blocks
        d_base += gr.length.shape[0] * gr.d_blocks
    return np.concatenate(p_idx).astype(np.int32), np.concatenate(d_idx).astype(np.int32), nbytes
