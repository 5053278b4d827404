"""Bad input and faults in real vLLM: a tampered or malformed handle and a killed P make
the load fail; vLLM's ``kv_load_failure_policy="recompute"`` then recomputes on D, so the
output still equals the colocated run; nothing hangs and D keeps serving."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvbridge.connector.handle import TransferHandle
from kvbridge.integrations.vllm.harness import Engine, connector_totals
from tests.vllm_engines.conftest import closing, pd, prompts, start

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engines(models: Path) -> Iterator[tuple[Engine, ...]]:
    p = start(models, "llama", "faults-p", block_size=64, cpus="0")
    d = start(models, "llama", "faults-d", block_size=32, cpus="1")
    yield from closing(p, d)


def failed(d: Engine) -> int:
    return int(d.rpc(connector_totals)[0].get("loads_failed", 0))


def tamper(params: dict[str, object], **change: object) -> dict[str, object]:
    h = TransferHandle.from_bytes(base64.b64decode(str(params["kvbridge"])))
    h2 = msgspec.structs.replace(h, **change)
    return {"kvbridge": base64.b64encode(h2.to_bytes()).decode()}


def test_bad_handles_fail_then_recompute(engines: tuple[Engine, ...]) -> None:
    p, d = engines
    batch = prompts(30, (200, 150, 90))
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
    ]
    before = failed(d)
    t0 = time.monotonic()
    out = d.generate(batch, 16, bad)
    assert [o.tokens for o in out] == ref
    assert failed(d) - before == 3
    assert time.monotonic() - t0 < 60
    # D still serves P/D requests afterwards
    more = prompts(31, (120,))
    assert pd(p, d, more) == [o.tokens for o in p.generate(more, 16)]


def test_killed_p_recomputes_on_d(engines: tuple[Engine, ...]) -> None:
    """Last in the module: it kills P."""
    p, d = engines
    batch = prompts(32, (220, 70))
    ref = [o.tokens for o in p.generate(batch, 16)]
    pre = p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    p.kill()
    before = failed(d)
    t0 = time.monotonic()
    out = d.generate(batch, 16, [o.kv_transfer_params for o in pre])
    assert [o.tokens for o in out] == ref
    assert failed(d) - before == 2
    assert time.monotonic() - t0 < 60
