"""Bad input and faults in real vLLM: a tampered or malformed handle, the handle of
another prompt of the same length (a router that mixed two requests up) and a killed P
make the load fail; vLLM's ``kv_load_failure_policy="recompute"`` then recomputes on D, so the
output still equals the colocated run; with ``"fail"`` the failed request alone finishes
with an error. Nothing hangs and D keeps serving."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import msgspec
import pytest

from kvbridge.connector.handle import TransferHandle
from tests.support.vllm_harness import Engine, connector_totals
from tests.vllm_engines.conftest import closing, pd, prompts, release_at_p, start

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engines(llama_pair: tuple[Engine, ...]) -> tuple[Engine, ...]:
    b32, b128 = llama_pair
    return b128, b32  # P, D


def failed(d: Engine) -> int:
    return int(d.rpc(connector_totals)[0].get("loads_failed", 0))


def mismatches(d: Engine) -> int:
    return int(d.rpc(connector_totals)[0].get("failed_PromptMismatch", 0))


def tamper(params: dict[str, object], **change: object) -> dict[str, object]:
    h = TransferHandle.from_bytes(base64.b64decode(str(params["kvbridge"])))
    h2 = msgspec.structs.replace(h, **change)
    return {"kvbridge": base64.b64encode(h2.to_bytes()).decode()}


def test_bad_handles_fail_then_recompute(engines: tuple[Engine, ...]) -> None:
    p, d = engines
    batch = prompts(30, (200, 150, 90)) + prompts(35, (120, 120))
    ref = [o.tokens for o in p.generate(batch, 16)]
    pre = p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    good = pre[0].kv_transfer_params
    assert good is not None
    out_of_range = [
        [b + 10**9 for b in t]
        for t in TransferHandle.from_bytes(base64.b64decode(str(good["kvbridge"]))).block_tables
    ]
    bad = [
        tamper(good, block_tables=out_of_range),  # P: tables do not match its lease
        {"kvbridge": "not base64 at all!"},
        # a P that is gone (a known P's endpoint would be taken from the cached peer)
        tamper(pre[2].kv_transfer_params or {}, engine_id="gone", endpoint="tcp://127.0.0.1:9"),
        # mixed up: each of two prompts of 120 tokens gets the other's handle
        pre[4].kv_transfer_params,
        pre[3].kv_transfer_params,
    ]
    before, mixed = failed(d), mismatches(d)
    t0 = time.monotonic()
    out = d.generate(batch, 16, bad)
    assert [o.tokens for o in out] == ref
    assert failed(d) - before == 5
    assert mismatches(d) - mixed == 2
    assert time.monotonic() - t0 < 60
    # D still serves P/D requests afterwards
    more = prompts(31, (120,))
    assert pd(p, d, more) == [o.tokens for o in p.generate(more, 16)]
    release_at_p([o.kv_transfer_params for o in pre])


def test_fail_policy_then_killed_p(engines: tuple[Engine, ...], models: Path) -> None:
    """With ``kv_load_failure_policy="fail"`` only the request whose load failed finishes
    with an error; then that engine serves as a P that is killed after prefill, and the
    shared D recomputes both requests."""
    p, d = engines
    for (own,) in closing(
        start(models, "llama", "faults-own", block_size=64, cpus="1", failure_policy="fail")
    ):
        batch = prompts(33, (160, 140))
        ref = [o.tokens for o in p.generate(batch, 16)]
        pre = p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
        gone = tamper(
            pre[1].kv_transfer_params or {}, engine_id="gone2", endpoint="tcp://127.0.0.1:9"
        )
        t0 = time.monotonic()
        out = own.generate(batch, 16, [pre[0].kv_transfer_params, gone])
        assert time.monotonic() - t0 < 60
        assert out[0].tokens == ref[0] and out[0].finish_reason == "length"
        assert out[1].finish_reason == "error" and out[1].tokens == []
        assert failed(own) == 1
        release_at_p([pre[1].kv_transfer_params])
        # the engine keeps serving P/D requests after the failure
        more = prompts(34, (90,))
        assert pd(p, own, more) == [o.tokens for o in p.generate(more, 16)]

        # now `own` is a P that dies after prefill
        batch = prompts(32, (220, 70))
        ref = [o.tokens for o in own.generate(batch, 16)]
        pre = own.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
        own.kill()
        before = failed(d)
        t0 = time.monotonic()
        out = d.generate(batch, 16, [o.kv_transfer_params for o in pre])
        assert [o.tokens for o in out] == ref
        assert failed(d) - before == 2
        assert time.monotonic() - t0 < 60
