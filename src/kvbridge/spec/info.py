"""What the model loaders (``config.json``, spec file) produce: a spec together with
what the file said (model layer of each spec layer, the config fields split over TP, the
class defaults that filled gaps), and the default grouping they share."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from kvbridge.errors import ConfigError, SpecError
from kvbridge.spec.model import Group, Kind, Layer, ModelSpec
from kvbridge.spec.parallel import split_evenly


@dataclass(frozen=True)
class ModelInfo:
    spec: ModelSpec
    source: str
    """Where the spec came from: ``"config.json (llama)"``, ``"spec file"``."""
    model_layers: tuple[int, ...]
    """Model layer of each spec layer, non-decreasing. Identity unless a model layer holds
    two caches (Falcon-H1 runs attention and Mamba-2 in every layer: two spec layers)."""
    sharded: tuple[tuple[str, int], ...] = ()
    """``(config field, units)`` split over TP, to name the field when a TP does not fit."""
    defaults_applied: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.spec.layers)
        ml = self.model_layers
        if len(ml) != n or any(b < a for a, b in pairwise(ml)):
            raise SpecError(f"model_layers {ml} must be non-decreasing, one per spec layer ({n})")

    @property
    def num_model_layers(self) -> int:
        return self.model_layers[-1] + 1 if self.model_layers else 0

    def check_tp(self, tp: int) -> None:
        """Raise :class:`ConfigError` naming the field whose units do not split over ``tp``."""
        for name, units in self.sharded:
            if tp < 1 or (units % tp and tp % units):
                raise ConfigError(
                    f"{name}={units} cannot be split over TP {tp} (neither divides the other)"
                )
        self.spec.check_tp(tp)

    def stages(self, pp: int) -> tuple[tuple[int, int], ...]:
        """Spec-layer range of each of ``pp`` stages, splitting *model* layers evenly
        (earlier stages take the remainder) so a model layer's caches stay together."""
        n = self.num_model_layers
        if not 1 <= pp <= n:
            raise SpecError(f"pp={pp} must be between 1 and the {n} model layers")
        ml = self.model_layers
        return tuple((bisect_left(ml, a), bisect_left(ml, b)) for a, b in split_evenly(n, pp))


_GROUP_OF_KIND = {
    Kind.FULL: "attn",
    Kind.MLA: "attn",
    Kind.SLIDING: "sliding",
    Kind.CHUNKED: "chunked",
    Kind.STATE: "state",
}


def default_groups(layers: Sequence[Layer], block_size: int = 16) -> tuple[Group, ...]:
    """One group per needed-range kind: full and MLA share ``attn``; ``sliding``,
    ``chunked`` and ``state`` (one slot per sequence) their own; layers without streams
    are in none."""
    members: dict[str, list[int]] = {}
    for lay in layers:
        if lay.streams:
            members.setdefault(_GROUP_OF_KIND[lay.kind], []).append(lay.index)
    return tuple(
        Group(g, tuple(idx), 1 if g == "state" else block_size) for g, idx in members.items()
    )
