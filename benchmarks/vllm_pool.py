"""vLLM engines with a small block pool, for ``kvbridge bench vllm --trace``
(:mod:`benchmarks.vllm_trace`), and the block-run figures it reports.

:func:`install_block_recorder` records, in each worker, the block ids of every request
as vLLM's scheduler first sends it; :func:`runs` and :func:`joint_runs` count them.
"""

from __future__ import annotations

from typing import Any


# --- run in every worker (vLLM's collective_rpc) -----------------------------------------
def install_block_recorder(worker: Any) -> bool:
    """Record the block ids (per KV cache group) of every request the worker is first
    scheduled with; :func:`take_blocks` hands them out."""
    runner = worker.model_runner
    if hasattr(runner, "_trace_blocks"):
        return True
    seen: list[list[list[int]]] = []
    real = runner.execute_model

    def recorded(scheduler_output: Any, *args: Any, **kw: Any) -> Any:
        for req in scheduler_output.scheduled_new_reqs:
            seen.append([[int(b) for b in group] for group in req.block_ids])
        return real(scheduler_output, *args, **kw)

    runner.execute_model = recorded
    runner._trace_blocks = seen
    return True


def take_blocks(worker: Any) -> list[list[list[int]]]:
    seen = worker.model_runner._trace_blocks
    out = list(seen)
    seen.clear()
    return out


# --- block runs ---------------------------------------------------------------
def block_groups(groups: list[list[int]]) -> list[list[int]]:
    """The groups that hold more than one block (attention); a state group's single slot
    is one run whatever the pool looks like, and is left out."""
    return [g for g in groups if len(g) > 1]


def runs(groups: list[list[int]]) -> int:
    """Maximal runs of consecutive block ids over the block groups (id 0, vLLM's null
    block, left out)."""
    n = 0
    for ids in block_groups(groups):
        prev = -2
        for b in ids:
            if b and b != prev + 1:
                n += 1
            prev = b if b else -2
    return n


def joint_runs(p: list[list[int]], d: list[list[int]]) -> int:
    """Runs where P's and D's ids both continue by one, position by position over the
    blocks both hold: the fewest whole-block copies per layer that keep token order."""
    n = 0
    for p_ids, d_ids in zip(block_groups(p), block_groups(d), strict=False):
        prev = (-2, -2)
        for a, b in zip(p_ids, d_ids, strict=False):
            if a and b and (a, b) != (prev[0] + 1, prev[1] + 1):
                n += 1
            prev = (a, b) if a and b else (-2, -2)
    return n
