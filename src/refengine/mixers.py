"""Layer mixers of the reference engine by name: the one place a mixer is registered.

A mixer kind pairs what a layer keeps in the paged cache (a kvbridge
:class:`~kvbridge.api.Layer`, built with the public spec builders) with the torch module
that computes it. The built-in kinds register themselves next to their modules
(``attention.py``: full, sliding, mla; ``recurrent.py``: gdn, kda, mamba); a new kind is
one module with its class and a :func:`register_mixer` call, imported at the end of this
file. ``ModelConfig.pattern`` names kinds; the spec (``refengine/spec.py``) and the model
(``refengine/model.py``) both look them up here, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvbridge.api import Layer
from kvbridge.registry import Registry
from refengine.errors import EngineError

if TYPE_CHECKING:
    import torch

    from refengine.cache import PagedCache
    from refengine.config import ModelConfig
    from refengine.ops import Shard, Step


class Mixer(Protocol):
    def forward(self, x: torch.Tensor, step: Step, cache: PagedCache) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class MixerKind:
    """``cache(layer, cfg)``: what the layer keeps; ``build(cfg, layer, group, shard)``:
    this rank's module (``group``: the layer's cache group, ``shard``: its TP slice)."""

    name: str
    cache: Callable[[int, ModelConfig], Layer]
    build: Callable[[ModelConfig, int, int, Shard], Mixer]


_MIXERS: Registry[MixerKind] = Registry("mixer", EngineError)


def register_mixer(kind: MixerKind) -> None:
    _MIXERS.register(kind.name, kind)


def mixer_names() -> tuple[str, ...]:
    return _MIXERS.names()


def get_mixer(name: str) -> MixerKind:
    return _MIXERS.get(name)


from refengine import attention as _attention  # noqa: E402, F401  (full, sliding, mla)
from refengine import recurrent as _recurrent  # noqa: E402, F401  (gdn, kda, mamba)
