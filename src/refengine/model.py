"""The decoder: embedding → [norm → mixer → norm → SwiGLU MLP] × layers → norm → logits.

With PP, a rank runs only its stage's layers (``refengine/comm.py`` passes hidden states on).

Mixer and MLP outputs are partial sums of row-parallel projections; ``reduce`` (an
all-reduce over the TP group, or nothing at TP 1) completes them. Embedding, norms and
the LM head are replicated, so every rank computes the same logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvbridge.api import ModelSpec
from refengine.cache import PagedCache
from refengine.config import ModelConfig
from refengine.mixers import Mixer, get_mixer
from refengine.ops import Shard, Step, Weights, rms_norm, take

Reduce = Callable[[torch.Tensor], torch.Tensor]


def make_mixer(cfg: ModelConfig, layer: int, group: int, shard: Shard) -> Mixer:
    return get_mixer(cfg.pattern[layer]).build(cfg, layer, group, shard)


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
    """The layers ``layers`` (a PP stage's range; all of them at PP 1) of one TP rank.
    The first stage embeds tokens, the last turns hidden states into logits."""

    def __init__(
        self, cfg: ModelConfig, spec: ModelSpec, shard: Shard, reduce: Reduce, layers: range
    ):
        top = Weights(cfg.seed, -1)
        self.embedding = top.draw("embed", cfg.vocab, cfg.hidden, scale=1.0)
        self.head = top.draw("head", cfg.hidden, cfg.vocab)
        self.mixers = [make_mixer(cfg, i, spec.group_of(i), shard) for i in layers]
        self.mlps = [MLP(cfg, i, shard) for i in layers]
        self.reduce = reduce

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [T]`` → hidden states ``[T, hidden]``."""
        return self.embedding[tokens]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, step: Step, cache: PagedCache) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of positions ``[step.start, step.end)`` through
        this stage's layers; writes the tokens' K/V, latents and state into ``cache``."""
        for mixer, mlp in zip(self.mixers, self.mlps, strict=True):
            x = x + self.reduce(mixer.forward(rms_norm(x), step, cache))
            x = x + self.reduce(mlp.forward(rms_norm(x)))
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[vocab]`` after the last position of ``x [T, hidden]``."""
        return rms_norm(x[-1]) @ self.head
