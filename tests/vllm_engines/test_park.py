"""Parking in real vLLM (integrations/vllm/park.py): a P engine with ``park_blocks``
copies each finished request's KV into its park and hands vLLM its blocks back at once.
D decodes from the parked copy token for token as a colocated run; requests beyond the
park's slots are served from vLLM's blocks as before; and with leases held for handles no
D loads, P's engine stops stepping (its processes use next to no CPU), where without a
park vLLM steps it for as long as the leases last (docs/vllm.md, "An idle P")."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.connector.handle import TransferHandle
from tests.support.vllm_harness import Engine, connector_totals, cpu_seconds
from tests.vllm_engines.conftest import closing, pd, prompts, release_at_p, start

pytestmark = pytest.mark.vllm

PARK = 17
"""vLLM blocks of P's park (16 usable): 4 requests of ≤ 4 blocks of 32 tokens fit."""


@pytest.fixture(scope="module")
def parked_p(models: Path) -> Iterator[Engine]:
    """Llama P with a park, its engine core in a process of its own (as served: the
    loop that steps while requests wait on the connector)."""
    p = start(
        models,
        "llama",
        "llama-park",
        block_size=32,
        cpus="0",
        core_process=True,
        extra={"park_blocks": PARK},
    )
    yield from (e for (e,) in closing(p))


def engine_of(params: dict | None) -> str:
    h = TransferHandle.from_bytes(base64.b64decode(str((params or {})["kvbridge"])))
    return h.engine_id


def test_d_decodes_from_the_park_token_exact(
    parked_p: Engine, llama_pair: tuple[Engine, ...]
) -> None:
    d = llama_pair[1]  # blocks of 128: D's layout is not P's park's
    batch = prompts(7, (100, 37, 128, 65))
    ref = [o.tokens for o in parked_p.generate(batch, 16)]
    before = d.rpc(connector_totals)[0]
    assert pd(parked_p, d, batch) == ref
    after = d.rpc(connector_totals)[0]
    assert after.get("loads_ok", 0) - before.get("loads_ok", 0) == len(batch)
    assert after.get("loads_failed", 0) == before.get("loads_failed", 0)


def test_beyond_its_slots_p_serves_from_vllms_blocks(
    parked_p: Engine, llama_pair: tuple[Engine, ...]
) -> None:
    """Six requests of 4 blocks in one batch: the park holds 4 of them, the other 2 are
    served from vLLM's blocks (their handles name P itself), all token-exact."""
    d = llama_pair[1]
    batch = prompts(8, (120,) * 6)
    ref = [o.tokens for o in parked_p.generate(batch, 16)]
    before = parked_p.rpc(connector_totals)[0]
    pre = parked_p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    engines = sorted(engine_of(o.kv_transfer_params) for o in pre)
    assert engines == ["llama-park"] * 2 + ["llama-park.park"] * 4
    out = d.generate(batch, 16, [o.kv_transfer_params for o in pre])
    assert [o.tokens for o in out] == ref
    parked_p.generate(prompts(10, (40,)), 1)  # a step: P's scheduler reports to its workers
    after = parked_p.rpc(connector_totals)[0]
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in ("park_parked", "park_held")}
    assert counted == {"park_parked": 4, "park_held": 2}


def test_p_idles_while_parked_leases_wait(parked_p: Engine) -> None:
    """Handles no D loads (leases held): P's engine processes use < 0.3 core over 3 s
    once vLLM's queues stop spinning (~1 s after the last step); unparked, the same
    leases keep it stepping at ~1 core (benchmarks/vllm_idle.py prints both)."""
    batch = prompts(9, (90, 70, 110))
    pre = parked_p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    params = [o.kv_transfer_params for o in pre]
    try:
        assert {engine_of(p) for p in params} == {"llama-park.park"}
        time.sleep(2.0)
        pgid = parked_p.proc.pid
        assert pgid is not None
        t0, c0 = time.monotonic(), cpu_seconds(pgid)
        time.sleep(3.0)
        used = (cpu_seconds(pgid) - c0) / (time.monotonic() - t0)
        assert used < 0.3, f"P's engine used {used:.2f} core while its leases wait"
    finally:
        release_at_p(params)
