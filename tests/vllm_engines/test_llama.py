"""Llama in real vLLM: P and D with different block sizes (32 ↔ 128), token for token
against a colocated run, a prefix already cached on D, and a scrambled-P control."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.support.vllm_harness import Engine, connector_totals
from tests.vllm_engines.conftest import pd, prompts
from tests.vllm_engines.scramble import scramble_cache

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engines(llama_pair: tuple[Engine, ...]) -> tuple[Engine, ...]:
    return llama_pair


def totals(e: Engine) -> dict[str, int]:
    return e.rpc(connector_totals)[0]


@pytest.mark.parametrize("direction", ["32->128", "128->32"])
def test_block_sizes_token_exact(engines: tuple[Engine, ...], direction: str) -> None:
    a, b = engines
    p, d = (a, b) if direction == "32->128" else (b, a)
    batch = prompts(1 if direction == "32->128" else 2, (200, 37, 300, 129, 64))
    ref = [o.tokens for o in p.generate(batch, 16)]
    before = totals(d)
    assert pd(p, d, batch) == ref
    after = totals(d)
    assert after.get("loads_ok", 0) - before.get("loads_ok", 0) == len(batch)
    assert after.get("loads_failed", 0) == before.get("loads_failed", 0)


def test_prefix_cached_on_d_moves_only_the_rest(engines: tuple[Engine, ...]) -> None:
    a, b = engines
    [full] = prompts(3, (400,))
    ref = a.generate([full], 16)[0].tokens
    b.generate([full[:256]], 1)  # D now holds the first 256 tokens (2 blocks of 128)
    before = totals(b)
    assert pd(a, b, [full]) == [ref]
    moved = totals(b)["bytes"] - before.get("bytes", 0)
    # llama tiny: 4 layers × 2 KV heads × 64 × fp32 × (K + V) = 4 KiB per token. P (block
    # 32) prefilled 399 tokens; D needs 256..398, and its last P block moves whole (to 416:
    # vLLM writes those slots before it reads them), one run instead of one per element
    assert moved == (416 - 256) * 4 * 2 * 64 * 4 * 2


def test_prompt_cached_on_d_releases_p_at_once(engines: tuple[Engine, ...]) -> None:
    """D's cache already holds the whole prompt: nothing moves, and P frees the request's
    blocks on its next steps instead of holding them until the lease expires (90 s here)."""
    a, b = engines
    [full] = prompts(5, (257,))  # D (block 128) caches 256 tokens: all P hands over
    ref = b.generate([full], 16)[0].tokens
    before_d, before_p = totals(b), totals(a)
    pre = a.generate([full], 1, [{"do_remote_decode": True}])
    assert b.generate([full], 16, [pre[0].kv_transfer_params])[0].tokens == ref
    after_d = totals(b)
    assert after_d.get("loads_ok", 0) == before_d.get("loads_ok", 0)
    assert after_d["releases"] == before_d.get("releases", 0) + 1
    step_until(a, lambda: totals(a).get("leases_done", 0) > before_p.get("leases_done", 0))


def test_scrambled_p_cache_changes_d_output(engines: tuple[Engine, ...]) -> None:
    """Control: D really uses P's bytes. (Last in the module: it ruins P's cache.)"""
    a, b = engines
    batch = prompts(4, (150, 220))
    ref = [o.tokens for o in a.generate(batch, 16)]
    pre = a.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    assert sum(a.rpc(scramble_cache)) >= 1
    out = b.generate(batch, 16, [o.kv_transfer_params for o in pre])
    assert all(o.tokens != r for o, r in zip(out, ref, strict=True))
    # vLLM resets the prefix cache only once no request holds blocks
    step_until(a, a.reset_prefix_cache)


def step_until(p: Engine, done: Callable[[], bool]) -> None:
    """Step ``p`` until ``done()``: P frees the blocks of leases D ended when it steps,
    and an engine core in the engine's process (``core_process=False``) steps only
    inside calls."""
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < 10, "P still holds the blocks"
        p.generate([[7, 8, 9]], 1)
        time.sleep(0.2)
