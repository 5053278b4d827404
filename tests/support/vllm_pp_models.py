"""The models of the PP tests (``tests.support.vllm_pp``): 4 layers of 4 KV heads of 64
(fp32), each layer's vLLM spec on a rank, and the ``hf_config`` vLLM would hold.

``full``: every layer full attention (one KV cache group; no ``hf_config`` needed).
``swa``: gemma-3's pattern, three sliding-window layers then one full (vLLM makes four
groups of one layer: three sliding, one full; each stage of PP 2 holds two of them).
``mamba``: Mamba-2 and full attention alternating (granite-4.0-h's kind; two groups).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

LAYERS, HEADS, HEAD = 4, 4, 64
WINDOW = 64
"""vLLM's sliding window of the ``swa`` layers (tokens, the current one counted)."""
MAMBA = {"heads": 4, "head_dim": 8, "groups": 2, "d_state": 8, "kernel": 4}

KINDS = {
    "full": ("full",) * LAYERS,
    "swa": ("sliding", "sliding", "sliding", "full"),
    "mamba": ("mamba", "full", "mamba", "full"),
}
"""Each layer's kind (Hugging Face's ``layer_types`` spelling, ``full`` for attention)."""


def layer_spec(model: str, i: int, tp: int, block: int, heads: int = HEADS) -> Any:
    """vLLM's spec of layer ``i`` of ``model`` on a rank of ``tp``."""
    kind = KINDS[model][i]
    kv = {"block_size": block, "num_kv_heads": heads // tp, "head_size": HEAD}
    if kind == "sliding":
        return SlidingWindowSpec(**kv, dtype=torch.float32, sliding_window=WINDOW)
    if kind == "mamba":
        return mamba_spec(tp, block, page=block * 2 * HEADS // tp * HEAD * 4)
    return FullAttentionSpec(**kv, dtype=torch.float32)


def mamba_spec(tp: int, block: int, page: int) -> MambaSpec:
    """A Mamba-2 layer's state on a rank of ``tp``, its page padded to ``page`` bytes (as
    vLLM pads it to the attention page)."""
    h, hd, g, ds, k = (MAMBA[x] for x in ("heads", "head_dim", "groups", "d_state", "kernel"))
    conv = (k - 1, (h * hd + 2 * g * ds) // tp)
    return MambaSpec(
        block_size=block,
        shapes=(conv, (h // tp, hd, ds)),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=page,
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )


class HfConfig:
    """What vLLM's ``model_config.hf_config`` gives the connector: ``to_dict()``."""

    def __init__(self, data: dict[str, Any]):
        self.data = data

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


def hf_config(model: str, kinds: tuple[str, ...] | None = None) -> HfConfig | None:
    """The model's ``config.json`` (``kinds``: its ``layer_types`` instead of the model's)."""
    if model == "full":
        return None
    types = [k if k == "mamba" else f"{k}_attention" for k in kinds or KINDS[model]]
    data: dict[str, Any] = {
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD,
        "torch_dtype": "float32",
        "layer_types": types,
    }
    if model == "swa":
        return HfConfig({**data, "model_type": "gemma3_text", "sliding_window": WINDOW})
    h, hd, g, ds, k = (MAMBA[x] for x in ("heads", "head_dim", "groups", "d_state", "kernel"))
    mamba = {"mamba_n_heads": h, "mamba_d_head": hd, "mamba_n_groups": g}
    mamba |= {"mamba_d_state": ds, "mamba_d_conv": k, "hidden_size": 64, "mamba_expand": 2}
    return HfConfig({**data, **mamba, "model_type": "granitemoehybrid"})
