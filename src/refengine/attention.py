"""Attention mixers over the paged cache: GQA (full or sliding window) and MLA.

Each ``forward`` writes the new tokens' K/V (or latent) into the cache first, then reads
back every key position it attends to, so prefill, decode and a continued prefill on
top of transferred bytes are one code path. Outputs are partial sums of a row-parallel
projection: the model all-reduces them over TP.
"""

from __future__ import annotations

import torch

from kvbridge.api import DType, Kind, Layer, attention, mla
from refengine.cache import PagedCache
from refengine.config import ModelConfig
from refengine.mixers import MixerKind, register_mixer
from refengine.ops import Shard, Step, Weights, attend, causal_mask, rms_norm, rope, take


class Attention:
    """GQA with RoPE. ``window`` 0: full; else a query sees the last ``window`` tokens,
    itself included, so decoding needs the previous ``window - 1`` tokens' K/V."""

    def __init__(self, cfg: ModelConfig, layer: int, group: int, shard: Shard, window: int):
        w = Weights(cfg.seed, layer)
        heads, kv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        q_range, kv_range = shard.split(heads, "query heads"), shard.held(kv)
        self.wq = take(w.draw("q", cfg.hidden, heads * d), 1, [(heads, d, q_range)])
        self.wk = take(w.draw("k", cfg.hidden, kv * d), 1, [(kv, d, kv_range)])
        self.wv = take(w.draw("v", cfg.hidden, kv * d), 1, [(kv, d, kv_range)])
        self.wo = take(w.draw("o", heads * d, cfg.hidden), 0, [(heads, d, q_range)])
        per_kv = heads // kv
        self.kv_of_q = torch.tensor([h // per_kv - kv_range[0] for h in range(*q_range)])
        assert 0 <= int(self.kv_of_q.min()) <= int(self.kv_of_q.max()) < kv_range[1] - kv_range[0]
        self.layer, self.group, self.window, self.head_dim = layer, group, window, d

    def forward(self, x: torch.Tensor, step: Step, cache: PagedCache) -> torch.Tensor:
        n, d, pos = x.shape[0], self.head_dim, step.positions
        q = rope((x @ self.wq).view(n, -1, d), pos)
        k = rope((x @ self.wk).view(n, -1, d), pos)
        v = (x @ self.wv).view(n, -1, d)
        k_cache, v_cache = cache.stream(self.layer, "k"), cache.stream(self.layer, "v")
        block_size = k_cache.shape[1]
        blocks, rows = step.token_slots(self.group, block_size, step.start, step.end)
        k_cache[blocks, rows] = k
        v_cache[blocks, rows] = v
        first = max(0, step.start - self.window + 1) if self.window else 0
        blocks, rows = step.token_slots(self.group, block_size, first, step.end)
        keys = k_cache[blocks, rows][:, self.kv_of_q]
        values = v_cache[blocks, rows][:, self.kv_of_q]
        allowed = causal_mask(pos, torch.arange(first, step.end), self.window)
        return attend(q, keys, values, allowed).reshape(n, -1) @ self.wo


class LatentAttention:
    """MLA: per token one latent ``[c (kv_lora_rank) | k_rope (rope_dim)]``, computed
    identically on every TP rank (replicated); heads are up-projected from ``c``."""

    def __init__(self, cfg: ModelConfig, layer: int, group: int, shard: Shard):
        w = Weights(cfg.seed, layer)
        heads, nope, rot = cfg.heads, cfg.nope_dim, cfg.rope_dim
        lora, vdim = cfg.kv_lora_rank, cfg.v_head_dim
        mine = shard.split(heads, "MLA heads")
        self.wq = take(
            w.draw("q", cfg.hidden, heads * (nope + rot)), 1, [(heads, nope + rot, mine)]
        )
        self.w_latent = w.draw("latent", cfg.hidden, lora + rot)
        self.w_uk = take(w.draw("uk", lora, heads * nope), 1, [(heads, nope, mine)])
        self.w_uv = take(w.draw("uv", lora, heads * vdim), 1, [(heads, vdim, mine)])
        self.wo = take(w.draw("o", heads * vdim, cfg.hidden), 0, [(heads, vdim, mine)])
        self.layer, self.group, self.lora, self.nope = layer, group, lora, nope
        self.q_width = nope + rot

    def forward(self, x: torch.Tensor, step: Step, cache: PagedCache) -> torch.Tensor:
        n, pos, lora, nope = x.shape[0], step.positions, self.lora, self.nope
        q = (x @ self.wq).view(n, -1, self.q_width)
        q = torch.cat((q[..., :nope], rope(q[..., nope:], pos)), dim=-1)
        latent = x @ self.w_latent
        k_rope = rope(latent[:, None, lora:], pos)[:, 0]
        latent = torch.cat((rms_norm(latent[:, :lora]), k_rope), dim=-1)
        lat_cache = cache.stream(self.layer, "latent")  # [blocks, rows, 1, lora + rope]
        block_size = lat_cache.shape[1]
        blocks, rows = step.token_slots(self.group, block_size, step.start, step.end)
        lat_cache[blocks, rows] = latent[:, None]
        blocks, rows = step.token_slots(self.group, block_size, 0, step.end)
        every = lat_cache[blocks, rows][:, 0]  # [S, lora + rope]
        s, heads = every.shape[0], q.shape[1]
        k_nope = (every[:, :lora] @ self.w_uk).view(s, heads, nope)
        k_rot = every[:, None, lora:].expand(s, heads, every.shape[1] - lora)
        v = (every[:, :lora] @ self.w_uv).view(s, heads, -1)
        allowed = causal_mask(pos, torch.arange(step.end))
        out = attend(q, torch.cat((k_nope, k_rot), dim=-1), v, allowed)
        return out.reshape(n, -1) @ self.wo


F64 = DType.FP64


def _kv(i: int, c: ModelConfig) -> Layer:
    return attention(i, c.kv_heads, c.head_dim, F64)


def _windowed(i: int, c: ModelConfig) -> Layer:
    return attention(i, c.kv_heads, c.head_dim, F64, Kind.SLIDING, window=c.window)


register_mixer(MixerKind("full", _kv, lambda c, i, g, s: Attention(c, i, g, s, 0)))
register_mixer(MixerKind("sliding", _windowed, lambda c, i, g, s: Attention(c, i, g, s, c.window)))
register_mixer(
    MixerKind("mla", lambda i, c: mla(i, c.kv_lora_rank + c.rope_dim, F64), LatentAttention)
)
