"""``prepare`` in real vLLM: a D engine configured with a P instance
(``kv_connector_extra_config.prepare``) connects to it at its first step (not while vLLM
starts: CUDA graph capture), and its first request from that P loads over the prepared
peer (no handshake of its own), token for token against P's colocated run."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest

from kvbridge.connector.handle import TransferHandle
from tests.support.vllm_harness import Engine, connector_peers, connector_totals
from tests.vllm_engines.conftest import pd, prompts, release_at_p, start

pytestmark = pytest.mark.vllm


def test_a_prepared_p_serves_ds_first_request_without_a_handshake(
    llama_pair: tuple[Engine, ...], models: Path
) -> None:
    p = llama_pair[0]  # block 32
    probe = p.generate(prompts(7, (40,)), 1, [{"do_remote_decode": True}])
    params = [o.kv_transfer_params for o in probe]
    h = TransferHandle.from_bytes(base64.b64decode(str((params[0] or {})["kvbridge"])))
    release_at_p(params)  # only its names were needed
    extra = {"prepare": [f"{h.engine_id}@{h.endpoint}"]}
    d = start(models, "llama", "llama-prepared", block_size=128, cpus="1", extra=extra)
    try:
        assert d.rpc(connector_peers)[0] == {}  # not at registration: at the first step
        d.generate(prompts(9, (8,)), 1)  # a local request: D's first step
        deadline = time.monotonic() + 60
        while not (held := d.rpc(connector_peers)[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(held) == [h.engine_id] and held[h.engine_id].startswith(h.epoch + ":")
        batch = prompts(8, (200, 37))
        ref = [o.tokens for o in p.generate(batch, 16)]
        assert pd(p, d, batch) == ref
        assert d.rpc(connector_peers)[0] == held  # the prepared peer, not a new handshake
        assert d.rpc(connector_totals)[0].get("loads_ok", 0) == len(batch)
    finally:
        d.close()
