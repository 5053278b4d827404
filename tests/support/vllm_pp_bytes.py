"""What the PP process tests (``tests.support.vllm_pp``) write into vLLM's caches and
read back out of them, each the way vLLM itself keeps them: attention K and V per token
(vLLM's CPU kernels' layout, or the logical view), and a Mamba layer's conv and SSM
state per slot, split out of its page as vLLM's layer binds it
(``MambaBase.bind_kv_cache``), independently of kvbridge's own description."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.model_executor.layers.mamba.abstract import MambaBase

from tests.support.vllm_pp_models import HEAD, MAMBA


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    """Every element of every cache tensor: random normal values of generator ``seed``
    (a Mamba layer's int8 page view: fp32 values, so that no byte pattern is a NaN)."""
    gen = torch.Generator().manual_seed(seed)
    for t in caches.values():
        x = t.view(torch.float32) if t.dtype == torch.int8 else t
        x.copy_(torch.randn(x.shape, generator=gen, dtype=x.dtype))


def kv_of(
    cache: np.ndarray, ids: list[int], block: int, n: int, backend: str = "CPU_ATTN"
) -> tuple[np.ndarray, ...]:
    """K and V ``[tokens, heads, head]`` of the first ``n`` tokens in blocks ``ids`` of one
    layer's cache ``[blocks, heads, block, 2·head]`` (vLLM's logical view). ``CPU_ATTN``
    reads it as vLLM's CPU kernels keep it (per block and head: K ``[head][token]``, then V
    ``[token][head]``); other backends as the view says (per token: K then V)."""
    nb, heads = cache.shape[:2]
    if backend == "CPU_ATTN":
        flat = cache.reshape(nb, heads, 2 * block * HEAD)
        k = flat[:, :, : block * HEAD].reshape(nb, heads, HEAD, block).transpose(0, 3, 1, 2)
        v = flat[:, :, block * HEAD :].reshape(nb, heads, block, HEAD).transpose(0, 2, 1, 3)
    else:
        k = cache[..., :HEAD].transpose(0, 2, 1, 3)
        v = cache[..., HEAD:].transpose(0, 2, 1, 3)
    idx = np.asarray(ids)
    tok = np.arange(n)
    return k[idx[tok // block], tok % block], v[idx[tok // block], tok % block]


def state_of(cache: np.ndarray, spec: Any) -> tuple[np.ndarray, np.ndarray]:
    """Conv ``[slots, kernel - 1, channels]`` and SSM ``[slots, heads, head_dim, d_state]``
    (fp32) of one Mamba layer's cache, vLLM's int8 page view ``[slots, 1, 1, bytes]`` as
    ``allocate_kv_cache`` makes it, split by vLLM's own ``MambaBase.bind_kv_cache`` with
    the rank's ``MambaSpec`` ``spec``."""
    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer, torch.from_numpy(cache))  # type: ignore[arg-type]
    conv, ssm = layer.kv_cache
    return conv.numpy(), ssm.numpy()


def conv_channels(tp: int, rank: int) -> np.ndarray:
    """The model's conv channels TP rank ``rank`` of ``tp`` holds, in its order: its shard
    of each of ``x | B | C``, side by side (Mamba-2's conv, each segment split alone)."""
    h, hd, g, ds = (MAMBA[x] for x in ("heads", "head_dim", "groups", "d_state"))
    widths = (h * hd, g * ds, g * ds)
    starts = np.cumsum((0, *widths[:-1]))
    return np.concatenate(
        [a + rank * (w // tp) + np.arange(w // tp) for a, w in zip(starts, widths, strict=True)]
    )


def ssm_heads(tp: int, rank: int) -> np.ndarray:
    """The model's SSM heads TP rank ``rank`` of ``tp`` holds."""
    per = MAMBA["heads"] // tp
    return rank * per + np.arange(per)
