"""D's scheduler and the handle in a request's transfer params: decoded once, and a handle
that is not text (vLLM's transfer params are JSON) is malformed, as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvbridge.adapter import HANDLE_KEY, decode_handle, encode_handle
from kvbridge.api import Parallel, PeerError, TransferHandle, checked_tables
from kvbridge.integrations.vllm.scheduler import SchedulerSide
from kvbridge.spec import attention, group_by_kind

SPEC = group_by_kind("t", [attention(i, 2, 8) for i in range(2)], 16)


def scheduler() -> SchedulerSide:
    cfg = SimpleNamespace(consumer=True, producer=False)
    cache = SimpleNamespace(
        spec=SPEC, par=Parallel(1), tables=lambda t, n: checked_tables(t, [8], "D")
    )
    return SchedulerSide(cfg, cache)  # type: ignore[arg-type]


def handle_text() -> str:
    h = TransferHandle("P", "tcp://127.0.0.1:1", "e" * 16, "p-req", "l" * 8, 32, [[1, 2]])
    return encode_handle(h)


@pytest.mark.parametrize("kind", ["text", "bytes"])
def test_a_handle_that_is_not_text_is_malformed_and_its_load_fails(kind: str) -> None:
    text = handle_text()
    value: object = text if kind == "text" else decode_handle(text).to_bytes()
    s = scheduler()
    req = SimpleNamespace(request_id="r", kv_transfer_params={HANDLE_KEY: value})
    req.num_prompt_tokens = 41
    ext, later = s.matched_tokens(req, 0)
    assert (ext, later) == ((32, True) if kind == "text" else (40, True))
    s.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), ext)
    (job,) = s.step_meta().loads
    if kind == "text":
        assert decode_handle(job.handle).n_tokens == 32
    else:  # what the workers get fails to decode: the load fails, by policy
        with pytest.raises(PeerError):
            decode_handle(job.handle)
