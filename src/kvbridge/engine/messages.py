"""Typed messages between an instance (parent) and its rank workers, over pipes.

    parent → rank   Extend | Stop
    rank → parent   Regions (once, after boot) | Sampled | Failed

Ranks keep no request state: every :class:`Extend` carries the positions and the block
tables, so the parent's :class:`~kvbridge.engine.instance.Instance` is the one owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.engine.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Boot:
    """Everything a rank needs to build its model slice and its cache."""

    config: ModelConfig
    block_size: int
    layout: str
    num_blocks: int
    tp: int
    rank: int = 0
    port: int = 0
    """TCP port of the gloo rendezvous on 127.0.0.1 (unused at TP 1 in process)."""


@dataclass(frozen=True, slots=True)
class Extend:
    """Run ``tokens`` at positions ``[start, start + len(tokens))``; reply :class:`Sampled`.

    ``tables[g]``: block ids of group ``g`` covering at least ``start + len(tokens)``
    tokens (a state group: its one slot).
    """

    tokens: tuple[int, ...]
    start: int
    tables: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Regions:
    """``(address, nbytes)`` of each cache region of the rank, in layout order."""

    regions: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Sampled:
    """The greedy next token after the last position of an :class:`Extend`."""

    token: int


@dataclass(frozen=True, slots=True)
class Failed:
    rank: int
    error: str


Command = Extend | Stop
Reply = Regions | Sampled | Failed
