"""P prefills, kvbridge moves the KV (planner + loopback), D decodes: same tokens.

P and D differ in block size and layout; both run in this process at TP 1.
"""

from __future__ import annotations

import functools

import pytest

from kvbridge.spec import Kind
from refengine import (
    PRESETS,
    EngineError,
    Instance,
    Moved,
    encode,
    generate,
    model_spec,
    move_kv,
    preset,
)

pytestmark = pytest.mark.e2e

PROMPT = encode("Disaggregated prefill: the decode side continues the story.")
NEW_TOKENS = 16
CACHED = 21

# (P layout, P block size, D layout, D block size) per preset: every layout on both sides.
SIDES = {
    "llama": ("nhd", 16, "hnd", 32),
    "gemma": ("hnd", 16, "block-major", 32),
    "deepseek": ("block-major", 16, "nhd", 32),
    "qwen3-next": ("hnd", 16, "block-major", 32),
    "kimi-linear": ("hnd", 16, "shared-pool", 32),
    "jamba": ("shared-pool", 32, "nhd", 16),
}


@functools.cache
def colocated(name: str) -> tuple[int, ...]:
    return tuple(generate(name, PROMPT, tp=1, n_new_tokens=NEW_TOKENS))


def disaggregated(
    name: str, sides: tuple[str, int, str, int], cached: int, move: bool = True
) -> tuple[tuple[int, ...], Moved]:
    p_layout, p_bs, d_layout, d_bs = sides
    with (
        Instance(name, block_size=p_bs, layout=p_layout) as p,
        Instance(name, block_size=d_bs, layout=d_layout) as d,
    ):
        d.reserve("earlier", PROMPT[:9])  # D's block ids differ from P's
        first = p.prefill("req", PROMPT).first_token
        d.reserve("req", PROMPT, n_cached=cached)
        moved = move_kv(p, d, "req") if move else Moved(0, 0)
        d.start_decode("req", first)
        return (first, *d.decode("req", NEW_TOKENS - 1)), moved


def needed_bytes(name: str, cached: int) -> int:
    """What D lacks at TP 1: the needed tokens of every token layer, every state."""
    spec, total = model_spec(preset(name)), 0
    for layer in spec.layers:
        a, b = layer.needed_tokens(len(PROMPT), cached)
        total += layer.state_bytes if layer.kind is Kind.STATE else (b - a) * layer.token_bytes
    return total


@pytest.mark.parametrize("name", PRESETS)
def test_decode_on_d_gives_the_colocated_tokens(name: str) -> None:
    tokens, moved = disaggregated(name, SIDES[name], cached=0)
    assert tokens == colocated(name)
    assert moved.bytes == needed_bytes(name, 0) and moved.descriptors > 0


@pytest.mark.parametrize("name", PRESETS)
def test_a_prefix_cached_on_d_moves_fewer_bytes_and_gives_the_same_tokens(name: str) -> None:
    _, full = disaggregated(name, SIDES[name], cached=0)
    tokens, partial = disaggregated(name, SIDES[name], cached=CACHED)
    assert tokens == colocated(name)
    assert 0 < partial.bytes < full.bytes
    assert partial.bytes == needed_bytes(name, CACHED)


@pytest.mark.parametrize("name", PRESETS)
def test_without_the_transfer_d_decodes_something_else(name: str) -> None:
    tokens, _ = disaggregated(name, SIDES[name], cached=0, move=False)
    assert tokens != colocated(name)


@pytest.mark.parametrize("name", ["gemma", "kimi-linear"])
def test_block_sizes_that_do_not_divide(name: str) -> None:
    tokens, _ = disaggregated(name, ("shared-pool", 16, "hnd", 24), cached=CACHED)
    assert tokens == colocated(name)


def test_move_refuses_a_d_request_of_another_length() -> None:
    with Instance("llama") as p, Instance("llama", block_size=32) as d:
        p.prefill("req", PROMPT)
        d.reserve("req", PROMPT[:-1])
        with pytest.raises(EngineError, match="D reserved"):
            move_kv(p, d, "req")
