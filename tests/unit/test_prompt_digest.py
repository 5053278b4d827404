"""A handle names its prompt: P puts a digest of the prompt tokens whose KV it holds in
the handle, D checks it against the tokens it decodes from before anything reaches P.
Real Producer/Consumer over the loopback transport."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from kvbridge.connector.handle import TransferHandle, prompt_digest
from kvbridge.errors import PlanError, PromptMismatch
from tests.support.reference import fill_source
from tests.support.scenario import random_tables
from tests.unit.test_connector_loopback import SPEC, World, check_bytes

N = 45


def prefill(w: World, rid: str, prompt: list[int]) -> tuple[TransferHandle, list[list[int]]]:
    """P holds ``prompt``'s KV (its first ``N`` tokens) under a lease; → (handle, D tables)."""
    p_tabs = random_tables(SPEC, N, 32, w.rng)
    for r in range(w.p.par.world):
        fill_source(SPEC, w.p.par, r, w.p.layouts[r], w.p.bufs[r], N, p_tabs)
    d_tabs = random_tables(w.d.spec, N, 64, w.rng)
    handle = w.producer.prefill_done(rid, p_tabs, N, prompt=prompt)
    return TransferHandle.from_bytes(handle.to_bytes()), d_tabs  # as the router forwards it


@pytest.fixture
def world():
    w = World()
    yield w
    w.close()


def test_a_handle_of_another_prompt_is_refused_before_anything_moves(world: World) -> None:
    rng = np.random.default_rng(3)
    prompt_a, prompt_b = (rng.integers(0, 150_000, N).tolist() for _ in range(2))
    handle_a, d_tabs_a = prefill(world, "a", prompt_a)
    handle_b, d_tabs_b = prefill(world, "b", prompt_b)
    before = [[b.copy() for b in bufs] for bufs in world.d.bufs]
    d = world.consumers[0]
    # the router mixed the two requests up: D decodes prompt a with b's handle
    with pytest.raises(PromptMismatch, match="another prompt"):
        d.load(handle_b, d_tabs_a, prompt=prompt_a)
    time.sleep(0.2)
    assert d.pending() == 0 and d.poll() == []
    for got, want in zip(world.d.bufs, before, strict=True):
        assert all(np.array_equal(g, x) for g, x in zip(got, want, strict=True))
    # nothing began at P: both leases held, nothing freed, b's own D still loads it
    assert world.producer.leases.held() == 2 and world.producer.freed() == []
    d.load(handle_b, d_tabs_b, prompt=np.asarray(prompt_b, dtype=np.int64))
    (out,) = world.wait()
    assert out.ok, out.error
    check_bytes(world, before, N, 0, d_tabs_b)
    d.load(handle_a, d_tabs_a, prompt=[*prompt_a, 7])  # D's own tokens beyond P's count
    (out,) = world.wait()
    assert out.ok, out.error
    assert sorted(f.request_id for f in world.producer.freed(wait_for=2)) == ["a", "b"]


def test_a_shorter_prompt_and_a_damaged_digest_are_mismatches(world: World) -> None:
    prompt = list(range(100, 100 + N))
    handle, d_tabs = prefill(world, "s", prompt)
    d = world.consumers[0]
    with pytest.raises(PromptMismatch, match=f"holds {N} prompt tokens, D's prompt has {N - 1}"):
        d.load(handle, d_tabs, prompt=prompt[:-1])
    for damaged in (b"\0" * 16, b"abc", handle.prompt_digest[::-1]):
        with pytest.raises(PromptMismatch):
            d.load(msgspec.structs.replace(handle, prompt_digest=damaged), d_tabs, prompt=prompt)
    assert d.pending() == 0 and world.producer.leases.held() == 1


def test_without_a_digest_only_a_consumer_that_requires_one_refuses(world: World) -> None:
    handle, d_tabs = prefill(world, "n", list(range(N)))
    bare = msgspec.structs.replace(handle, prompt_digest=b"")  # P's engine gave no tokens
    d = world.consumers[0]
    d.require_prompt = True
    with pytest.raises(PromptMismatch, match="without a prompt digest"):
        d.load(bare, d_tabs, prompt=list(range(N)))
    with pytest.raises(PromptMismatch, match="without D's prompt"):
        d.load(handle, d_tabs)
    assert d.pending() == 0
    d.require_prompt = False
    d.load(bare, d_tabs, prompt=[9] * N)  # nothing to check against: loads
    (out,) = world.wait()
    assert out.ok, out.error


def test_the_digest_names_token_values_whatever_holds_them() -> None:
    ids = [0, 5, 151_935, 2**31 - 1, 42]
    want = prompt_digest(ids, 5)
    assert len(want) == 16
    for same in (tuple(ids), np.asarray(ids, np.int32), np.asarray(ids, np.uint32), [*ids, 3]):
        assert prompt_digest(same, 5) == want
    assert prompt_digest(np.asarray(ids, ">i8"), 5) == want  # big-endian
    assert prompt_digest(np.asarray([*ids, 1] * 2, np.int64)[::2], 3) == prompt_digest(ids[::2], 3)
    assert prompt_digest(ids, 4) != want and prompt_digest([1, *ids[1:]], 5) != want
    wide = np.asarray([-(2**40)])
    for bad in ([1.0], ["1"], [2**31], np.zeros((1, 1), int), np.ones(1), "1", wide):
        with pytest.raises(PlanError):
            prompt_digest(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="digest of 6 tokens asked of a prompt of 5"):
        prompt_digest(ids, 6)


def test_p_refuses_a_prompt_shorter_than_its_token_count(world: World) -> None:
    with pytest.raises(PlanError):
        world.producer.prefill_done("x", random_tables(SPEC, N, 32, world.rng), N, prompt=[1] * 9)
    assert world.producer.leases.held() == 0


def test_a_deeply_nested_handle_is_refused_as_malformed() -> None:
    """A handle whose unknown field nests 100,000 arrays: a typed PeerError, not a
    RecursionError (the router's bytes are untrusted input)."""
    from kvbridge.errors import PeerError

    body = b"\x81\xa3zzz" + b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(PeerError, match="malformed transfer handle: nested too deeply"):
        TransferHandle.from_bytes(body)
