"""Model spec from a Hugging Face ``config.json`` (``docs/spec-file.md``).

Two steps, each read generally rather than per checkpoint: the layer pattern
(:mod:`kvbridge.spec.hf_pattern`: what each model layer caches), then the mixers (the
per-layer cache of each pattern entry, from the architecture's fields, built with
:mod:`kvbridge.spec.build` so a spec loaded here and one built by hand hash alike).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.spec import build
from kvbridge.spec.dtypes import DType
from kvbridge.spec.hf_fields import Fields
from kvbridge.spec.hf_pattern import BOTH, CHUNKED, FULL, LINEAR, NONE, SLIDING, layer_pattern
from kvbridge.spec.info import ModelInfo, default_groups
from kvbridge.spec.model import Kind, Layer, ModelSpec

Sharded = tuple[tuple[str, int], ...]
"""``(config field, units)`` pairs whose units are split over TP."""

Mixer = tuple[Layer, Sharded]
"""The cache of one model layer (a spec layer at index 0) and the fields it splits."""


@dataclass(frozen=True, slots=True)
class Arch:
    """How one ``model_type`` stores its cache: global attention as ``kv`` (K and V per
    head) or ``mla`` (one latent); the state mixer of its linear layers; the
    recurrent-state dtype serving engines use when the config names none; whether every
    layer runs attention and the state mixer side by side (Falcon-H1); class defaults for
    keys real files omit."""

    attention: str = "kv"
    state: Callable[[Fields, Dtypes], Mixer] | None = None
    ssm_dtype: DType | None = None
    parallel_hybrid: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Dtypes:
    """Of K/V and MLA latents, of conv state, of recurrent / SSM state."""

    kv: DType
    conv: DType
    ssm: DType


def load_config(path: str | Path) -> dict[str, Any]:
    """The object of a ``config.json`` (a directory holding one, or the file) or of a
    spec file (``.toml``, or JSON)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    toml = p.suffix == ".toml"
    try:
        text = p.read_text()
        data = tomllib.loads(text) if toml else json.loads(text)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not {'TOML' if toml else 'JSON'} ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object, got {type(data).__name__}")
    return data


def from_hf_config(
    config: Mapping[str, Any],
    name: str | None = None,
    kv_dtype: DType | None = None,
    ssm_dtype: DType | None = None,
    block_size: int = 16,
) -> ModelInfo:
    """The spec of a Hugging Face config (one group per needed-range kind).

    ``kv_dtype`` overrides the K/V and MLA dtype (default: the model dtype, else bf16);
    ``ssm_dtype`` the recurrent/SSM state dtype (default: the config's
    ``mamba_ssm_cache_dtype``/``mamba_ssm_dtype``, else the architecture's, else the
    model dtype). Raises :class:`ConfigError` naming the offending field.
    """
    model_type, arch, f = _section(config)
    pattern = layer_pattern(f, f.req_int("num_hidden_layers"), arch.parallel_hybrid)
    model = f.dtype("torch_dtype", "dtype") or DType.BF16
    named = f.dtype("mamba_ssm_cache_dtype", "mamba_ssm_dtype")
    dt = Dtypes(kv_dtype or model, model, ssm_dtype or named or arch.ssm_dtype or model)
    mixers: dict[str, Mixer] = {}  # built on first use: kinds a model lacks need no fields
    layers: list[Layer] = []
    model_layers: list[int] = []
    for i, entry in enumerate(pattern.entries):
        for part in (FULL, LINEAR) if entry == BOTH else (entry,):
            if part not in mixers:
                mixer = _mixer(part, f, dt, arch)
                if mixer is None:
                    raise ConfigError(
                        f"{pattern.source}: layer {i} is a {part} layer, which model_type "
                        f"{model_type!r} does not have"
                    )
                mixers[part] = mixer
            layers.append(replace(mixers[part][0], index=len(layers)))
            model_layers.append(i)
    spec = ModelSpec(
        name or str(config.get("_name_or_path") or model_type),
        tuple(layers),
        default_groups(layers, block_size),
    )
    sharded = tuple(dict.fromkeys(s for _, fields in mixers.values() for s in fields))
    return ModelInfo(
        spec, f"config.json ({model_type})", tuple(model_layers), sharded, dict(f.applied)
    )


def _section(config: Mapping[str, Any]) -> tuple[str, Arch, Fields]:
    """``(model_type, arch, KV section)``; ``text_config`` when the file nests one."""
    top = Fields(config)
    model_type = top.text("model_type")
    text = config.get("text_config")
    if isinstance(text, Mapping):
        inner = text.get("model_type")
        key = inner if isinstance(inner, str) and inner in ARCHS else model_type
        arch = _arch(key)
        return key, arch, Fields(text, "text_config.", arch.defaults, outer=top)
    arch = _arch(model_type)
    return model_type, arch, Fields(config, "", arch.defaults)


def _arch(model_type: str) -> Arch:
    try:
        return ARCHS[model_type]
    except KeyError:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ARCHS))}"
        ) from None


def _mixer(entry: str, f: Fields, dt: Dtypes, arch: Arch) -> Mixer | None:
    """The mixer of a pattern entry; ``None`` if the architecture has none."""
    if entry == NONE:
        return Layer(0, Kind.FULL, ()), ()
    if entry == FULL:
        if arch.attention == "mla":
            return mla_latent(f, dt)
        return kv_attention(f, dt, Kind.FULL)
    if entry == SLIDING:
        return kv_attention(f, dt, Kind.SLIDING, window=f.req_int("sliding_window"))
    if entry == CHUNKED:
        return kv_attention(f, dt, Kind.CHUNKED, chunk=f.req_int("attention_chunk_size"))
    if entry == LINEAR and arch.state is not None:
        return arch.state(f, dt)
    return None


def kv_attention(f: Fields, dt: Dtypes, kind: Kind, window: int = 0, chunk: int = 0) -> Mixer:
    """K and V of ``num_key_value_heads`` heads of ``head_dim`` (or hidden/heads)."""
    heads = f.req_int("num_attention_heads")
    kv_heads = f.opt_int("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ConfigError(
            f"{f.path('num_attention_heads')}={heads} is not a multiple of "
            f"{f.path('num_key_value_heads')}={kv_heads}"
        )
    head_dim = f.opt_int("head_dim")
    if head_dim is None:
        hidden = f.req_int("hidden_size")
        if hidden % heads:
            raise ConfigError(
                f"{f.path('head_dim')}: missing, and {f.path('hidden_size')}={hidden} is not "
                f"a multiple of {f.path('num_attention_heads')}={heads}"
            )
        head_dim = hidden // heads
    layer = build.attention(0, kv_heads, head_dim, dt.kv, kind, window=window, chunk=chunk)
    return layer, ((f.path("num_key_value_heads"), kv_heads),)


def mla_latent(f: Fields, dt: Dtypes) -> Mixer:
    """One latent of ``kv_lora_rank + qk_rope_head_dim`` per token, replicated over TP."""
    width = f.req_int("kv_lora_rank") + f.req_int("qk_rope_head_dim")
    return build.mla(0, width, dt.kv), ()


def mamba2(f: Fields, dt: Dtypes) -> Mixer:
    heads_key = _spelling(f, "mamba_num_heads", "mamba_n_heads")
    heads = f.req_int(heads_key)
    head_dim = f.first_int("mamba_head_dim", "mamba_d_head")
    groups_key = _spelling(f, "n_groups", "mamba_n_groups")
    groups = f.req_int(groups_key)
    d_state = f.first_int("ssm_state_size", "mamba_d_state", "state_size")
    d_conv = f.first_int("conv_kernel", "mamba_d_conv")
    d_ssm = f.opt_int("mamba_d_ssm")
    if d_ssm is not None and d_ssm != heads * head_dim:
        raise ConfigError(
            f"{f.path('mamba_d_ssm')}={d_ssm} != {f.path(heads_key)} × head dim "
            f"= {heads} × {head_dim}"
        )
    if heads % groups:
        raise ConfigError(
            f"{f.path(heads_key)}={heads} is not a multiple of {f.path(groups_key)}={groups}"
        )
    layer = build.mamba2(0, heads, head_dim, groups, d_state, d_conv, dt.conv, dt.ssm)
    return layer, ((f.path(heads_key), heads), (f.path(groups_key), groups))


def mamba1(f: Fields, dt: Dtypes) -> Mixer:
    d_inner = f.req_int("mamba_expand") * f.req_int("hidden_size")
    layer = build.mamba1(
        0, d_inner, f.req_int("mamba_d_state"), f.req_int("mamba_d_conv"), dt.conv, dt.ssm
    )
    return layer, ((f"{f.path('mamba_expand')} × {f.path('hidden_size')}", d_inner),)


def gated_deltanet(f: Fields, dt: Dtypes) -> Mixer:
    kernel = f.req_int("linear_conv_kernel_dim")
    k_heads = f.req_int("linear_num_key_heads")
    k_dim = f.req_int("linear_key_head_dim")
    v_heads = f.req_int("linear_num_value_heads")
    v_dim = f.req_int("linear_value_head_dim")
    if v_heads % k_heads:
        raise ConfigError(
            f"{f.path('linear_num_value_heads')}={v_heads} is not a multiple of "
            f"{f.path('linear_num_key_heads')}={k_heads}"
        )
    layer = build.gated_deltanet(0, k_heads, k_dim, v_heads, v_dim, kernel, dt.conv, dt.ssm)
    sharded = (
        (f.path("linear_num_key_heads"), k_heads),
        (f.path("linear_num_value_heads"), v_heads),
    )
    return layer, sharded


def kimi_delta(f: Fields, dt: Dtypes) -> Mixer:
    """Kimi Delta Attention: short convs of q, k, v and a ``[heads, d, d]`` state."""
    lin = f.section("linear_attn_config")
    heads = lin.req_int("num_heads")
    head_dim = lin.req_int("head_dim")
    kernel = lin.req_int("short_conv_kernel_size")
    layer = build.kimi_delta(0, heads, head_dim, kernel, dt.conv, dt.ssm)
    return layer, ((lin.path("num_heads"), heads),)


def _spelling(f: Fields, *keys: str) -> str:
    """The key a file uses for a field spelled several ways (the first if none)."""
    return next((k for k in keys if f.has(k)), keys[0])


_GEMMA3_TEXT = {
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}
_KV_ONLY = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "minimax_m2", "gpt_oss")

ARCHS: dict[str, Arch] = {
    **dict.fromkeys(_KV_ONLY, Arch()),
    **dict.fromkeys(("gemma3", "gemma3_text"), Arch(defaults=_GEMMA3_TEXT)),
    **dict.fromkeys(("llama4", "llama4_text"), Arch()),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "kimi_k2"), Arch(attention="mla")),
    **dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_text"), Arch(state=gated_deltanet)),
    "kimi_linear": Arch(attention="mla", state=kimi_delta, ssm_dtype=DType.FP32),
    "jamba": Arch(state=mamba1),
    "nemotron_h": Arch(state=mamba2),
    "granitemoehybrid": Arch(state=mamba2),
    "falcon_h1": Arch(state=mamba2, parallel_hybrid=True),
}
