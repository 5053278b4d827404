"""The byte pattern every transfer is checked against, written and compared with torch
where the memory is (on the GPU, or on CPU tensors).

A ``w``-byte word (``w``: per layer and stream, the widest of 8, 4, 2, 1 dividing every
unit, stride and offset of that stream's views on both sides, :func:`word_sizes`) of layer ``L``,
stream ``s``, segment ``g``, token (state: row) ``t``, global unit ``u`` (a KV head, a
channel group) and word ``k`` of that unit holds the low ``w`` bytes of ``mix(v)``::

    v = seed·K0 + L·K1 + crc16(s)·K2 + g·K3 + t·K4 + u·K5 + k·K6      (every term < 2^55)
    mix(v) = v xor (v >> 29)                                            (no overflow)

so a byte from the wrong block, rank, head, token or an earlier transfer (each transfer
has its own seed) differs. P writes whole blocks through its own views; D compares the
first ``n`` tokens (state: the whole slot) through its own views: the planner is not
trusted by the check of its own output.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvbridge.layout.view import RankLayout, View
from kvbridge.spec.model import ModelSpec

WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
K = (0x5BD1E995, 0x3C6EF372, 0x1B873593, 0x7FEB352D, 0x2C1B3C6D, 0x6A09E667, 0x297A2D39)
"""Odd multipliers below 2^31: with the bounds above no sum reaches 2^63."""


Words = dict[tuple[int, str], int]
"""Word size (bytes) per (layer, stream)."""


def word_sizes(layouts: Sequence[RankLayout]) -> Words:
    """Per (layer, stream), the widest word every view of it in ``layouts`` allows (the
    same on P and D: a word's value depends on its size)."""
    sizes: dict[tuple[int, str], list[int]] = {}
    for lay in layouts:
        for v in lay.views:
            sizes.setdefault((v.layer, v.stream), []).extend(
                (v.offset, v.block_stride, *v.seg_offsets, *v.row_strides, *v.unit_strides,
                 *v.unit_bytes)
            )  # fmt: skip
    return {
        k: next(w for w in (8, 4, 2, 1) if all(x % w == 0 for x in xs)) for k, xs in sizes.items()
    }


def _strided(region: torch.Tensor, v: View, seg: int, w: int) -> torch.Tensor:
    """Segment ``seg`` of view ``v`` in ``region`` (the whole region, uint8) as a writable
    ``(blocks, rows, local units, words)`` tensor of ``w``-byte words (no copy)."""
    if v.pieces:
        raise ValueError(f"view {v.layer}/{v.stream}: split units are not supported here")
    a, b = v.seg_units[seg]
    words = region[: region.numel() - region.numel() % w].view(WORD[w])
    shape = (v.blocks, v.rows, b - a, v.unit_bytes[seg] // w)
    strides = (v.block_stride // w, v.row_strides[seg] // w, v.unit_strides[seg] // w, 1)
    start = words.storage_offset() + (v.offset + v.seg_offsets[seg]) // w
    return torch.as_strided(words, shape, strides, start)


def expected(seed: int, v: View, seg: int, entries: int, w: int, dev: torch.device) -> torch.Tensor:
    """The pattern of ``entries`` consecutive table entries of ``v``'s segment ``seg``
    (token ``t = entry · rows + row``), shaped as :func:`_strided` gives them."""
    a, b = v.seg_units[seg]
    i64 = torch.int64
    base = seed * K[0] + v.layer * K[1] + (zlib.crc32(v.stream.encode()) & 0xFFFF) * K[2]
    base += seg * K[3]
    tok = torch.arange(entries * v.rows, dtype=i64, device=dev).view(entries, v.rows, 1, 1)
    unit = torch.arange(a, b, dtype=i64, device=dev).view(1, 1, -1, 1)
    word = torch.arange(v.unit_bytes[seg] // w, dtype=i64, device=dev).view(1, 1, 1, -1)
    val = (tok * K[4] + base) + (unit * K[5] + word * K[6])
    return (val ^ (val >> 29)).to(WORD[w])


def _ids(tables: Sequence[np.ndarray], dev: torch.device) -> list[torch.Tensor]:
    return [torch.as_tensor(np.asarray(t, np.int64), device=dev) for t in tables]


def fill(
    spec: ModelSpec,
    layout: RankLayout,
    regions: Sequence[torch.Tensor],
    tables: Sequence[np.ndarray],
    seed: int,
    words: Words,
) -> None:
    """Write the pattern of ``seed`` into the blocks of ``tables`` (ids per spec group;
    state groups: one slot), whole blocks, through every view of ``layout``."""
    for target, ids, want in fill_jobs(spec, layout, regions, tables, seed, words):
        target[ids] = want


Job = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(strided view into a region, block ids, pattern)``: ``view[ids] = pattern``."""


def fill_jobs(
    spec: ModelSpec,
    layout: RankLayout,
    regions: Sequence[torch.Tensor],
    tables: Sequence[np.ndarray],
    seed: int,
    words: Words,
) -> Iterator[Job]:
    """What :func:`fill` writes, one view segment at a time, computed but not written:
    each job's write is one indexed store on the device (no host transfer, no read
    back), so a late write can be queued behind a slow kernel without the host waiting."""
    dev = regions[0].device
    ids = _ids(tables, dev)
    for v in layout.views:
        g, w = spec.group_of(v.layer), words[(v.layer, v.stream)]
        for seg in range(len(v.seg_units)):
            want = expected(seed, v, seg, ids[g].numel(), w, dev)
            yield _strided(regions[v.region], v, seg, w), ids[g], want


def mismatches(
    spec: ModelSpec,
    layout: RankLayout,
    regions: Sequence[torch.Tensor],
    tables: Sequence[np.ndarray],
    n_tokens: int,
    seed: int,
    words: Words,
) -> tuple[int, int]:
    """``(words that differ, bytes compared)`` over the first ``n_tokens`` tokens (state:
    the whole slot) of the blocks of ``tables``: ``(0, n)`` when every byte landed."""
    dev = regions[0].device
    ids = _ids(tables, dev)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    checked = 0
    for v in layout.views:
        g, w = spec.group_of(v.layer), words[(v.layer, v.stream)]
        keep = v.rows if spec.is_state_group(g) else min(n_tokens, ids[g].numel() * v.rows)
        for seg in range(len(v.seg_units)):
            got = _strided(regions[v.region], v, seg, w)[ids[g]]
            want = expected(seed, v, seg, ids[g].numel(), w, dev)
            units, per_unit = got.shape[2:]
            got, want = got.reshape(-1, units, per_unit), want.reshape(-1, units, per_unit)
            bad += (got[:keep] != want[:keep]).sum()
            checked += keep * units * per_unit * w
    return int(bad.item()), checked


def flat(nbytes: int, seed: int, dev: torch.device) -> torch.Tensor:
    """``nbytes`` pattern bytes (uint8) of a contiguous transfer with ``seed``."""
    words = torch.arange(-(-nbytes // 8), dtype=torch.int64, device=dev) * K[4] + seed * K[0]
    return (words ^ (words >> 29)).view(torch.uint8)[:nbytes]


def fill_flat(t: torch.Tensor, nbytes: int, seed: int) -> None:
    t[:nbytes].copy_(flat(nbytes, seed, t.device))


def flat_mismatches(t: torch.Tensor, nbytes: int, seed: int) -> int:
    """Bytes of ``t[:nbytes]`` that differ from :func:`flat`'s pattern."""
    return int((t[:nbytes] != flat(nbytes, seed, t.device)).sum().item())
