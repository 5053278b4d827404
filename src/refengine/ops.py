"""What every mixer needs: the step context, weights drawn from a seed, TP slicing, math.

All tensors are float64 on CPU (see ``docs/engine.md``: why float64). Shapes use
``T`` new tokens, ``S`` key positions, ``h`` local heads, ``d`` per-head width.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbridge.api import SpecError, shard_interval

F64 = torch.float64


@dataclass(frozen=True, slots=True)
class Step:
    """One forward pass of one request: new tokens at positions ``[start, end)``.

    ``tables[g]``: int64 block ids of group ``g`` (one slot id for a state group).
    """

    start: int
    end: int
    tables: tuple[torch.Tensor, ...]

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.end)

    def token_slots(
        self, group: int, block_size: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, ...]:
        """``(block ids, rows)`` of token positions ``[lo, hi)`` in group ``group``."""
        pos = torch.arange(lo, hi)
        return self.tables[group][pos // block_size], pos % block_size

    def slot(self, group: int) -> int:
        return int(self.tables[group][0])


@dataclass(frozen=True, slots=True)
class Shard:
    """TP rank ``rank`` of ``tp``: which units of a head axis it holds."""

    tp: int
    rank: int

    def split(self, units: int, what: str) -> tuple[int, int]:
        """Units summed over ranks after a row-parallel projection: must divide evenly."""
        if units % self.tp:
            raise SpecError(f"{units} {what} cannot be split over TP {self.tp}")
        return shard_interval(units, self.tp, self.rank)

    def held(self, units: int) -> tuple[int, int]:
        """Units only read locally (KV heads, B/C groups): may be replicated over ranks."""
        return shard_interval(units, self.tp, self.rank)


Part = tuple[int, int, tuple[int, int]]
"""``(units, width, (start, stop))``: an axis of ``units·width`` of which we keep a range."""


def take(w: torch.Tensor, dim: int, parts: Sequence[Part]) -> torch.Tensor:
    """Slices of ``w`` along ``dim``; the axis is the parts laid out one after another."""
    pieces, off = [], 0
    for units, width, (a, b) in parts:
        pieces.append(w.narrow(dim, off + a * width, (b - a) * width))
        off += units * width
    assert off == w.shape[dim], (off, w.shape, dim)
    return torch.cat(pieces, dim).contiguous()


class Weights:
    """Full-size weights of one layer, each drawn from ``(seed, layer, name)``.

    Every TP size draws the same full tensor and keeps its slice, so weights agree.
    """

    def __init__(self, seed: int, layer: int) -> None:
        self.prefix = f"{seed}/{layer}/"

    def draw(self, name: str, *shape: int, scale: float | None = None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(zlib.crc32((self.prefix + name).encode()))
        std = 1.0 / math.sqrt(shape[0]) if scale is None else scale
        return torch.randn(shape, generator=gen, dtype=F64) * std


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """RMS norm over the last axis, unit gain (a random model learns no gains)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half) of ``x [T, h, d]`` at ``positions [T]``."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=F64) / half)
    angle = (positions.to(F64)[:, None] * freqs)[:, None, :]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Softmax attention: ``q [T,h,d]``, ``k [S,h,d]``, ``v [S,h,e]``, ``allowed [T,S]``
    → ``[T,h,e]``."""
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,she->the", scores.softmax(-1), v)


def causal_mask(queries: torch.Tensor, keys: torch.Tensor, window: int = 0) -> torch.Tensor:
    """``[T, S]``: query position ``p`` sees key ``s`` iff ``s ≤ p`` (and ``p - s < window``)."""
    diff = queries[:, None] - keys[None, :]
    allowed = diff >= 0
    return allowed & (diff < window) if window else allowed


def causal_conv(
    state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv: ``state [K-1, C]`` (previous inputs), ``x [T, C]``,
    ``weight [K, C]`` → ``(y [T, C], new state [K-1, C])``."""
    full = torch.cat((state, x), dim=0)
    windows = full.unfold(0, weight.shape[0], 1)  # [T, C, K]
    y = (windows * weight.T[None]).sum(-1)
    return y, full[x.shape[0] :]
