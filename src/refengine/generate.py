"""Colocated greedy generation: prefill then decode on one instance."""

from __future__ import annotations

from collections.abc import Sequence

from refengine.config import ModelConfig
from refengine.instance import Instance
from refengine.tokenizer import encode


def generate(
    model: str | ModelConfig,
    prompt: str | Sequence[int],
    tp: int = 1,
    n_new_tokens: int = 16,
    layout: str = "nhd",
    block_size: int = 16,
    processes: bool | None = None,
    pp: int = 1,
) -> list[int]:
    """``n_new_tokens`` greedy tokens after ``prompt`` (text is byte-encoded after BOS)."""
    tokens = encode(prompt) if isinstance(prompt, str) else list(prompt)
    with Instance(model, tp, block_size, layout, processes=processes, pp=pp) as inst:
        first = inst.prefill("generate", tokens).first_token
        return [first, *inst.decode("generate", n_new_tokens - 1)]
