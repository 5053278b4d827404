"""Parking in real vLLM (integrations/vllm/park.py) on the shared llama P of block 32,
whose park holds 16 blocks (conftest's ``llama_pair``; the other modules' tests with it
as P run partly parked too, and test_tp_models.py / test_hybrid_state.py park Qwen3,
Gemma-3's windows and Granite's Mamba slots): vLLM holds no parked request (its loop
steps only while it holds one; ``benchmarks/vllm_idle.py`` measures the CPU), requests
beyond the park's slots are served from vLLM's blocks, all token-exact against a
colocated run, counted, and the slots come back for the next batch. That D reads the
park, not vLLM's reused blocks, is proven where P's caches are rewritten after the copy:
``tests/integration/test_vllm_pp_processes.py`` (``park-…``) and gpu-check's vLLM-caches
phase."""

from __future__ import annotations

import time

import pytest

from tests.support.vllm_harness import Engine, connector_totals
from tests.vllm_engines.conftest import handle_of, prompts

pytestmark = pytest.mark.vllm

SLOTS = 16
"""Usable blocks of the block-32 llama's park (``park_blocks`` 17)."""


def settled(p: Engine, done: int) -> bool:
    """Step ``p`` (its engine core steps only inside a call) until vLLM holds no request,
    ``done`` leases (parked or not) ended and the park is whole again: D's confirmations
    may reach P just after D's call returned."""
    for _ in range(50):
        p.generate(prompts(10, (40,)), 1)
        ended = p.rpc(connector_totals)[0].get("leases_done", 0)
        if p.scheduler_requests() == 0 and ended >= done and p.park_free() == SLOTS:
            return True
        time.sleep(0.1)
    return False


def test_parked_and_held_requests_are_token_exact_and_counted(
    llama_pair: tuple[Engine, ...],
) -> None:
    """Six requests of 4 blocks in one batch: the park holds 4 (vLLM keeps none of them),
    the other 2 are served from vLLM's blocks (their handles name P itself, vLLM holds
    them until D confirmed), all token-exact; then the slots are back for the next batch,
    parked whole (a 37-token prompt: 2 blocks)."""
    p, d = llama_pair  # D's blocks of 128: not P's park's layout
    assert settled(p, 0)  # earlier modules' leases ended
    for seed, n in ((8, 6), (9, 4)):
        batch = prompts(seed, (120,) * (n - 1) + (37,))
        ref = [o.tokens for o in p.generate(batch, 16)]
        before = p.rpc(connector_totals)[0]
        pre = p.generate(batch, 1, [{"do_remote_decode": True}] * n)
        held = n - 4 if n > 4 else 0
        served = sorted(handle_of(o.kv_transfer_params).engine_id for o in pre)
        assert served == ["llama-b32"] * held + ["llama-b32.park"] * (n - held)
        assert p.scheduler_requests() == held
        out = d.generate(batch, 16, [o.kv_transfer_params for o in pre])
        assert [o.tokens for o in out] == ref
        assert settled(p, before.get("leases_done", 0) + n)  # D confirmed every one
        after = p.rpc(connector_totals)[0]
        counted = {k: after.get(k, 0) - before.get(k, 0) for k in ("park_parked", "park_held")}
        assert counted == {"park_parked": n - held, "park_held": held}
