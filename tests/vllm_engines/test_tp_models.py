"""Different TP on P and D (2 → 1, 1 → 2), and other models: Qwen3 (full attention) and
Gemma-3 (sliding window + full attention: four KV cache groups), token for token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.vllm_harness import Engine, connector_totals
from tests.vllm_engines.conftest import closing, handle_of, pd, prompts, start, start_all

pytestmark = pytest.mark.vllm

PARK = {"park_blocks": 128}


@pytest.fixture(scope="module")
def tp_engines(models: Path, llama_pair: tuple[Engine, ...]) -> Iterator[tuple[Engine, ...]]:
    two = start(models, "llama", "llama-tp2", tp=2, block_size=64, cpus="0|1")
    for (two_,) in closing(two):
        yield llama_pair[0], two_


@pytest.mark.parametrize("direction", ["tp2->tp1", "tp1->tp2"])
def test_tp_token_exact(tp_engines: tuple[Engine, ...], direction: str) -> None:
    one, two = tp_engines
    p, d = (two, one) if direction == "tp2->tp1" else (one, two)
    batch = prompts(10 + len(direction), (180, 33, 257))
    ref = [o.tokens for o in p.generate(batch, 16)]
    assert pd(p, d, batch) == ref


def park_slots(name: str, n: int, block: int) -> int:
    """Park slots of a prompt of ``n`` tokens: every block of the full attention group,
    and for each of Gemma-3's 3 sliding groups (window 64) the blocks of the last 63."""
    full = -(-n // block)
    window = full - max(n - 63, 0) // block if name == "gemma3" else 0
    return full + 3 * window


@pytest.mark.parametrize(("name", "p_block", "d_block"), [("qwen3", 128, 32), ("gemma3", 32, 128)])
def test_model_token_exact(
    models: Path, llama_pair: tuple[Engine, ...], name: str, p_block: int, d_block: int
) -> None:
    for engines in closing(
        *start_all(
            models,
            # P with a park (test_park.py): P → D is parked, the way back held
            (name, f"{name}-p", {"block_size": p_block, "cpus": "0", "extra": PARK}),
            (name, f"{name}-d", {"block_size": d_block, "cpus": "1"}),
        )
    ):
        p, d = engines
        # Gemma-3's window is 64: prompts longer than it, at and around block edges
        batch = prompts(20, (300, 64, 65, 191, 129, 40))
        ref = [o.tokens for o in p.generate(batch, 16)]
        assert p.reset_prefix_cache()  # prefilled whole: vLLM's tables hold every block
        taken = p.park_taken()
        pre = p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
        # slots for the blocks D reads only (Gemma: 3 windows of 64, then a full layer)
        want = sum(park_slots(name, len(x) - 1, p_block) for x in batch)
        assert p.park_taken() - taken == want
        served = [handle_of(o.kv_transfer_params).engine_id for o in pre]
        assert served == [f"{name}-p.park"] * len(batch)
        out = d.generate(batch, 16, [o.kv_transfer_params for o in pre])
        assert [o.tokens for o in out] == ref
        served = []
        back = prompts(21, (250, 97))  # and the other way
        ref_back = [o.tokens for o in d.generate(back, 16)]
        assert pd(d, p, back, served_by=served) == ref_back
        assert served == [f"{name}-d"] * len(back)
        # a handle from this model's P given to a Llama D: refused by the model hash at
        # the handshake (a typed IncompatibleError), recomputed, and D keeps serving
        llama_d = llama_pair[0]
        (pre,) = p.generate(prompts(22, (150,)), 1, [{"do_remote_decode": True}])
        wrong = prompts(22, (150,))
        before = llama_d.rpc(connector_totals)[0]
        out = llama_d.generate(wrong, 16, [pre.kv_transfer_params])
        assert [o.tokens for o in out] == [o.tokens for o in llama_d.generate(wrong, 16)]
        after = llama_d.rpc(connector_totals)[0]
        failed = after.get("failed_IncompatibleError", 0)
        assert failed - before.get("failed_IncompatibleError", 0) == 1
        assert after.get("loads_ok", 0) == before.get("loads_ok", 0)
