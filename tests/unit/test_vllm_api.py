"""The connector's classes against vLLM's API (docs/vllm.md, "vLLM versions"): the
installed vLLM by introspection, every other version by its snapshot in
``tests/data/vllm_api/`` (``tools/vllm_api_snapshot.py``); and the checker itself, which
must report a base or connector altered the way a new vLLM could alter it."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector import factory
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request, RequestStatus

from kvbridge.integrations.vllm import connector, scheduler
from kvbridge.integrations.vllm.connector import KVBridgeConnector
from kvbridge.integrations.vllm.metadata import RankMeta, StepMeta
from kvbridge.integrations.vllm.stats import KVBridgePromMetrics, KVBridgeStats
from tests.support.vllm_api import (
    ClassApi,
    Construct,
    factory_call,
    from_json,
    live_class,
    live_impl,
    names,
    parse_method,
    snapshots,
)
from tests.support.vllm_check import (
    AHEAD,
    check_class,
    check_construct,
    check_override,
    differences,
)

DATA = Path(__file__).parents[1] / "data" / "vllm_api"
SNAPSHOTS = snapshots(DATA)
PAIRS: list[tuple[type, list[type]]] = [
    (KVBridgeConnector, [KVConnectorBase_V1, SupportsHMA]),
    (KVBridgeStats, [KVConnectorStats]),
    (KVBridgePromMetrics, [KVConnectorPromMetrics]),
    (StepMeta, [KVConnectorMetadata]),
    (RankMeta, [KVConnectorHandshakeMetadata]),
]
"""Each class of ours that vLLM calls into, with the vLLM classes it derives from."""
READS: dict[type, set[str]] = {
    Request: {
        "request_id",
        "kv_transfer_params",
        "status",
        "num_prompt_tokens",
        "prompt_token_ids",
        "max_tokens",
    },
    RequestStatus: {"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"},
    KVCacheBlocks: {"get_block_ids"},
    SchedulerOutput: {"num_scheduled_tokens"},
    KVCacheConfig: {"kv_cache_groups", "num_blocks"},
    KVConnectorTransferResults: {"finished_sending", "finished_recving", "failed_recving"},
}
"""What the connector and its scheduler side read from (or, for the last, build) vLLM's
objects by name (a name gone would end a handoff without an error: a status name that
never matches, a field read as missing). The last-token rule's fields:
test_vllm_last_token.py."""


def snapshot(path: Path) -> dict[str, Any]:
    snap: dict[str, Any] = json.loads(path.read_text())
    return snap


def test_every_vllm_base_of_our_classes_is_checked() -> None:
    for impl, bases in PAIRS:
        from_vllm = {c for c in impl.__mro__ if c.__module__.startswith("vllm.")}
        assert from_vllm == set(bases), impl


def test_our_classes_fit_the_installed_vllm() -> None:
    problems = []
    for impl, bases in PAIRS:
        problems += check_class(live_impl(impl), [live_class(b) for b in bases])
    assert problems == []


def test_hooks_defined_ahead_are_the_newest_snapshots() -> None:
    """What the check lets an older base lack exists in the newest snapshot's base (and
    fits it: ``test_our_classes_fit_a_snapshot``), and in no installed base."""
    newest = snapshot(SNAPSHOTS[-1])["classes"]["KVConnectorBase_V1"]["methods"]
    assert set(newest) >= AHEAD
    assert not AHEAD & set(live_class(KVConnectorBase_V1).methods)
    assert set(live_class(KVBridgeConnector).methods) >= AHEAD


def test_no_sleep_mode() -> None:
    """vLLM 0.33 asks before sleep mode frees the KV memory: kvbridge's registrations
    and mapped memory would point at memory given back, so it says no."""
    cfg = KVTransferConfig(kv_connector="KVBridgeConnector", kv_role="kv_both")
    assert KVBridgeConnector.supports_sleep_mode(cfg) is False


def test_the_constructor_fits_the_installed_factory() -> None:
    call = factory_call(inspect.getsource(factory))
    assert call.positional == 3  # (vllm_config, role, kv_cache_config) in vLLM 0.32
    assert check_construct(live_class(KVBridgeConnector).methods["__init__"], call) == []
    # and vLLM's own loader takes the class (it refuses a 2-argument constructor)
    cfg = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_connector_module_path="kvbridge.integrations.vllm",
        kv_role="kv_both",
    )
    assert KVConnectorFactory.get_connector_class(cfg) is KVBridgeConnector
    assert KVConnectorFactory.supports_hma_config(cfg)


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
def test_our_classes_fit_a_snapshot(path: Path) -> None:
    snap = snapshot(path)
    problems = []
    for impl, bases in PAIRS:
        apis = [from_json(b.__name__, snap["classes"][b.__name__]) for b in bases]
        problems += check_class(live_impl(impl), apis)
    init = live_class(KVBridgeConnector).methods["__init__"]
    problems += check_construct(init, Construct.from_json(snap["factory"]))
    assert problems == []


def test_snapshots_exist() -> None:
    assert "vllm-0.33.0.json" in [p.name for p in SNAPSHOTS]


def test_snapshots_are_in_version_order(tmp_path: Path) -> None:
    """The newest is last by version, not by name (``vllm-0.9.0`` sorts after
    ``vllm-0.10.0`` as text)."""
    made = ["0.10.0", "0.9.1", "0.33.0", "0.10.0rc1", "0.9.0", "1.0.0"]
    for v in made:
        (tmp_path / f"vllm-{v}.json").write_text("{}")
    got = [p.stem.removeprefix("vllm-") for p in snapshots(tmp_path)]
    assert got == ["0.9.0", "0.9.1", "0.10.0rc1", "0.10.0", "0.33.0", "1.0.0"]


def test_the_names_we_read_exist_in_the_installed_vllm() -> None:
    have = {cls: set(names(live_class(cls))) for cls in READS}
    assert [f"{c.__name__}.{n}" for c, want in READS.items() for n in sorted(want - have[c])] == []


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
def test_the_names_we_read_exist_in_a_snapshot(path: Path) -> None:
    have = {cls: set(snapshot(path)["names"][cls.__name__]) for cls in READS}
    assert [f"{c.__name__}.{n}" for c, want in READS.items() for n in sorted(want - have[c])] == []


def test_the_names_we_read_are_read() -> None:
    """The table above against the code: each name appears in the connector's sources
    (a stale entry would check nothing)."""
    text = inspect.getsource(connector) + inspect.getsource(scheduler)
    text += inspect.getsource(importlib.import_module("kvbridge.integrations.vllm.cache"))
    unread = [n for want in READS.values() for n in sorted(want) if n not in text]
    assert unread == []


def test_transfer_results_are_built_by_name() -> None:
    """Built by keyword, a reordered or renamed field fails loudly instead of swapping
    the sent, received and failed sets."""
    calls = [
        c
        for c in ast.walk(ast.parse(inspect.getsource(connector)))
        if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "KVConnectorTransferResults"
    ]
    assert calls and all(not c.args for c in calls)
    used = {k.arg for c in calls for k in c.keywords}
    assert used == READS[KVConnectorTransferResults]


def test_a_name_gone_is_reported() -> None:
    status = live_class(RequestStatus)
    renamed = dataclasses.replace(status, attrs=status.attrs - {"FINISHED_STOPPED"})
    assert READS[RequestStatus] - set(names(renamed)) == {"FINISHED_STOPPED"}


@pytest.mark.skipif(vllm.__version__ != "0.32.0", reason="docs compare 0.32 and 0.33")
def test_what_0_33_changes_in_the_bases_is_what_docs_say() -> None:
    snap = snapshot(DATA / "vllm-0.33.0.json")
    changed = {
        b.__name__: differences(live_class(b), from_json(b.__name__, snap["classes"][b.__name__]))
        for _, bases in PAIRS
        for b in bases
    }
    assert changed == {
        "KVConnectorBase_V1": [
            "+ restore_kv_caches method (self)",
            "+ supports_sleep_mode classmethod (cls, kv_transfer_config)",
            "+ unregister_kv_caches method (self)",
        ],
        "SupportsHMA": [],
        "KVConnectorMetadata": [],
        "KVConnectorHandshakeMetadata": [],
        "KVConnectorStats": [],
        "KVConnectorPromMetrics": [],
    }
    assert Construct.from_json(snap["factory"]) == factory_call(inspect.getsource(factory))


# --- the checker finds what a new vLLM could change ------------------------------------
def altered(api: ClassApi, **methods: str | None) -> ClassApi:
    """``api`` with methods replaced (``method_text`` form) or removed (None)."""
    new = dict(api.methods)
    for name, text in methods.items():
        if text is None:
            del new[name]
        else:
            new[name] = parse_method(name, text)
    return dataclasses.replace(api, methods=new)


# change: (methods altered in vLLM's base, the problems the checker must report, "|" between)
BASE_CHANGES: dict[str, tuple[dict[str, str | None], str]] = {
    "renamed parameter": (
        {"get_num_new_matched_tokens": "abstract method (self, request, num_tokens_computed)"},
        "KVBridgeConnector.get_num_new_matched_tokens: parameter 2 is named "
        "'num_computed_tokens', vLLM's 'num_tokens_computed'",
    ),
    "new parameter": (
        {
            "update_state_after_alloc": "abstract method "
            "(self, request, blocks, num_external_tokens, num_local_tokens)"
        },
        "KVBridgeConnector.update_state_after_alloc: lacks parameter 4 'num_local_tokens'",
    ),
    "reordered parameters": (
        {"request_finished": "method (self, block_ids, request)"},
        "KVBridgeConnector.request_finished: parameter 1 is named 'request', vLLM's 'block_ids'"
        "|KVBridgeConnector.request_finished: parameter 2 is named 'block_ids', vLLM's 'request'",
    ),
    "hook removed": (
        {"on_new_request": None},
        "KVBridgeConnector.on_new_request: not a method of KVConnectorBase_V1, SupportsHMA",
    ),
    "new abstract hook": (
        {"get_pending_loads": "abstract method (self, request)"},
        "KVBridgeConnector: does not define KVConnectorBase_V1.get_pending_loads, "
        "which is abstract",
    ),
    "kwargs added": (
        {"wait_for_save": "abstract method (self, **kwargs)"},
        "KVBridgeConnector.wait_for_save: lacks **kwargs, which vLLM's has",
    ),
    "new keyword-only parameter": (
        {"register_kv_caches": "method (self, kv_caches, *, layer_names)"},
        "KVBridgeConnector.register_kv_caches: lacks keyword-only parameter 'layer_names'",
    ),
    "now positional-only": (
        {"get_finished": "method (self, finished_req_ids, /)"},
        "",  # vLLM passes it by position, the connector takes it so: no problem
    ),
    "now keyword-only": (
        {"register_kv_caches": "method (self, *, kv_caches)"},
        "",  # vLLM passes it by name, the connector's positional parameter takes it so
    ),
    "default added": (
        {"start_load_kv": "abstract method (self, forward_context=None, **kwargs)"},
        "KVBridgeConnector.start_load_kv: parameter 1 'forward_context' has no default, "
        "vLLM's has None",
    ),
    "kind changed": (
        {"build_kv_connector_stats": "method (self, data=None)"},
        "KVBridgeConnector.build_kv_connector_stats: a classmethod, vLLM's is a method",
    ),
    "default changed": (
        {"build_kv_connector_stats": "classmethod (cls, data={})"},
        "KVBridgeConnector.build_kv_connector_stats: parameter 1 'data' defaults to None, "
        "vLLM's {}",
    ),
}


@pytest.mark.parametrize("change", BASE_CHANGES)
def test_a_changed_base_is_reported(change: str) -> None:
    methods, expected = BASE_CHANGES[change]
    base = altered(live_class(KVConnectorBase_V1), **methods)
    problems = check_class(live_class(KVBridgeConnector), [base, live_class(SupportsHMA)])
    assert problems == (expected.split("|") if expected else [])


COMPATIBLE = [  # (vLLM's method, an override that accepts every call vLLM makes)
    ("method (self, request)", "method (self, request, extra=None)"),
    ("method (self, x, *, flag=False)", "method (self, x, **kwargs)"),
    ("method (self, x, /)", "method (self, y)"),
    ("method (self, x)", "method (self, x=None)"),
    ("method (self, x, **kwargs)", "method (self, *args, **kwargs)"),
]
INCOMPATIBLE = [  # (vLLM's method, an override that does not, the problem)
    ("method (self, x)", "method (self, x, /)", "parameter 1 'x' is POSITIONAL_ONLY"),
    ("method (self, *, f=False)", "method (self, *, f=True)", "'f' defaults to True"),
    ("method (self, x)", "method (self, x, *, y)", "adds keyword-only parameter 'y'"),
    ("method (self, *args)", "method (self, x=None)", "lacks *args"),
]


@pytest.mark.parametrize(("base", "over"), COMPATIBLE)
def test_an_override_that_accepts_every_call_passes(base: str, over: str) -> None:
    assert check_override(parse_method("m", base), parse_method("m", over)) == []


@pytest.mark.parametrize(("base", "over", "problem"), INCOMPATIBLE)
def test_an_override_that_refuses_a_call_is_reported(base: str, over: str, problem: str) -> None:
    problems = check_override(parse_method("m", base), parse_method("m", over))
    assert [line for line in problems if problem in line] != [], problems


def test_a_base_attribute_gone_is_reported() -> None:
    base = live_class(KVConnectorBase_V1)
    base = dataclasses.replace(base, attrs=base.attrs - {"_kv_cache_config"})
    problems = check_class(live_class(KVBridgeConnector), [base, live_class(SupportsHMA)])
    assert problems == ["KVBridgeConnector: uses self._kv_cache_config, which no base defines"]


def test_a_changed_snapshot_is_reported() -> None:
    """The same through the JSON a snapshot holds (a hook renamed in its text)."""
    snap = snapshot(DATA / "vllm-0.33.0.json")
    base = snap["classes"]["KVConnectorBase_V1"]
    base["methods"]["get_finished"] = "method (self, finished_request_ids)"
    apis = [from_json(n, snap["classes"][n]) for n in ("KVConnectorBase_V1", "SupportsHMA")]
    assert check_class(live_class(KVBridgeConnector), apis) == [
        "KVBridgeConnector.get_finished: parameter 1 is named 'finished_req_ids', "
        "vLLM's 'finished_request_ids'"
    ]


class RenamedHook(KVBridgeConnector):
    def get_num_new_matched_tokens(
        self, req: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False


class MisspelledHook(KVBridgeConnector):
    def request_finish(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return False, None


class TwoArguments(KVBridgeConnector):
    def __init__(self, vllm_config: Any, role: Any):
        super().__init__(vllm_config, role, None)


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (
            RenamedHook,
            "RenamedHook.get_num_new_matched_tokens: parameter 1 is named 'req', vLLM's 'request'",
        ),
        (
            MisspelledHook,
            "MisspelledHook.request_finish: not a method of KVConnectorBase_V1, SupportsHMA",
        ),
    ],
    ids=["renamed", "misspelled"],
)
def test_a_changed_connector_is_reported(cls: type, expected: str) -> None:
    bases = [live_class(KVConnectorBase_V1), live_class(SupportsHMA)]
    assert check_class(live_impl(cls), bases) == [expected]


def test_a_constructor_vllm_cannot_call_is_reported() -> None:
    call = factory_call(inspect.getsource(factory))
    assert check_construct(live_class(TwoArguments).methods["__init__"], call) == [
        "__init__: takes 2 positional arguments, the factory passes 3",
        "__init__: vLLM's factory requires a parameter 'kv_cache_config' it can name",
    ]
    # vLLM's loader agrees: it refuses the class
    cfg = KVTransferConfig(
        kv_connector="TwoArguments", kv_connector_module_path=__name__, kv_role="kv_both"
    )
    with pytest.raises(ValueError, match="2-argument constructor"):
        KVConnectorFactory.get_connector_class(cfg)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (Construct(4, (), ()), "__init__: takes 3 positional arguments, the factory passes 4"),
        (
            Construct(3, ("kv_events",), ()),
            "__init__: vLLM's factory passes 'kv_events', __init__ has no such parameter",
        ),
        (
            Construct(1, (), ()),
            "__init__: parameter 'role' is not passed by vLLM's factory and has no default",
        ),
    ],
)
def test_a_changed_factory_call_is_reported(call: Construct, expected: str) -> None:
    assert check_construct(live_class(KVBridgeConnector).methods["__init__"], call) == [expected]
