"""The last-token rule (docs/vllm.md, "The last-token rule"): P's scheduler prefills a
request for remote decode one prompt token short by editing vLLM's private
``Request._all_token_ids``, as vLLM's own NixlConnector does; vLLM 0.32 and 0.33 offer no
public way. These tests break when vLLM changes what the edit relies on: a real
``Request`` of the installed vLLM, its source, and the snapshots of other versions."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler
from vllm.v1 import request as vllm_request
from vllm.v1.request import Request

from kvbridge.integrations.vllm import scheduler
from kvbridge.integrations.vllm.scheduler import SchedulerSide
from tests.support.vllm_api import snapshots
from tests.support.vllm_request import edits, missing, request_facts

SNAPSHOTS = snapshots(Path(__file__).parents[1] / "data" / "vllm_api")


def p_scheduler() -> SchedulerSide:
    cfg = SimpleNamespace(producer=True, consumer=False)
    return SchedulerSide(cfg, SimpleNamespace(spec=SimpleNamespace(groups=[])))  # type: ignore[arg-type]


def request(prompt: list[int], params: dict[str, Any] | None) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=16, extra_args=extra)
    return Request("r", list(prompt), sampling, None)


def test_p_prefills_a_real_request_one_token_short() -> None:
    prompt = list(range(100, 110))
    req = request(prompt, {"do_remote_decode": True})
    p_scheduler().on_new_request(req)
    # what vLLM's scheduler and model runner read: 9 prompt tokens to prefill, 1 to sample
    assert req.num_tokens == req.num_prompt_tokens == 9
    assert list(req.all_token_ids) == req.prompt_token_ids == prompt[:9]
    assert req.max_tokens == 1
    req.append_output_token_ids(7)  # the token P samples follows the shortened prompt
    assert list(req.all_token_ids) == [*prompt[:9], 7] and req.num_tokens == 10
    assert list(req.output_token_ids) == [7]


def test_a_request_not_for_remote_decode_keeps_its_prompt() -> None:
    prompt = list(range(10))
    req = request(prompt, None)
    p_scheduler().on_new_request(req)
    assert (req.num_tokens, list(req.all_token_ids), req.max_tokens) == (10, prompt, 16)


def test_the_public_view_cannot_make_the_edit() -> None:
    """``all_token_ids``, the public list, refuses changes: the private list is the way."""
    req = request(list(range(10)), None)
    with pytest.raises(TypeError):
        req.all_token_ids.pop(-1)
    with pytest.raises((TypeError, AttributeError)):
        req.num_tokens = 9


def test_the_installed_request_has_what_the_rule_relies_on() -> None:
    assert missing(request_facts(inspect.getsource(vllm_request))) == []


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
def test_a_snapshot_request_has_what_the_rule_relies_on(path: Path) -> None:
    snap = json.loads(path.read_text())
    assert missing(snap["request"]) == []
    # vLLM's own connector still makes the same private edit (no public way yet)
    assert snap["nixl_edits"] == ["del request._all_token_ids[-backoff:]"]


def test_vllm_own_connector_makes_the_same_edit() -> None:
    """When vLLM's NixlConnector stops editing ``_all_token_ids``, vLLM probably has a
    public way: this fails, to look for it."""
    assert edits(inspect.getsource(base_scheduler)) == ["del request._all_token_ids[-backoff:]"]


def test_the_rule_is_our_only_private_edit() -> None:
    assert edits(inspect.getsource(scheduler)) == ["del request._all_token_ids[-1:]"]


SOURCE = inspect.getsource(vllm_request)
CHANGES = {
    "no copy": (
        "self._all_token_ids = self.prompt_token_ids.copy()",
        "self._all_token_ids = self.prompt_token_ids",
        ["Request.init: no `self._all_token_ids = self.prompt_token_ids.copy()`"],
    ),
    "view copies": (
        "self.all_token_ids = ConstantList(self._all_token_ids)",
        "self.all_token_ids = ConstantList(list(self._all_token_ids))",
        ["Request.init: no `self.all_token_ids = ConstantList(self._all_token_ids)`"],
    ),
    "count kept apart": (
        "return len(self._all_token_ids)",
        "return self._num_tokens",
        ["Request.num_tokens: no `return len(self._all_token_ids)`"],
    ),
    "renamed": (
        "_all_token_ids",
        "_token_ids",
        [
            "Request.init: no `self._all_token_ids = self.prompt_token_ids.copy()`",
            "Request.init: no `self.all_token_ids = ConstantList(self._all_token_ids)`",
            "Request.num_tokens: no `return len(self._all_token_ids)`",
            "Request.append_output_token_ids: no `self._all_token_ids.append(token_ids)`",
            "Request.append_output_token_ids: no `self._all_token_ids.extend(token_ids)`",
        ],
    ),
    "property": (
        "    def append_output_token_ids(",
        "    @property\n    def max_tokens(self) -> int:\n        return 1\n\n"
        "    def append_output_token_ids(",
        ["Request.max_tokens is a property"],
    ),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_request_is_reported(change: str) -> None:
    old, new, expected = CHANGES[change]
    assert old in SOURCE
    assert missing(request_facts(SOURCE.replace(old, new))) == expected
