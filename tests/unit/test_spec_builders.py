"""A spec built by hand with the :mod:`kvbridge.spec` builders (as an engine declares its
caches) is the spec loaded from the model's ``config.json``: same streams, same hash."""

from __future__ import annotations

from kvbridge.spec import (
    DType,
    Layer,
    ModelSpec,
    attention,
    gated_deltanet,
    group_by_kind,
    load_model,
    mamba2,
)
from kvbridge.spec.model import Kind

BF16, F32 = DType.BF16, DType.FP32


def granite_4_h_tiny() -> ModelSpec:
    """40 layers, attention at 5, 15, 25, 35 (4 KV heads of 128); Mamba-2 elsewhere
    (48 heads of 64, 1 group, d_state 128, conv kernel 4), all bf16."""
    layers = [
        attention(i, 4, 128) if i % 10 == 5 else mamba2(i, 48, 64, 1, 128, 4) for i in range(40)
    ]
    return group_by_kind("granite-4.0-h-tiny", layers)


def nemotron_3_nano() -> ModelSpec:
    """``hybrid_override_pattern``: M Mamba-2 (64 heads of 64, 8 groups, d_state 128,
    kernel 4, float32 SSM state), * attention (2 KV heads of 128), E an MoE block
    without cache."""
    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    mixers = {
        "M": lambda i: mamba2(i, 64, 64, 8, 128, 4, BF16, F32),
        "*": lambda i: attention(i, 2, 128),
        "E": lambda i: Layer(i, Kind.FULL, ()),
    }
    return group_by_kind("nemotron-3-nano-30b", [mixers[c](i) for i, c in enumerate(pattern)])


def qwen3_next() -> ModelSpec:
    """48 layers, every 4th full attention (2 KV heads of 256); Gated DeltaNet elsewhere
    (16 key heads of 128, 32 value heads of 128, conv kernel 4), all bf16."""
    layers = [
        attention(i, 2, 256) if i % 4 == 3 else gated_deltanet(i, 16, 128, 32, 128, 4)
        for i in range(48)
    ]
    return group_by_kind("qwen3-next-80b-a3b", layers)


def test_hand_built_hybrids_hash_like_their_configs() -> None:
    for spec in (granite_4_h_tiny(), nemotron_3_nano(), qwen3_next()):
        loaded = load_model(spec.name).spec
        assert spec.compat_hash() == loaded.compat_hash(), spec.name
        assert spec.layers == loaded.layers, spec.name
