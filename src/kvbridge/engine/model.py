"""The decoder: embedding → [norm → mixer → norm → SwiGLU MLP] × layers → norm → logits.

Mixer and MLP outputs are partial sums of row-parallel projections; ``reduce`` (an
all-reduce over the TP group, or nothing at TP 1) completes them. Embedding, norms and
the LM head are replicated, so every rank computes the same logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from kvbridge.engine.attention import Attention, LatentAttention
from kvbridge.engine.cache import PagedCache
from kvbridge.engine.config import ModelConfig
from kvbridge.engine.ops import Shard, Step, Weights, rms_norm, take
from kvbridge.engine.recurrent import DeltaNet, Mamba
from kvbridge.spec import ModelSpec

Reduce = Callable[[torch.Tensor], torch.Tensor]


class Mixer(Protocol):
    def forward(self, x: torch.Tensor, step: Step, cache: PagedCache) -> torch.Tensor: ...


def make_mixer(cfg: ModelConfig, layer: int, group: int, shard: Shard) -> Mixer:
    kind = cfg.pattern[layer]
    if kind in ("full", "sliding"):
        return Attention(cfg, layer, group, shard, cfg.window if kind == "sliding" else 0)
    if kind == "mla":
        return LatentAttention(cfg, layer, group, shard)
    if kind == "mamba":
        return Mamba(cfg, layer, group, shard)
    return DeltaNet(cfg, layer, group, shard, per_channel=kind == "kda")


class MLP:
    """SwiGLU; gate/up column-parallel, down row-parallel over the intermediate axis."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard):
        w, inter = Weights(cfg.seed, layer), cfg.intermediate
        mine = [(inter, 1, shard.split(inter, "MLP channels"))]
        self.gate = take(w.draw("mlp.gate", cfg.hidden, inter), 1, mine)
        self.up = take(w.draw("mlp.up", cfg.hidden, inter), 1, mine)
        self.down = take(w.draw("mlp.down", inter, cfg.hidden), 0, mine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.gate) * (x @ self.up)) @ self.down


class Model:
    def __init__(self, cfg: ModelConfig, spec: ModelSpec, shard: Shard, reduce: Reduce):
        top = Weights(cfg.seed, -1)
        self.embed = top.draw("embed", cfg.vocab, cfg.hidden, scale=1.0)
        self.head = top.draw("head", cfg.hidden, cfg.vocab)
        self.mixers = [make_mixer(cfg, i, spec.group_of(i), shard) for i in range(len(cfg.pattern))]
        self.mlps = [MLP(cfg, i, shard) for i in range(len(cfg.pattern))]
        self.reduce = reduce

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, step: Step, cache: PagedCache) -> torch.Tensor:
        """``tokens [T]`` at positions ``[step.start, step.end)`` → logits of the last
        ``[vocab]``; writes the tokens' K/V, latents and state into ``cache``."""
        x = self.embed[tokens]
        for mixer, mlp in zip(self.mixers, self.mlps, strict=True):
            x = x + self.reduce(mixer.forward(rms_norm(x), step, cache))
            x = x + self.reduce(mlp.forward(rms_norm(x)))
        return rms_norm(x[-1]) @ self.head
