"""Model spec from a Hugging Face ``config.json``.

Two steps, each read generally rather than per checkpoint:

1. the **layer pattern**: what each model layer caches, from whichever format the file
   uses (``layer_types`` lists, ``hybrid_override_pattern`` strings, 1-indexed layer
   lists, ``attn_type_list``, intervals, period/offset, ``no_rope_layers`` for chunked
   attention, a sliding-window pattern, or one kind for all layers);
2. the **mixers**: the per-layer cache of each pattern entry (K/V attention, MLA latent,
   Mamba-1/2, Gated DeltaNet, Kimi Delta Attention state) from the architecture's fields.

Multimodal files keep the language model in ``text_config``; keys a file omits may take
the architecture's class defaults (Gemma-3), recorded in ``ModelInfo.defaults_applied``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.spec.dtypes import DType
from kvbridge.spec.hf_fields import Fields
from kvbridge.spec.hf_mixers import STATE_MIXERS, Dtypes, Mixer, kv_attention, mla_latent
from kvbridge.spec.hf_pattern import BOTH, CHUNKED, FULL, LINEAR, NONE, SLIDING, layer_pattern
from kvbridge.spec.info import ModelInfo, default_groups
from kvbridge.spec.model import Kind, Layer, ModelSpec


@dataclass(frozen=True, slots=True)
class Arch:
    """How one ``model_type`` stores its cache."""

    attention: str = "kv"
    """Global attention layers: ``kv`` (K and V per head) or ``mla`` (one latent)."""
    state: str | None = None
    """State mixer of linear layers (a key of ``STATE_MIXERS``), if the model has any."""
    ssm_dtype: DType | None = None
    """Recurrent-state dtype serving engines use when the config names none."""
    parallel_hybrid: bool = False
    """Every layer runs attention and the state mixer side by side (Falcon-H1)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Class defaults for keys real files omit."""


_GEMMA3_TEXT = {
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}
_MLA = Arch(attention="mla")
_GDN = Arch(state="gdn")

ARCHS: dict[str, Arch] = {
    "llama": Arch(),
    "mistral": Arch(),
    "mixtral": Arch(),
    "qwen2": Arch(),
    "qwen3": Arch(),
    "qwen3_moe": Arch(),
    "minimax_m2": Arch(),
    "gpt_oss": Arch(),
    "gemma3": Arch(defaults=_GEMMA3_TEXT),
    "gemma3_text": Arch(defaults=_GEMMA3_TEXT),
    "llama4": Arch(),
    "llama4_text": Arch(),
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "kimi_k2": _MLA,
    "qwen3_next": _GDN,
    "qwen3_5": _GDN,
    "qwen3_5_text": _GDN,
    "kimi_linear": Arch(attention="mla", state="kda", ssm_dtype=DType.FP32),
    "jamba": Arch(state="mamba1"),
    "nemotron_h": Arch(state="mamba2"),
    "granitemoehybrid": Arch(state="mamba2"),
    "falcon_h1": Arch(state="mamba2", parallel_hybrid=True),
}


def load_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json`` (a directory holding one, or the file)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not JSON ({e})") from None
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
    n = f.req_int("num_hidden_layers")
    pattern = layer_pattern(f, n, arch.parallel_hybrid)
    mixers = _Mixers(f, _dtypes(f, arch, kv_dtype, ssm_dtype), arch, model_type, pattern.source)
    layers: list[Layer] = []
    model_layers: list[int] = []
    for i, entry in enumerate(pattern.entries):
        for mixer in mixers.of(entry, i):
            layers.append(mixer.make(len(layers)) if mixer else Layer(len(layers), Kind.FULL, ()))
            model_layers.append(i)
    spec = ModelSpec(
        name or str(config.get("_name_or_path") or model_type),
        tuple(layers),
        default_groups(layers, block_size),
    )
    return ModelInfo(
        spec,
        f"config.json ({model_type})",
        tuple(model_layers),
        mixers.sharded(),
        dict(f.applied),
    )


def _dtypes(f: Fields, arch: Arch, kv: DType | None, ssm: DType | None) -> Dtypes:
    model = f.dtype("torch_dtype", "dtype") or DType.BF16
    named = f.dtype("mamba_ssm_cache_dtype", "mamba_ssm_dtype")
    return Dtypes(kv=kv or model, conv=model, ssm=ssm or named or arch.ssm_dtype or model)


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


class _Mixers:
    """Builds each entry's mixers once, on first use (unused kinds need no fields)."""

    def __init__(self, f: Fields, dt: Dtypes, arch: Arch, model_type: str, source: str) -> None:
        self._f, self._dt, self._arch = f, dt, arch
        self._model_type, self._source = model_type, source
        self._built: dict[str, Mixer] = {}

    def of(self, entry: str, layer: int) -> list[Mixer | None]:
        """Mixers of one model layer, in spec order; ``None`` for a layer without cache."""
        if entry == NONE:
            return [None]
        if entry == BOTH:
            return [self._get(FULL, layer), self._get(LINEAR, layer)]
        return [self._get(entry, layer)]

    def sharded(self) -> tuple[tuple[str, int], ...]:
        return tuple(dict.fromkeys(s for m in self._built.values() for s in m.sharded))

    def _get(self, entry: str, layer: int) -> Mixer:
        if entry not in self._built:
            self._built[entry] = self._build(entry, layer)
        return self._built[entry]

    def _build(self, entry: str, layer: int) -> Mixer:
        f, dt = self._f, self._dt
        if entry == FULL:
            if self._arch.attention == "mla":
                return mla_latent(f, dt)
            return kv_attention(f, dt, Kind.FULL)
        if entry == SLIDING:
            return kv_attention(f, dt, Kind.SLIDING, window=f.req_int("sliding_window"))
        if entry == CHUNKED:
            return kv_attention(f, dt, Kind.CHUNKED, chunk=f.req_int("attention_chunk_size"))
        if entry == LINEAR and self._arch.state is not None:
            return STATE_MIXERS[self._arch.state](f, dt)
        raise ConfigError(
            f"{self._source}: layer {layer} is a {entry} layer, which model_type "
            f"{self._model_type!r} does not have"
        )
