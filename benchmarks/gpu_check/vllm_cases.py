"""The cases of gpu-check's vLLM-caches phase: P and D engines whose caches vLLM 0.32 would
allocate (``vllm_alloc``) in every ``KVCacheLayout``, with kernel blocks, MLA, and Mamba-2 /
Gated DeltaNet state with its conv kept ``SD`` and ``DS``; P and D differ in layout,
kernel blocks, conv orientation and TP. Every case keeps vLLM's block size equal on both
sides (a request's partial last block then spans the same tokens on P and D)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.gpu_check.vllm_alloc import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)

HEADS, HD = 4, 8
ATTENTION = {  # kind: (kv heads of the model, head size, head size of V, dtype)
    "kv": (HEADS, HD, HD, torch.float32),
    "diffkv": (HEADS, HD, 4, torch.bfloat16),
    "mla": (1, 24, 0, torch.bfloat16),
}


def _conv(rows: int, channels: int) -> Callable[[bool], tuple[tuple[int, ...], ...]]:
    return lambda ds: ((channels, rows) if ds else (rows, channels),)


STATE_SHAPES: dict[str, Callable[[bool], tuple[tuple[int, ...], ...]]] = {
    # vLLM's MambaStateShapeCalculator at TP 1 (the pin test checks): Mamba-2 of
    # intermediate 32, 2 groups, 4 heads of 8, state 6, conv kernel 4 (channels x|B|C
    # = 32 + 2·2·6); GDN of 2 k-heads of 8, 4 v-heads of 4, kernel 4 (q|k|v = 16+16+16)
    "MAMBA2": lambda ds: (*_conv(3, 56)(ds), (4, 8, 6)),
    "GDN_ATTN": lambda ds: (*_conv(3, 48)(ds), (4, 4, 8)),
}


def attention_specs(kind: str, block: int, tp: int) -> FullAttentionSpec:
    """One rank's spec of an attention layer of ``kind`` (MLA: replicated, one slot)."""
    heads, hk, hv, dt = ATTENTION[kind]
    if kind == "mla":
        return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=hk, dtype=dt)
    return FullAttentionSpec(
        block_size=block, num_kv_heads=heads // tp, head_size=hk, head_size_v=hv, dtype=dt
    )


def hybrid_groups(kind: str, conv: str, block: int) -> list[KVCacheGroupSpec]:
    """Two state layers (page padded to the attention page), then two attention layers
    (2 KV heads of 8, fp32), as two groups aliasing one allocation (TP 1)."""
    att = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=HD, dtype=torch.float32)
    ms = MambaSpec(
        block_size=block,
        shapes=STATE_SHAPES[kind](conv == "DS"),
        dtypes=(torch.float32,) * 2,
        page_size_padded=att.page_size_bytes,
        mamba_type=kind,
    )
    return [
        KVCacheGroupSpec(["m.layers.0.mixer", "m.layers.1.mixer"], ms),
        KVCacheGroupSpec(["m.layers.2.attn", "m.layers.3.attn"], att),
    ]


@dataclass(frozen=True, slots=True)
class SideCfg:
    """One engine: its ``KVCacheLayout``, kernel block size (None: vLLM's block), TP and
    conv orientation (``SD`` or ``DS``)."""

    layout: str
    kernel: int | None = None
    tp: int = 1
    conv: str = "SD"


@dataclass(frozen=True, slots=True)
class Case:
    kind: str
    """``kv``, ``diffkv``, ``mla`` or a hybrid: ``MAMBA2``, ``GDN_ATTN``."""
    p: SideCfg
    d: SideCfg
    block: int = 32

    @property
    def label(self) -> str:
        def side(s: SideCfg) -> str:
            k = f"/k{s.kernel}" if s.kernel else ""
            c = f" {s.conv}" if self.hybrid else ""
            return f"{s.layout}{k} tp{s.tp}{c}"

        return f"{self.kind} {side(self.p)} -> {side(self.d)}"

    @property
    def hybrid(self) -> bool:
        return self.kind in STATE_SHAPES

    def groups(self, side: SideCfg) -> list[KVCacheGroupSpec]:
        if self.hybrid:
            return hybrid_groups(self.kind, side.conv, self.block)
        names = ["m.layers.0.attn", "m.layers.1.attn"]
        return [KVCacheGroupSpec(names, attention_specs(self.kind, self.block, side.tp))]


CASES = (  # every layout on each side at least once; kernel blocks where vLLM allows them
    Case("kv", SideCfg("LBHNC", 16, 1), SideCfg("BLHNC", None, 2)),
    Case("kv", SideCfg("LBNHC", 16, 2), SideCfg("LHBNC", None, 1)),
    Case("kv", SideCfg("LHBNC"), SideCfg("BLNHC", None, 2)),
    Case("kv", SideCfg("BLHNC", None, 2), SideCfg("BHLNC")),
    Case("kv", SideCfg("BLNHC"), SideCfg("LBHNC", 16)),
    Case("kv", SideCfg("BHLNC", None, 2), SideCfg("LBNHC", 16, 2)),
    Case("diffkv", SideCfg("LBNHC"), SideCfg("LBHNC", 16, 2)),
    Case("mla", SideCfg("LHBNC", 16), SideCfg("BLHNC", None, 2)),
    Case("mla", SideCfg("BHLNC", None, 2), SideCfg("LBNHC")),
    Case("MAMBA2", SideCfg("LBHNC", conv="SD"), SideCfg("BLHNC", conv="DS")),
    Case("MAMBA2", SideCfg("BHLNC", conv="DS"), SideCfg("LHBNC", conv="DS")),
    Case("GDN_ATTN", SideCfg("BLNHC", conv="DS"), SideCfg("LBNHC", conv="SD")),
    Case("GDN_ATTN", SideCfg("LBHNC", conv="SD"), SideCfg("BHLNC", conv="SD")),
)
