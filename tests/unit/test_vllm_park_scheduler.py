"""The scheduler side of parking (integrations/vllm/scheduler.py with a park): P's
workers' park infos make a P instance ``<id>.park`` that P names at its handshake; a
request whose prompt a step completes is ordered into the park, its handle names the
park and vLLM frees its blocks (``delay_free_blocks`` False); a handle the park refuses
falls back to vLLM's blocks with its slots back; a park lease's end comes back as slots
and as the ``lease_<end>`` count of the next step."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvbridge.adapter import HANDLE_KEY, decode_handle
from kvbridge.api import Kind, KVBridgeError, Parallel, ProducerWorker
from kvbridge.integrations.vllm.cache import VllmCache
from kvbridge.integrations.vllm.config import ConnectorConfig
from kvbridge.integrations.vllm.metadata import encode_info
from kvbridge.integrations.vllm.scheduler import SchedulerSide, park_keep
from kvbridge.spec import attention, group_by_kind
from kvbridge.transport.loopback import Fabric, LoopbackTransport
from tests.support.scenario import Side

SPEC = group_by_kind("t", [attention(i, 2, 8) for i in range(2)], 16)
PARK = 8


@pytest.fixture
def sched() -> Any:
    side = Side(SPEC, Parallel(1), "hnd", 16)
    side.allocate(np.random.default_rng(1))
    fabric = Fabric()
    workers = [
        ProducerWorker(0, side.layouts[0], list(side.bound(0).bases), LoopbackTransport(n, fabric))
        for n in ("p0", "park0")
    ]
    cfg = ConnectorConfig("P", True, False, b"s", park_blocks=PARK, transport="loopback")
    s = SchedulerSide(cfg, VllmCache(SPEC, Parallel(1), {}, 16))
    s.set_ranks({0: encode_info(workers[0].info)}, {0: encode_info(workers[1].info)})
    yield s
    s.close()
    for w in workers:
        w.close()


def request(rid: str, n: int = 33) -> Any:
    prompt = list(range(3, 3 + n))
    return NS(
        request_id=rid,
        kv_transfer_params={"do_remote_decode": True},
        num_prompt_tokens=n,
        prompt_token_ids=prompt,
        _all_token_ids=list(prompt),
        max_tokens=16,
        status=NS(name="FINISHED_LENGTH_CAPPED"),
    )


def prefill(s: SchedulerSide, req: Any, blocks: list[int]) -> Any:
    """``req`` new and whole in one step: the step's connector metadata."""
    s.on_new_request(req)
    new = NS(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=0)
    return s.step_meta(
        NS(num_scheduled_tokens={req.request_id: req.num_prompt_tokens}, scheduled_new_reqs=[new])
    )


def test_a_parked_request_names_the_park_and_vllm_frees_its_blocks(sched: Any) -> None:
    assert sched.producer.companions == [("P.park", sched.park.endpoint)]
    req = request("a")
    meta = prefill(sched, req, [5, 6])
    ((rid, blocks, slots),) = meta.parks
    assert (rid, [b.tolist() for b in blocks]) == ("a", [[5, 6]]) and all(slots[0])
    delay, params = sched.request_finished(req, ([5, 6],))
    handle = decode_handle(params[HANDLE_KEY])
    assert delay is False and handle.engine_id == "P.park"
    assert handle.block_tables == [s.tolist() for s in slots]  # one block per vLLM block
    assert len(sched.book.free) == PARK - 1 - 2


def test_a_handle_the_park_refuses_falls_back_with_its_slots_back(
    sched: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*a: Any, **k: Any) -> Any:
        raise KVBridgeError("refused")

    monkeypatch.setattr(sched.park, "prefill_done", refuse)
    req = request("a")
    assert prefill(sched, req, [5, 6]).parks
    delay, params = sched.request_finished(req, ([5, 6],))
    assert delay is True and decode_handle(params[HANDLE_KEY]).engine_id == "P"
    assert len(sched.book.free) == PARK - 1
    assert sched.step_meta(NS()).events == {"park_held": 1}


def test_a_park_lease_that_ended_gives_its_slots_back_and_is_counted(sched: Any) -> None:
    req = request("a")
    prefill(sched, req, [5, 6])
    sched.request_finished(req, ([5, 6],))
    assert sched.step_meta(NS()).events == {"park_parked": 1}
    assert sched.park.abort("a")
    meta = sched.step_meta(NS())
    assert meta.events == {"lease_aborted": 1} and meta.freed == []  # not vLLM's to free
    assert len(sched.book.free) == PARK - 1


def test_park_keep_is_what_d_reads_of_each_group() -> None:
    """A window of 64 (the last 63 tokens), a full group (all), a Mamba group (its slot:
    0 without prefix caching, the last computed block's with vLLM's ``align``)."""
    from kvbridge.spec import mamba2

    spec = group_by_kind(
        "h",
        [
            attention(0, 2, 8, kind=Kind.SLIDING, window=64),
            attention(1, 2, 8),
            mamba2(2, 4, 8, 1, 4, 4),
        ],
        32,
    )
    kinds = [spec.layers[g.layers[0]].kind.value for g in spec.groups]
    cache = VllmCache(spec, Parallel(1), {}, 64, {kinds.index("state"): 32})
    keep = park_keep(cache)
    at = {k: g for g, k in enumerate(kinds)}
    assert keep(at["sliding"], 128) == range(2, 4)  # tokens 65..127
    assert keep(at["sliding"], 40) == range(0, 2)
    assert keep(at["full"], 128) == range(0, 4)
    assert keep(at["state"], 128) == range(0, 1)
    aligned = VllmCache(spec, Parallel(1), {}, 64, {at["state"]: 32}, "align")
    assert park_keep(aligned)(at["state"], 128) == range(3, 4)
