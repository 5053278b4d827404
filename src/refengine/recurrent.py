"""Recurrent mixers with per-sequence state: gated delta-rule attention and a Mamba-2 SSM.

Both keep two state streams in one slot of their (state) group:

    conv       [kernel-1 rows][segment channels]   the last kernel-1 inputs of the conv
    recurrent  [1 row][heads][key_dim·value_dim]   (gdn, kda)
    ssm        [1 row][heads][head_dim·d_state]    (mamba)

A forward starting at token 0 starts from zero state; otherwise from the slot, which
may hold state computed here or transferred from a prefill instance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbridge.api import DType, Layer, gated_deltanet, mamba2
from refengine.cache import PagedCache
from refengine.config import ModelConfig
from refengine.mixers import MixerKind, register_mixer
from refengine.ops import (
    F64,
    Shard,
    Step,
    Weights,
    causal_conv,
    l2_normalize,
    rms_norm,
    take,
)


def read_state(segments: tuple[torch.Tensor, ...], slot: int, fresh: bool) -> torch.Tensor:
    """Slot ``slot`` of segment tensors ``[slots, rows, units, elems]`` → ``[rows, channels]``
    (segments side by side); zeros when ``fresh``."""
    parts = [seg[slot].reshape(seg.shape[1], -1) for seg in segments]
    state = torch.cat(parts, dim=1)
    return torch.zeros_like(state) if fresh else state


def write_state(segments: tuple[torch.Tensor, ...], slot: int, state: torch.Tensor) -> None:
    """Inverse of :func:`read_state`: ``state [rows, channels]`` into the slot, in place."""
    off = 0
    for seg in segments:
        width = seg.shape[2] * seg.shape[3]
        seg[slot].copy_(state[:, off : off + width].reshape(seg.shape[1:]))
        off += width


class DeltaNet:
    """Gated delta rule (GDN; KDA when the decay is per key channel). Per local head,
    with ``S [key_dim, value_dim]`` and l2-normalised ``q, k`` after a causal conv:

        S ← decay_t ⊙ S;   S ← S + β_t · k_t (v_t − Sᵀ k_t)ᵀ;   o_t = Sᵀ q_t
    """

    def __init__(self, cfg: ModelConfig, layer: int, group: int, shard: Shard, per_channel: bool):
        w = Weights(cfg.seed, layer)
        heads, dk, dv = cfg.lin_heads, cfg.lin_key_dim, cfg.lin_value_dim
        mine = shard.split(heads, "linear-attention heads")
        qkv = [(heads, dk, mine), (heads, dk, mine), (heads, dv, mine)]  # conv segments
        width = heads * (2 * dk + dv)
        self.w_in = take(w.draw("in", cfg.hidden, width), 1, qkv)
        self.w_conv = take(w.draw("conv", cfg.conv_kernel, width, scale=0.5), 1, qkv)
        decay = dk if per_channel else 1
        self.w_decay = take(w.draw("decay", cfg.hidden, heads * decay), 1, [(heads, decay, mine)])
        self.w_beta = take(w.draw("beta", cfg.hidden, heads), 1, [(heads, 1, mine)])
        self.w_gate = take(w.draw("gate", cfg.hidden, heads * dv), 1, [(heads, dv, mine)])
        self.wo = take(w.draw("o", heads * dv, cfg.hidden), 0, [(heads, dv, mine)])
        self.heads, self.dk, self.dv = mine[1] - mine[0], dk, dv
        self.layer, self.group = layer, group

    def forward(self, x: torch.Tensor, step: Step, cache: PagedCache) -> torch.Tensor:
        n, h, dk, dv = x.shape[0], self.heads, self.dk, self.dv
        conv = cache.segments(self.layer, "conv_state")
        rec = cache.segments(self.layer, "recurrent_state")
        slot, fresh = step.slot(self.group), step.start == 0
        y, conv_state = causal_conv(read_state(conv, slot, fresh), x @ self.w_in, self.w_conv)
        write_state(conv, slot, conv_state)
        q, k, v = F.silu(y).split([h * dk, h * dk, h * dv], dim=1)
        q, k = l2_normalize(q.view(n, h, dk)), l2_normalize(k.view(n, h, dk))
        v = v.view(n, h, dv)
        decay = torch.sigmoid(x @ self.w_decay + 3.0).view(n, h, -1, 1)
        beta = torch.sigmoid(x @ self.w_beta).view(n, h, 1)
        s = read_state(rec, slot, fresh).view(h, dk, dv)
        outs = []
        for t in range(n):
            s = s * decay[t]
            delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t]
            s = s + k[t][:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[t], s))
        write_state(rec, slot, s.reshape(1, -1))
        out = rms_norm(torch.stack(outs)) * F.silu(x @ self.w_gate).view(n, h, dv)
        return out.reshape(n, -1) @ self.wo


class Mamba:
    """Mamba-2 style selective SSM. Per local head ``h`` of group ``g(h)``, with
    ``S [head_dim, d_state]`` and ``x | B | C`` after a causal conv:

        S ← exp(−Δ_t·A_h) S + Δ_t x_t B_tᵀ;   y_t = S C_t + D_h x_t

    ``B, C`` come per group; with fewer groups than TP ranks a group is replicated.
    """

    def __init__(self, cfg: ModelConfig, layer: int, group: int, shard: Shard):
        w = Weights(cfg.seed, layer)
        heads, hd, groups, dn = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_groups, cfg.ssm_state
        mine, my_groups = shard.split(heads, "SSM heads"), shard.held(groups)
        xbc = [(heads, hd, mine), (groups, dn, my_groups), (groups, dn, my_groups)]
        width = heads * hd + 2 * groups * dn
        self.w_in = take(w.draw("in", cfg.hidden, width), 1, xbc)
        self.w_conv = take(w.draw("conv", cfg.conv_kernel, width, scale=0.5), 1, xbc)
        self.w_gate = take(w.draw("gate", cfg.hidden, heads * hd), 1, [(heads, hd, mine)])
        self.w_dt = take(w.draw("dt", cfg.hidden, heads), 1, [(heads, 1, mine)])
        self.wo = take(w.draw("o", heads * hd, cfg.hidden), 0, [(heads, hd, mine)])
        a, b = mine
        self.rate = torch.linspace(0.2, 1.5, heads, dtype=F64)[a:b]
        self.skip = w.draw("skip", heads, scale=1.0)[a:b]
        per_group = heads // groups
        self.group_of_head = torch.tensor([i // per_group - my_groups[0] for i in range(a, b)])
        self.heads, self.hd, self.dn = b - a, hd, dn
        self.my_groups = my_groups[1] - my_groups[0]
        self.layer, self.group = layer, group

    def forward(self, x: torch.Tensor, step: Step, cache: PagedCache) -> torch.Tensor:
        n, h, hd, dn, g = x.shape[0], self.heads, self.hd, self.dn, self.my_groups
        conv, ssm = (
            cache.segments(self.layer, "conv_state"),
            cache.segments(self.layer, "ssm_state"),
        )
        slot, fresh = step.slot(self.group), step.start == 0
        y, conv_state = causal_conv(read_state(conv, slot, fresh), x @ self.w_in, self.w_conv)
        write_state(conv, slot, conv_state)
        xs, b_in, c_in = F.silu(y).split([h * hd, g * dn, g * dn], dim=1)
        xs = xs.view(n, h, hd)
        b_in = b_in.view(n, g, dn)[:, self.group_of_head]
        c_in = c_in.view(n, g, dn)[:, self.group_of_head]
        dt = F.softplus(x @ self.w_dt)  # [n, h]
        decay = torch.exp(-dt * self.rate)
        s = read_state(ssm, slot, fresh).view(h, hd, dn)
        outs = []
        for t in range(n):
            update = (dt[t][:, None] * xs[t])[:, :, None] * b_in[t][:, None, :]
            s = decay[t][:, None, None] * s + update
            outs.append(torch.einsum("hpn,hn->hp", s, c_in[t]) + self.skip[:, None] * xs[t])
        write_state(ssm, slot, s.reshape(1, -1))
        out = rms_norm(torch.stack(outs)) * F.silu(x @ self.w_gate).view(n, h, hd)
        return out.reshape(n, -1) @ self.wo


CACHE = DType.FP64
"""The dtype of the engine's cache (float64, as the model computes)."""


def _delta_state(i: int, c: ModelConfig) -> Layer:
    h, dk, dv = c.lin_heads, c.lin_key_dim, c.lin_value_dim
    return gated_deltanet(i, h, dk, h, dv, c.conv_kernel, CACHE, CACHE)


def _ssm_state(i: int, c: ModelConfig) -> Layer:
    h, hd, g, n = c.ssm_heads, c.ssm_head_dim, c.ssm_groups, c.ssm_state
    return mamba2(i, h, hd, g, n, c.conv_kernel, CACHE, CACHE)


register_mixer(MixerKind("gdn", _delta_state, lambda c, i, g, s: DeltaNet(c, i, g, s, False)))
register_mixer(MixerKind("kda", _delta_state, lambda c, i, g, s: DeltaNet(c, i, g, s, True)))
register_mixer(MixerKind("mamba", _ssm_state, Mamba))
