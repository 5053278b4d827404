"""The per-layer caches of Hugging Face architectures ("mixers"), read from config fields.

A mixer builds the spec :class:`Layer` of one model layer and names the config fields
whose units are split over TP (so a bad TP is reported by field name). State tensors are
rows × row, built by :mod:`kvbridge.spec.build` (one builder per cache kind, so a spec
loaded here and one an engine builds by hand hash alike); the row is a concatenation of
segments, each sharded over TP on its own:

    mamba2  conv_state       [d_conv-1, x|B|C]   x: heads × head_dim, B, C: n_groups × d_state
            ssm_state        [heads, head_dim, d_state]     1 row: heads × (head_dim·d_state)
    mamba1  conv_state       [d_conv-1, d_inner]            d_inner channels × 1
            ssm_state        [d_inner, d_state]             1 row: d_inner × d_state
    gdn     conv_state       [kernel-1, q|k|v]   q, k: k_heads × k_dim, v: v_heads × v_dim
            recurrent_state  [v_heads, k_dim, v_dim]        1 row: v_heads × (k_dim·v_dim)
    kda     conv_state_{q,k,v} [kernel-1, heads·head_dim]   heads × head_dim each
            recurrent_state  [heads, head_dim, head_dim]    1 row: heads × head_dim²
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.spec import build
from kvbridge.spec.dtypes import DType
from kvbridge.spec.hf_fields import Fields
from kvbridge.spec.model import Kind, Layer

Sharded = tuple[tuple[str, int], ...]
"""``(config field, units)`` pairs whose units are split over TP."""


@dataclass(frozen=True, slots=True)
class Dtypes:
    kv: DType
    """K/V and MLA latents."""
    conv: DType
    ssm: DType
    """Recurrent / SSM state."""


@dataclass(frozen=True, slots=True)
class Mixer:
    make: Callable[[int], Layer]
    """Spec layer at a spec index."""
    sharded: Sharded


def kv_attention(f: Fields, dt: Dtypes, kind: Kind, window: int = 0, chunk: int = 0) -> Mixer:
    """K and V of ``num_key_value_heads`` heads of ``head_dim`` (or hidden/heads)."""
    heads = f.req_int("num_attention_heads")
    kv_heads = f.opt_int("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ConfigError(
            f"{f.path('num_attention_heads')}={heads} is not a multiple of "
            f"{f.path('num_key_value_heads')}={kv_heads}"
        )
    head_dim = f.opt_int("head_dim") or _head_dim(f, heads)

    def make(i: int) -> Layer:
        return build.attention(i, kv_heads, head_dim, dt.kv, kind, window=window, chunk=chunk)

    return Mixer(make, ((f.path("num_key_value_heads"), kv_heads),))


def _head_dim(f: Fields, heads: int) -> int:
    hidden = f.req_int("hidden_size")
    if hidden % heads:
        raise ConfigError(
            f"{f.path('head_dim')}: missing, and {f.path('hidden_size')}={hidden} is not "
            f"a multiple of {f.path('num_attention_heads')}={heads}"
        )
    return hidden // heads


def mla_latent(f: Fields, dt: Dtypes) -> Mixer:
    """One latent of ``kv_lora_rank + qk_rope_head_dim`` per token, replicated over TP."""
    width = f.req_int("kv_lora_rank") + f.req_int("qk_rope_head_dim")
    return Mixer(lambda i: build.mla(i, width, dt.kv), ())


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

    def make(i: int) -> Layer:
        return build.mamba2(i, heads, head_dim, groups, d_state, d_conv, dt.conv, dt.ssm)

    return Mixer(make, ((f.path(heads_key), heads), (f.path(groups_key), groups)))


def mamba1(f: Fields, dt: Dtypes) -> Mixer:
    d_inner = f.req_int("mamba_expand") * f.req_int("hidden_size")
    d_state = f.req_int("mamba_d_state")
    d_conv = f.req_int("mamba_d_conv")

    def make(i: int) -> Layer:
        return build.mamba1(i, d_inner, d_state, d_conv, dt.conv, dt.ssm)

    field = f"{f.path('mamba_expand')} × {f.path('hidden_size')}"
    return Mixer(make, ((field, d_inner),))


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

    def make(i: int) -> Layer:
        return build.gated_deltanet(i, k_heads, k_dim, v_heads, v_dim, kernel, dt.conv, dt.ssm)

    sharded = (
        (f.path("linear_num_key_heads"), k_heads),
        (f.path("linear_num_value_heads"), v_heads),
    )
    return Mixer(make, sharded)


def kimi_delta(f: Fields, dt: Dtypes) -> Mixer:
    """Kimi Delta Attention: short convs of q, k, v and a ``[heads, d, d]`` state."""
    lin = f.section("linear_attn_config")
    heads = lin.req_int("num_heads")
    head_dim = lin.req_int("head_dim")
    kernel = lin.req_int("short_conv_kernel_size")

    def make(i: int) -> Layer:
        return build.kimi_delta(i, heads, head_dim, kernel, dt.conv, dt.ssm)

    return Mixer(make, ((lin.path("num_heads"), heads),))


def _spelling(f: Fields, *keys: str) -> str:
    """The key a file uses for a field spelled several ways (the first if none)."""
    return next((k for k in keys if f.has(k)), keys[0])


STATE_MIXERS: dict[str, Callable[[Fields, Dtypes], Mixer]] = {
    "mamba1": mamba1,
    "mamba2": mamba2,
    "gdn": gated_deltanet,
    "kda": kimi_delta,
}
