"""Test-only calls for :meth:`Engine.rpc` (run in each vLLM worker): noise over P's
KV cache or state, for the scrambled-P controls. Passed by reference, so this module
must import in the engine's processes (``tests`` is on their path: spawn copies it)."""

from __future__ import annotations

from typing import Any


def scramble_cache(worker: Any) -> int:
    """For :meth:`Engine.rpc`: overwrite every KV tensor of one vLLM worker with noise,
    and the connector's park, if P has one (where parked requests' KV waits)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    n = 0
    seen: set[int] = set()
    for t in worker.model_runner.kv_caches:
        for x in t if isinstance(t, (list, tuple)) else [t]:
            ptr = x.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                x.normal_()
                n += 1
    side = get_kv_transfer_group().worker
    for raw in side.park.dst if side is not None and side.park is not None else ():
        raw.random_(0, 256)
        n += 1
    return n


def scramble_state(worker: Any, blocks: list[int]) -> tuple[int, int]:
    """For :meth:`Engine.rpc` (through ``functools.partial``): overwrite the Mamba /
    linear-attention state (conv and SSM tensors) in vLLM blocks ``blocks`` of one worker
    with noise. Layers of different groups alias one buffer in vLLM's hybrid allocator, so
    only blocks that a state group owns may be named: attention blocks keep their bytes.
    Returns (state layers, distinct buffers) touched."""
    import torch

    layers, seen = 0, set()
    idx = torch.tensor(sorted(set(blocks)), dtype=torch.long)
    for layer in worker.model_runner.compilation_config.static_forward_context.values():
        kv = getattr(layer, "kv_cache", None)
        flat: list[Any] = []
        for x in kv if isinstance(kv, (list, tuple)) else []:
            flat += list(x) if isinstance(x, (list, tuple)) else [x]
        if len(flat) < 2:  # attention layers hold one tensor; state layers conv + SSM
            continue
        layers += 1
        for x in flat:
            seen.add(x.untyped_storage().data_ptr())
            x[idx] = torch.randn(x[idx].shape, dtype=torch.float32).to(x.dtype)
    return layers, len(seen)
