"""A vLLM-like read path, written from the description of vLLM's NixlConnector (no code
of vLLM's): descriptors per (block, piece) of every registered region, prepared once
at the handshake with ``prep_xfer_dlist``; a request posts ``make_prepped_xfer`` with
index lists into them, one transfer per P rank, whole blocks.

A piece is a contiguous run of what this D rank needs inside one block: one per
(layer, block) for per-layer layouts without a head split or with HND (K and V of a
head slice adjacent here), one per block for block-major, one per (layer, token) for
NHD under a head split (which vLLM itself refuses). The pieces are kvbridge's own tile
pattern for one block (``Bucket.pattern(0, tile)``), never joined across blocks: NIXL's
``make_prepped_xfer`` joins descriptors that continue each other on both sides itself.

    D list (local):  index(run k, block b) = base + k · d_blocks + b
    P list (remote): index(run k, block b) = base + k · p_blocks + b
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.nixl_prepped import prep
from kvbridge.errors import PlanError
from kvbridge.plan import Geometry
from kvbridge.transport.nixl import NixlTransport

MAX_ROWS = 4_000_000
"""Largest prepared list per side (rows); more is refused (memory, handshake time)."""


@dataclass(frozen=True, slots=True)
class _Part:
    """One bucket's block pattern: ``runs`` runs of ``length`` bytes per block."""

    group: int
    state: bool
    block_tokens: int
    length: np.ndarray
    l_base: int
    r_base: int
    d_blocks: int
    p_blocks: int


def _grid(off: np.ndarray, stride: np.ndarray, blocks: int) -> np.ndarray:
    """``off[k] + b · stride[k]`` for every (run k, block b), run-major."""
    return (off[:, None] + np.arange(blocks, dtype=np.int64)[None, :] * stride[:, None]).ravel()


class VllmLike:
    """The prepared lists per source rank (``lists[src] = (D list, P list)``) and the
    index arithmetic per request. Equal block sizes on both sides only."""

    def __init__(self, geom: Geometry, transport: NixlTransport, agents: dict[int, str]):
        self.parts: dict[int, list[_Part]] = {}
        cols: dict[int, list[list[np.ndarray]]] = {}
        for g, gg in enumerate(geom.groups):
            if gg.p_per_tile != 1 or gg.d_per_tile != 1:
                raise PlanError(f"group {g}: the vLLM-like path needs equal block sizes")
            for bucket in gg.buckets:
                pat = bucket.pattern(0, gg.tile)
                c = cols.setdefault(bucket.src_rank, [[], [], [], []])
                l_base, r_base = sum(map(len, c[0])), sum(map(len, c[2]))
                c[0].append(_grid(pat.doff, pat.dstr, gg.d_blocks))
                c[1].append(np.repeat(pat.length, gg.d_blocks))
                c[2].append(_grid(pat.soff, pat.sstr, gg.p_blocks))
                c[3].append(np.repeat(pat.length, gg.p_blocks))
                part = _Part(
                    g, gg.state, gg.bd, pat.length, l_base, r_base, gg.d_blocks, gg.p_blocks
                )
                self.parts.setdefault(bucket.src_rank, []).append(part)
        self.addrs = {src: [np.concatenate(x) for x in c] for src, c in cols.items()}
        rows = max(a[0].shape[0] + a[2].shape[0] for a in self.addrs.values())
        if rows > 2 * MAX_ROWS:
            raise PlanError(f"the vLLM-like lists would hold {rows} rows (limit {MAX_ROWS})")
        self.lists: dict[int, tuple[Any, Any]] = {}
        for src, (la, ll, ra, rl) in self.addrs.items():
            local = prep(transport, "", _rows(la, ll))
            self.lists[src] = (local, prep(transport, agents[src], _rows(ra, rl)))

    def indices(
        self, p_tables: list[np.ndarray], d_tables: list[np.ndarray], n_tokens: int
    ) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
        """Per source rank: (D indices, P indices) as int32 and the bytes they move."""
        out = {}
        for src, parts in self.parts.items():
            li, ri, nbytes = [], [], 0
            for pt in parts:
                nb = 1 if pt.state else -(-n_tokens // pt.block_tokens)
                k = np.arange(pt.length.shape[0], dtype=np.int64)[:, None]
                li.append((pt.l_base + k * pt.d_blocks + d_tables[pt.group][:nb]).ravel())
                ri.append((pt.r_base + k * pt.p_blocks + p_tables[pt.group][:nb]).ravel())
                nbytes += int(pt.length.sum()) * nb
            out[src] = (
                np.concatenate(li).astype(np.int32),
                np.concatenate(ri).astype(np.int32),
                nbytes,
            )
        return out

    def merged(self, src: int, li: np.ndarray, ri: np.ndarray) -> int:
        """Descriptors left once those continuing the previous one on both sides join
        (what NIXL's ``make_prepped_xfer`` does with them)."""
        la, ll, ra, _ = self.addrs[src]
        dl, dr, ln = la[li], ra[ri], ll[li]
        cont = (dl[:-1] + ln[:-1] == dl[1:]) & (dr[:-1] + ln[:-1] == dr[1:])
        return int(li.shape[0] - np.count_nonzero(cont))


def _rows(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    out = np.zeros((addr.shape[0], 3), np.uint64)
    out[:, 0], out[:, 1] = addr, length
    return out
