"""Specs from the Hugging Face configs of the catalog match their expected.json,
plan byte-exact through the loopback transport, and bad configs name their field."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from kvbridge import catalog
from kvbridge.errors import ConfigError
from kvbridge.spec import DType, Group, Kind, Parallel, attention
from kvbridge.spec.hf import ARCHS, from_hf_config, load_config
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.model import Layer, ModelSpec
from tests.fixtures import EXPECTED_DIR, MODELS_DIR
from tests.support.scenario import Side, run_scenario

MODELS = (
    "deepseek-v2-lite",
    "deepseek-v3",
    "falcon-h1-7b",
    "gemma-3-4b-it",
    "gpt-oss-20b",
    "granite-4.0-h-tiny",
    "jamba-1.5-mini",
    "kimi-k2",
    "kimi-linear-48b-a3b",
    "llama-3.1-8b",
    "llama-4-scout",
    "minimax-m2",
    "mistral-7b-v0.2",
    "nemotron-3-nano-30b",
    "qwen3-0.6b",
    "qwen3-8b",
    "qwen3-next-80b-a3b",
    "qwen3.5-9b",
)
KINDS = {
    "full_attention": Kind.FULL,
    "sliding_window": Kind.SLIDING,
    "chunked_attention": Kind.CHUNKED,
    "mla": Kind.MLA,
    "linear_state": Kind.STATE,
}


def config(name: str) -> dict[str, Any]:
    return load_config(MODELS_DIR / name)


def expected(name: str) -> dict[str, Any]:
    return json.loads((EXPECTED_DIR / name / "expected.json").read_text())


def derive(name: str, **kw: Any) -> ModelInfo:
    return from_hf_config(config(name), name, **kw)


def layers_of(info: ModelInfo, kind: Kind) -> list[Layer]:
    return [lay for lay in info.spec.layers if lay.kind is kind and lay.streams]


def cached_layers(info: ModelInfo, kind: Kind | None = None) -> set[int]:
    """Model layers holding a cache (of ``kind``, if given; layers without streams: none)."""
    pairs = zip(info.spec.layers, info.model_layers, strict=True)
    return {m for lay, m in pairs if lay.streams and kind in (None, lay.kind)}


def test_every_fixture_is_tested() -> None:
    assert set(catalog.names()) == set(MODELS)
    facts = {p.name for p in EXPECTED_DIR.iterdir() if (p / "expected.json").is_file()}
    assert facts == set(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_layers_by_kind(name: str) -> None:
    info, exp = derive(name), expected(name)
    for key, kind in KINDS.items():
        assert sorted(cached_layers(info, kind)) == exp["layer_indices"][key], key
    cached = cached_layers(info)
    assert [m for m in range(info.num_model_layers) if m not in cached] == exp["no_cache_layers"]
    assert info.num_model_layers == exp["num_hidden_layers"]


@pytest.mark.parametrize("name", MODELS)
def test_bytes_per_token_window_chunk_latent(name: str) -> None:
    info, exp = derive(name), expected(name)
    for key, per_layer in exp["kv_bytes_per_token_per_layer"].items():
        assert {lay.token_bytes for lay in layers_of(info, KINDS[key])} == {per_layer}, key
    totals = exp["totals"]
    spec = info.spec
    assert (
        spec.token_bytes(Kind.FULL) + spec.token_bytes(Kind.MLA)
        == (totals["kv_bytes_per_token_full_and_mla"])
    )
    assert spec.token_bytes(Kind.SLIDING) == totals["kv_bytes_per_token_sliding_window_layers"]
    assert spec.token_bytes(Kind.CHUNKED) == totals["kv_bytes_per_token_chunked_layers"]
    sliding = layers_of(info, Kind.SLIDING)
    assert {lay.window for lay in sliding} == ({exp["sliding_window"]} if sliding else set())
    for lay in sliding:
        s, e = lay.needed_tokens(100_000, 0)
        assert e - s == exp["sliding_window_tokens_needed_for_decode"]
    chunked = layers_of(info, Kind.CHUNKED)
    assert {lay.chunk for lay in chunked} == ({exp["attention_chunk_size"]} if chunked else set())
    for lay in layers_of(info, Kind.MLA):
        (latent,) = lay.streams
        assert latent.replicated
        assert latent.row_bytes // latent.dtype.itemsize == exp["mla_latent_width"]


@pytest.mark.parametrize("name", MODELS)
def test_state_tensors(name: str) -> None:
    info, exp = derive(name), expected(name)
    state_layers = layers_of(info, Kind.STATE)
    assert info.spec.state_bytes == exp["totals"]["state_bytes_per_sequence"]
    if not state_layers:
        assert exp["linear_state"] is None
        return
    tensors = exp["linear_state"]["per_layer_state_tensors"]
    for lay in state_layers:
        got = [(s.name, s.rows * s.row_bytes, str(s.dtype)) for s in lay.streams]
        assert got == [(t["name"], t["bytes"], t["dtype"]) for t in tensors]
        for s, t in zip(lay.streams, tensors, strict=True):
            assert s.rows * s.row_bytes // s.dtype.itemsize == math.prod(t["shape"])


@pytest.mark.parametrize("name", MODELS)
def test_bytes_after_prefill_follow_needed_tokens(name: str) -> None:
    """expected.json: full_and_mla·L + sliding·min(L, W-1) + chunked·(L mod C) + state."""
    info, exp = derive(name), expected(name)
    for length, want in exp["sequence_bytes_after_prefill"]["values"].items():
        n = int(length)
        got = info.spec.state_bytes
        for lay in info.spec.layers:
            if lay.kind is not Kind.STATE:
                s, e = lay.needed_tokens(n, 0)
                got += lay.token_bytes * (e - s)
        assert got == want, length


@pytest.mark.parametrize("name", MODELS)
def test_ssm_dtype_override_gives_the_alternative_total(name: str) -> None:
    exp = expected(name)
    alternatives = exp["state_alternatives"]
    if exp["linear_state"] is None:
        assert not alternatives
        return
    (key,) = [k for k in alternatives if k.startswith("state_bytes_per_sequence_if_recurrent")]
    dtype = DType(key.rsplit("_", 1)[1])
    assert derive(name, ssm_dtype=dtype).spec.state_bytes == alternatives[key]


def test_class_defaults_are_reported() -> None:
    info = derive("gemma-3-4b-it")
    applied = {k.removeprefix("text_config."): v for k, v in info.defaults_applied.items()}
    assert applied == expected("gemma-3-4b-it")["defaults_applied"]


def test_kv_dtype_override_scales_kv_and_latent_only() -> None:
    for name in ("llama-3.1-8b", "deepseek-v3", "nemotron-3-nano-30b"):
        base, fp8 = derive(name), derive(name, kv_dtype=DType.FP8_E4M3)
        for kind in (Kind.FULL, Kind.MLA):
            assert fp8.spec.token_bytes(kind) * 2 == base.spec.token_bytes(kind)
        assert fp8.spec.state_bytes == base.spec.state_bytes


def test_falcon_h1_keeps_a_model_layer_in_one_pp_stage() -> None:
    info = derive("falcon-h1-7b")
    assert info.stages(2) == ((0, 44), (44, 88))
    assert info.stages(3) == ((0, 30), (30, 60), (60, 88))
    assert [info.model_layers[a] for a, _ in info.stages(3)] == [0, 15, 30]


def small_jamba() -> dict[str, Any]:
    """Jamba with hidden_size 256 instead of 4096: the element-wise reference walks every
    Mamba-1 channel (8192 per layer at full size) and would take tens of seconds; the layer
    pattern, heads and state formats are those of the real file."""
    cfg = config("jamba-1.5-mini")
    return {**cfg, "hidden_size": 256}


# (P TP, D TP, P layout, D layout, P block, D block, tokens, cached, state slots)
DIRECTIONS = {
    "1to2": (1, 2, "hnd", "nhd", 4, 8, 13, 0, 2),
    "2to1": (2, 1, "nhd", "block-major", 8, 4, 13, 3, 1),
}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name", MODELS)
def test_plan_is_byte_exact(name: str, direction: str) -> None:
    p_tp, d_tp, p_lay, d_lay, p_bs, d_bs, n, cached, slots = DIRECTIONS[direction]
    cfg = small_jamba() if name == "jamba-1.5-mini" else config(name)
    spec = from_hf_config(cfg, name).spec
    if name == "gpt-oss-20b" and direction == "1to2":
        n = 140  # past the 128-token window: the window's start is clipped
    p_spec, d_spec = spec.with_block_sizes(p_bs), spec.with_block_sizes(d_bs)
    blocks = {g.name: slots if g.name == "state" else -(-n // 4) + 1 for g in spec.groups}
    p = Side(p_spec, Parallel(tp=p_tp), p_lay, blocks)
    d = Side(d_spec, Parallel(tp=d_tp), d_lay, blocks)
    plans = run_scenario(p, d, n, cached, np.random.default_rng(7))
    moved = sum(plan.nbytes for plan in plans.values())
    if d_tp == 1:
        assert moved == needed_bytes(spec, n, cached)
    else:  # units replicated over D ranks count once per receiving rank
        assert moved >= needed_bytes(spec, n, cached)


def needed_bytes(spec: ModelSpec, n: int, cached: int) -> int:
    """Unsharded bytes D needs: each layer's needed tokens, plus every state."""
    total = spec.state_bytes
    for lay in spec.layers:
        if lay.kind is not Kind.STATE:
            s, e = lay.needed_tokens(n, cached)
            total += lay.token_bytes * (e - s)
    return total


def test_reference_skips_layers_without_cache() -> None:
    """A layer with no streams is in no group (Nemotron-H's MLP blocks); the element-wise
    reference used to look its group up and fail with a KeyError."""
    layers = (attention(0, 2, 8), Layer(1, Kind.FULL, ()), attention(2, 2, 8))
    spec = ModelSpec("gap", layers, (Group("attn", (0, 2), 4),))
    side = Side(spec, Parallel(tp=1), "nhd", 4)
    plans = run_scenario(side, Side(spec, Parallel(tp=2), "hnd", 4), 9, 0, np.random.default_rng(1))
    assert sum(p.nbytes for p in plans.values()) == 9 * 2 * spec.layers[0].token_bytes


def cfg_with(name: str, **changes: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(config(name)))
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


BAD_CONFIGS = {
    "missing layers": (cfg_with("llama-3.1-8b", num_hidden_layers=None), "num_hidden_layers"),
    "layers not int": (cfg_with("llama-3.1-8b", num_hidden_layers="32"), "num_hidden_layers"),
    "heads vs kv heads": (cfg_with("llama-3.1-8b", num_key_value_heads=5), "num_key_value_heads"),
    "no head_dim": (cfg_with("llama-3.1-8b", hidden_size=4001), "hidden_size"),
    "unknown type": (cfg_with("llama-3.1-8b", model_type="gpt2"), "supported: deepseek_v2"),
    "no model_type": (cfg_with("llama-3.1-8b", model_type=None), "model_type"),
    "short layer_types": (
        cfg_with("gpt-oss-20b", layer_types=["full_attention"] * 23),
        "layer_types describes 23 layers",
    ),
    "bad layer type": (
        cfg_with("gpt-oss-20b", layer_types=["full_attention"] * 23 + ["global"]),
        "layer_types[23]",
    ),
    "no sliding_window": (cfg_with("gpt-oss-20b", sliding_window=None), "sliding_window"),
    "bad override": (
        cfg_with("nemotron-3-nano-30b", hybrid_override_pattern="M" * 51 + "X"),
        "hybrid_override_pattern[51]",
    ),
    "short override": (
        cfg_with("nemotron-3-nano-30b", hybrid_override_pattern="M*"),
        "hybrid_override_pattern describes 2 layers",
    ),
    "no mamba head dim": (cfg_with("nemotron-3-nano-30b", mamba_head_dim=None), "mamba_head_dim"),
    "no kv_lora_rank": (cfg_with("deepseek-v3", kv_lora_rank=None), "kv_lora_rank"),
    "no gdn heads": (
        cfg_with("qwen3-next-80b-a3b", linear_num_key_heads=None),
        "linear_num_key_heads",
    ),
    "jamba offset": (cfg_with("jamba-1.5-mini", attn_layer_offset=9), "attn_layer_offset"),
    "falcon d_ssm": (cfg_with("falcon-h1-7b", mamba_d_ssm=4096), "mamba_d_ssm"),
    "no_rope flags": (
        {
            **config("llama-4-scout"),
            "text_config": {**config("llama-4-scout")["text_config"], "no_rope_layers": [2] * 48},
        },
        "text_config.no_rope_layers[0]",
    ),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config_names_the_field(case: str) -> None:
    cfg, needle = BAD_CONFIGS[case]
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        from_hf_config(cfg)


def kimi_lists(full: list[int], kda: list[int]) -> dict[str, Any]:
    cfg = config("kimi-linear-48b-a3b")
    lin = {**cfg["linear_attn_config"], "full_attn_layers": full, "kda_layers": kda}
    return {**cfg, "linear_attn_config": lin}


def test_kimi_layer_lists_must_partition_the_layers() -> None:
    kda = expected("kimi-linear-48b-a3b")["layer_indices"]["linear_state"]
    full = [i + 1 for i in expected("kimi-linear-48b-a3b")["layer_indices"]["mla"]]
    kda1 = [i + 1 for i in kda]
    with pytest.raises(ConfigError, match=r"kda_layers\[0\]: layer 1 \(1-indexed\) is listed"):
        from_hf_config(kimi_lists([*full, 1], kda1))
    with pytest.raises(ConfigError, match=r"leave layers \[1\]"):
        from_hf_config(kimi_lists(full, kda1[1:]))
    with pytest.raises(ConfigError, match=r"full_attn_layers\[0\]: 0 < 1"):
        from_hf_config(kimi_lists([0, *full], kda1))


def test_tp_that_does_not_split_names_the_field() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads=8 cannot be split over TP 3"):
        derive("llama-3.1-8b").check_tp(3)
    with pytest.raises(ConfigError, match="linear_num_key_heads=16 cannot be split over TP 6"):
        derive("qwen3-next-80b-a3b").check_tp(6)
    derive("deepseek-v3").check_tp(6)  # MLA latents are replicated: any TP
    derive("llama-3.1-8b").check_tp(16)  # 8 KV heads, each on 2 of 16 ranks


def test_every_architecture_is_listed_in_the_error() -> None:
    with pytest.raises(ConfigError) as e:
        from_hf_config({"model_type": "rwkv", "num_hidden_layers": 2})
    assert all(arch in str(e.value) for arch in ARCHS)


WHOLE_MESSAGES = {
    "bad layer type": (
        BAD_CONFIGS["bad layer type"][0],
        "layer_types[23]: unknown layer type 'global'; known: full_attention, attention, "
        "sliding_attention, chunked_attention, linear_attention, mamba",
    ),
    "bad override": (
        BAD_CONFIGS["bad override"][0],
        "hybrid_override_pattern[51]: unknown block 'X'; known: M * - E",
    ),
    "layer_types not a list": (
        cfg_with("gpt-oss-20b", layer_types="full_attention"),
        "layer_types: expected a list, got 'full_attention'",
    ),
    "override not a string": (
        cfg_with("nemotron-3-nano-30b", hybrid_override_pattern=["M"]),
        "hybrid_override_pattern: expected a string, got ['M']",
    ),
    "linear_attn_config not an object": (
        cfg_with("kimi-linear-48b-a3b", linear_attn_config=[1]),
        "linear_attn_config: expected an object, got [1]",
    ),
}


@pytest.mark.parametrize("case", WHOLE_MESSAGES)
def test_a_bad_field_of_a_config_gets_its_whole_message(case: str) -> None:
    cfg, message = WHOLE_MESSAGES[case]
    with pytest.raises(ConfigError) as e:
        from_hf_config(cfg)
    assert str(e.value) == message
