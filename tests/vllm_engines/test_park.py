"""Parking in real vLLM (integrations/vllm/park.py), beside the parked P engines of
test_tp_models.py (Qwen3, Gemma-3's sliding windows) and test_hybrid_state.py (Granite's
Mamba slots): a llama P with a park of 17 blocks and a pool of 33 (one prompt of 1000
tokens takes all 32 usable). vLLM holds no finished request (it would idle: its loop
steps only while it holds one; ``benchmarks/vllm_idle.py`` measures the CPU), requests
beyond the park's slots are served from vLLM's blocks, all token-exact against a
colocated run, also after vLLM reused every freed block before D read."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.vllm_harness import Engine, connector_totals
from tests.vllm_engines.conftest import closing, handle_of, prompts, release_at_p, start

pytestmark = pytest.mark.vllm

PARK = 17
"""vLLM blocks of P's park (16 usable): 4 requests of ≤ 4 blocks of 32 tokens fit."""


@pytest.fixture(scope="module")
def parked_p(models: Path) -> Iterator[Engine]:
    p = start(
        models, "llama", "llama-park", block_size=32, cpus="0", num_blocks=33,
        extra={"park_blocks": PARK},
    )  # fmt: skip
    yield from (e for (e,) in closing(p))


def drained(p: Engine, done: int) -> bool:
    """Step ``p`` (its engine core steps only inside a call) until vLLM holds no request
    and ``done`` leases (parked or not) ended since: D's confirmations may reach P just
    after D's call returned."""
    for _ in range(50):
        p.generate(prompts(10, (40,)), 1)
        if p.scheduler_requests() == 0 and p.rpc(connector_totals)[0].get("leases_done", 0) >= done:
            return True
        time.sleep(0.1)
    return False


def served_by(pre: list) -> list[str]:
    return sorted(handle_of(o.kv_transfer_params).engine_id for o in pre)


def test_parked_and_held_requests_are_token_exact_and_counted(
    parked_p: Engine, llama_pair: tuple[Engine, ...]
) -> None:
    """Six requests of 4 blocks in one batch: the park holds 4 (vLLM keeps none of them),
    the other 2 are served from vLLM's blocks (their handles name P itself, vLLM holds
    them until D confirmed), all token-exact; then the 4 slots of each are back for the
    next batch, parked whole (a 37-token prompt: 2 blocks)."""
    d = llama_pair[1]  # blocks of 128: not P's park's layout
    for seed, n in ((8, 6), (9, 4)):
        batch = prompts(seed, (120,) * (n - 1) + (37,))
        ref = [o.tokens for o in parked_p.generate(batch, 16)]
        before = parked_p.rpc(connector_totals)[0]
        pre = parked_p.generate(batch, 1, [{"do_remote_decode": True}] * n)
        held = n - 4 if n > 4 else 0
        assert served_by(pre) == ["llama-park"] * held + ["llama-park.park"] * (n - held)
        assert parked_p.scheduler_requests() == held
        out = d.generate(batch, 16, [o.kv_transfer_params for o in pre])
        assert [o.tokens for o in out] == ref
        done = before.get("leases_done", 0) + n  # D confirmed every one
        assert drained(parked_p, done)  # the held ones freed; counts at the workers
        after = parked_p.rpc(connector_totals)[0]
        counted = {k: after.get(k, 0) - before.get(k, 0) for k in ("park_parked", "park_held")}
        assert counted == {"park_parked": n - held, "park_held": held}


def test_a_parked_request_survives_vllm_reusing_its_blocks(
    parked_p: Engine, llama_pair: tuple[Engine, ...]
) -> None:
    """After P's prefill a 1000-token prompt takes all 32 usable blocks of P's pool, the
    freed blocks of the parked requests included; D then reads the park: its tokens are
    the colocated ones (a park that copied nothing fails here, as measured)."""
    d = llama_pair[1]
    batch = prompts(11, (100, 65))
    ref = [o.tokens for o in parked_p.generate(batch, 16)]
    assert parked_p.reset_prefix_cache()
    pre = parked_p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    try:
        assert served_by(pre) == ["llama-park.park"] * 2
        assert parked_p.scheduler_requests() == 0
        parked_p.generate(prompts(12, (1000,)), 1)  # every block of the pool rewritten
        out = d.generate(batch, 16, [o.kv_transfer_params for o in pre])
        assert [o.tokens for o in out] == ref
    except BaseException:
        release_at_p([o.kv_transfer_params for o in pre])
        raise
