"""What a model stores, logically: layers, their streams, groups.

Vocabulary (shapes are per token for attention streams, per sequence for state):

    stream row = [segment 0 units][segment 1 units]...   each unit `unit_bytes` contiguous
    attention  : one row per token,   K and V are two streams of `kv_heads` units
    MLA        : one row per token,   one stream "latent" of 1 unit, replicated over TP
    state      : `rows` rows per sequence (conv: kernel-1 rows; SSM: 1 row)

A segment is sharded over TP on its own (Mamba-2 conv channels are x | B | C).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from kvbridge.errors import SpecError
from kvbridge.spec.dtypes import DType
from kvbridge.spec.parallel import shard_interval


class Kind(enum.StrEnum):
    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"
    MLA = "mla"
    STATE = "state"


@dataclass(frozen=True, slots=True)
class Segment:
    """``units`` shardable units (heads, groups) of ``unit_bytes`` contiguous bytes."""

    units: int
    unit_bytes: int


@dataclass(frozen=True, slots=True)
class Stream:
    """One tensor of a layer. ``rows`` is 0 for per-token streams."""

    name: str
    segments: tuple[Segment, ...]
    dtype: DType = DType.BF16
    rows: int = 0
    replicated: bool = False

    @property
    def row_bytes(self) -> int:
        """Bytes of one full (unsharded) row."""
        return sum(s.units * s.unit_bytes for s in self.segments)

    @property
    def per_token(self) -> bool:
        return self.rows == 0


@dataclass(frozen=True, slots=True)
class Layer:
    index: int
    kind: Kind
    streams: tuple[Stream, ...]
    window: int = 0
    chunk: int = 0

    @property
    def token_bytes(self) -> int:
        """Bytes per token over all streams (0 for state layers), unsharded."""
        return 0 if self.kind is Kind.STATE else sum(s.row_bytes for s in self.streams)

    @property
    def state_bytes(self) -> int:
        """Bytes per sequence (state layers only), unsharded."""
        return sum(s.row_bytes * s.rows for s in self.streams if not s.per_token)

    def needed_tokens(self, n: int, cached: int) -> tuple[int, int]:
        """Token (or state-row) range D needs after P prefilled ``n`` tokens.

        ``cached`` tokens are already on D. Full hit (``cached >= n``): nothing.
        """
        if cached >= n:
            return (0, 0)
        if self.kind is Kind.STATE:
            return (0, 1)  # the whole slot: a state group's "token" is its one slot
        start = cached
        if self.kind is Kind.SLIDING:
            start = max(start, n - (self.window - 1))
        elif self.kind is Kind.CHUNKED:
            start = max(start, n - n % self.chunk)
        return (start, n) if start < n else (0, 0)


@dataclass(frozen=True, slots=True)
class Group:
    """Layers sharing one block table. State groups hold one slot per sequence."""

    name: str
    layers: tuple[int, ...]
    block_size: int = 16


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: tuple[Layer, ...]
    groups: tuple[Group, ...]
    _group_of: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_group_of", _check_spec(self))

    def group_of(self, layer: int) -> int:
        """Index of the group holding ``layer``."""
        return self._group_of[layer]

    def is_state_group(self, g: int) -> bool:
        return self.layers[self.groups[g].layers[0]].kind is Kind.STATE

    def blocks_needed(self, n_tokens: int) -> list[int]:
        """Blocks each group holds for ``n_tokens`` tokens (a state group: one slot)."""
        return [
            1 if self.is_state_group(g) else -(-n_tokens // grp.block_size)
            for g, grp in enumerate(self.groups)
        ]

    def with_block_sizes(self, sizes: int | Mapping[str, int]) -> ModelSpec:
        """The same spec with other block sizes (state groups keep 1)."""
        groups = []
        for g, grp in enumerate(self.groups):
            bs = sizes if isinstance(sizes, int) else sizes.get(grp.name, grp.block_size)
            groups.append(replace(grp, block_size=1 if self.is_state_group(g) else bs))
        return ModelSpec(self.name, self.layers, tuple(groups))

    def token_bytes(self, kind: Kind) -> int:
        """Unsharded bytes per token over all layers of ``kind``."""
        return sum(lay.token_bytes for lay in self.layers if lay.kind is kind)

    @property
    def state_bytes(self) -> int:
        return sum(lay.state_bytes for lay in self.layers)

    def check_tp(self, tp: int) -> None:
        """Raise :class:`SpecError` if some stream cannot be sharded over ``tp``."""
        for lay in self.layers:
            for s in lay.streams:
                for seg_i, seg in enumerate(s.segments):
                    try:
                        shard_interval(seg.units, tp, 0, s.replicated)
                    except SpecError as e:
                        raise SpecError(
                            f"layer {lay.index} stream {s.name!r} segment {seg_i}: {e}"
                        ) from None

    def compat_hash(self) -> str:
        """Hash of everything that affects bytes except block sizes (P and D may differ)."""
        body = {
            "layers": [asdict(lay) for lay in self.layers],
            "groups": [list(g.layers) for g in self.groups],
        }
        text = json.dumps(body, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_spec(spec: ModelSpec) -> dict[int, int]:
    for i, lay in enumerate(spec.layers):
        if lay.index != i:
            raise SpecError(f"layer at position {i} has index {lay.index}")
        _check_layer(lay)
    group_of: dict[int, int] = {}
    for g, grp in enumerate(spec.groups):
        if not grp.layers:
            raise SpecError(f"group {grp.name!r} has no layers")
        if grp.block_size < 1:
            raise SpecError(f"group {grp.name!r}: block_size {grp.block_size} < 1")
        state = {spec.layers[i].kind is Kind.STATE for i in grp.layers if i < len(spec.layers)}
        if len(state) > 1:
            raise SpecError(f"group {grp.name!r} mixes state and token layers")
        for i in grp.layers:
            if not 0 <= i < len(spec.layers):
                raise SpecError(f"group {grp.name!r} names layer {i}; spec has {len(spec.layers)}")
            if i in group_of:
                raise SpecError(f"layer {i} is in groups {group_of[i]} and {g}")
            group_of[i] = g
    cached = [lay.index for lay in spec.layers if lay.streams]
    missing = sorted(set(cached) - set(group_of))
    if missing:
        raise SpecError(f"layers {missing} are in no group")
    return group_of


def _check_layer(lay: Layer) -> None:
    if lay.kind is Kind.SLIDING and lay.window < 1:
        raise SpecError(f"layer {lay.index}: sliding window {lay.window} < 1")
    if lay.kind is Kind.CHUNKED and lay.chunk < 1:
        raise SpecError(f"layer {lay.index}: attention chunk {lay.chunk} < 1")
    for s in lay.streams:
        if (lay.kind is Kind.STATE) == s.per_token:
            raise SpecError(f"layer {lay.index} ({lay.kind}) stream {s.name!r}: rows={s.rows}")
        if not s.segments or any(g.units < 1 or g.unit_bytes < 1 for g in s.segments):
            raise SpecError(f"layer {lay.index} stream {s.name!r}: empty segment {s.segments}")
