"""Request-specific byte patterns: P writes them into a request's blocks through its
layout's views, D compares every byte it received with the same formula.

A word (``w`` bytes: the largest of 8, 4, 2, 1 dividing every unit, stride and offset)
of layer ``L``, stream ``s``, segment ``g``, token (state: row) ``t``, global unit
``u`` (a KV head, a channel group) and word ``k`` of that unit holds

    seed·C0 + L·C1 + crc32(s)·C2 + g·C3 + t·C4 + u·C5 + k·C6      (mod 2^64, low w bytes)

so a byte from the wrong block, rank, head or token, or one left over from an earlier
transfer (every transfer gets a new seed), is a mismatch. Only P's and D's own views are
used: the check does not trust the planner it checks.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from kvbridge.layout.view import RankLayout, View
from kvbridge.spec.model import ModelSpec

_C = tuple(
    np.uint64(c)
    for c in (
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
        0x2545F4914F6CDD1D,
    )
)


def word_bytes(layouts: Sequence[RankLayout]) -> int:
    """The largest word size (8, 4, 2, 1 bytes) that divides every unit and stride."""
    sizes = [
        x
        for lay in layouts
        for v in lay.views
        for x in (v.offset, v.block_stride, *v.seg_offsets, *v.row_strides, *v.unit_strides)
    ]
    sizes += [x for lay in layouts for v in lay.views for x in v.unit_bytes]
    return next(w for w in (8, 4, 2, 1) if all(x % w == 0 for x in sizes))


def _dtype(w: int) -> np.dtype:
    return np.dtype(f"<u{w}") if w > 1 else np.dtype(np.uint8)


def strided(region: np.ndarray, v: View, seg: int, w: int) -> np.ndarray:
    """Segment ``seg`` of view ``v`` in ``region`` (uint8, the whole region) as a
    writable ``(blocks, rows, local units, words)`` array of ``w``-byte words."""
    if v.pieces:
        raise ValueError(f"view {v.layer}/{v.stream}: split units are not supported here")
    a, b = v.seg_units[seg]
    start = v.offset + v.seg_offsets[seg]
    tail = region[start : start + (region.shape[0] - start) // w * w].view(_dtype(w))
    shape = (v.blocks, v.rows, b - a, v.unit_bytes[seg] // w)
    strides = (v.block_stride, v.row_strides[seg], v.unit_strides[seg], w)
    return np.lib.stride_tricks.as_strided(tail, shape, strides, writeable=True)


def expected(seed: int, v: View, seg: int, blocks: int, w: int) -> np.ndarray:
    """The pattern of ``blocks`` consecutive table entries of ``v``'s segment ``seg``
    (token ``t = entry · rows + row``), shaped as :func:`strided` gives them."""
    a, b = v.seg_units[seg]
    with np.errstate(over="ignore"):
        base = (
            np.uint64(seed) * _C[0]
            + np.uint64(v.layer) * _C[1]
            + np.uint64(zlib.crc32(v.stream.encode())) * _C[2]
            + np.uint64(seg) * _C[3]
        )
        tok = np.arange(blocks * v.rows, dtype=np.uint64).reshape(blocks, v.rows, 1, 1)
        unit = np.arange(a, b, dtype=np.uint64).reshape(1, 1, -1, 1)
        word = np.arange(v.unit_bytes[seg] // w, dtype=np.uint64).reshape(1, 1, 1, -1)
        val = (tok * _C[4] + base) + (unit * _C[5] + word * _C[6])
    return val.astype(_dtype(w), copy=False)


def _tables_by_view(
    spec: ModelSpec, layout: RankLayout, tables: Sequence[np.ndarray]
) -> list[tuple[View, np.ndarray, bool]]:
    """Each view with its group's block table and whether it holds state."""
    out = []
    for v in layout.views:
        g = spec.group_of(v.layer)
        out.append((v, np.asarray(tables[g], np.int64), spec.is_state_group(g)))
    return out


def fill(
    spec: ModelSpec,
    layout: RankLayout,
    regions: Sequence[np.ndarray],
    tables: Sequence[np.ndarray],
    seed: int,
    w: int,
) -> None:
    """Write the pattern of ``seed`` into the blocks of ``tables`` (ids per spec group;
    state groups: one slot), whole blocks, through every view of ``layout``."""
    for v, ids, _ in _tables_by_view(spec, layout, tables):
        for seg in range(len(v.seg_units)):
            strided(regions[v.region], v, seg, w)[ids] = expected(seed, v, seg, ids.shape[0], w)


def mismatches(
    spec: ModelSpec,
    layout: RankLayout,
    regions: Sequence[np.ndarray],
    tables: Sequence[np.ndarray],
    n_tokens: int,
    seed: int,
    w: int,
) -> int:
    """Words of the first ``n_tokens`` tokens (state: the whole slot) in the blocks of
    ``tables`` that differ from the pattern of ``seed``; 0 when every byte landed."""
    bad = 0
    for v, ids, state in _tables_by_view(spec, layout, tables):
        keep = v.rows if state else min(n_tokens, ids.shape[0] * v.rows)
        for seg in range(len(v.seg_units)):
            got = strided(regions[v.region], v, seg, w)[ids]
            want = expected(seed, v, seg, ids.shape[0], w)
            units, words = got.shape[2:]
            got = got.reshape(-1, units, words)[:keep]
            bad += int(np.count_nonzero(got != want.reshape(-1, units, words)[:keep]))
    return bad


def scratch_pattern(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` bytes (uint8) for a contiguous READ of transfer ``seed``."""
    with np.errstate(over="ignore"):
        words = np.arange(-(-nbytes // 8), dtype=np.uint64) * _C[4] + np.uint64(seed) * _C[0]
    return words.view(np.uint8)[:nbytes]
