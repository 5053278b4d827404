"""D's load metrics in vLLM's Prometheus form: failed loads keep their time."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbridge.adapter import observation
from kvbridge.adapter.metrics import BUILT_IN
from kvbridge.api import Outcome
from kvbridge.integrations.vllm.connector import KVBridgeConnector
from kvbridge.integrations.vllm.stats import KVBridgeStats


def _observe(*outcomes: Outcome) -> CollectorRegistry:
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVBridgeConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}
    )
    stats = KVBridgeStats(data={"loads": [observation(o) for o in outcomes]})
    prom.observe(stats.data)
    return reg


def test_failed_loads_have_their_own_histogram() -> None:
    """A 10 s timeout is seen in ``failed_load_seconds`` under its cause; a done load in
    ``load_seconds`` alone, whose series keep their labels."""
    reg = _observe(
        Outcome("a", True, bytes=4096, descriptors=2, seconds=0.004, stages={"post": 0.001}),
        Outcome("b", False, seconds=10.2, error="TransferTimeout: READ did not end in 10 s"),
        Outcome("c", False, seconds=0.003, error="PromptMismatch: digest differs"),
    )
    eng = {"engine": "0"}
    failed = "vllm:kvbridge_failed_load_seconds"
    timeout = {**eng, "cause": "TransferTimeout"}
    assert reg.get_sample_value(failed + "_count", timeout) == 1
    assert reg.get_sample_value(failed + "_sum", timeout) == pytest.approx(10.2)
    assert reg.get_sample_value(failed + "_bucket", {**timeout, "le": "10.0"}) == 0
    assert reg.get_sample_value(failed + "_bucket", {**timeout, "le": "15.0"}) == 1
    assert reg.get_sample_value(failed + "_bucket", {**timeout, "le": "+Inf"}) == 1
    mismatch = {**eng, "cause": "PromptMismatch"}
    assert reg.get_sample_value(failed + "_sum", mismatch) == pytest.approx(0.003)
    assert reg.get_sample_value("vllm:kvbridge_load_seconds_count", eng) == 1
    assert reg.get_sample_value("vllm:kvbridge_load_seconds_sum", eng) == pytest.approx(0.004)
    loads = "vllm:kvbridge_loads_total"
    assert reg.get_sample_value(loads, {**eng, "outcome": "failed"}) == 2
    assert reg.get_sample_value(loads, {**eng, "outcome": "ok"}) == 1


def test_failure_without_a_cause_is_counted_unknown() -> None:
    reg = _observe(Outcome("a", False, seconds=0.5))
    labels = {"engine": "0", "cause": "unknown"}
    assert reg.get_sample_value("vllm:kvbridge_failed_load_seconds_count", labels) == 1


def test_load_refused_before_queueing_is_counted_not_timed() -> None:
    """The worker's refusals (bad handle, prompt mismatch) carry no time and no stages:
    they are no 0 s sample in ``failed_load_seconds``, which times queue to failure."""
    reg = _observe(
        Outcome("r", False, error="PromptMismatch: digest differs"),
        Outcome("q", False, seconds=0.2, stages={"queue": 0.2}, error="PromptMismatch: late"),
    )
    labels = {"engine": "0", "cause": "PromptMismatch"}
    assert reg.get_sample_value("vllm:kvbridge_load_failures_total", labels) == 2
    assert reg.get_sample_value("vllm:kvbridge_failed_load_seconds_count", labels) == 1
    assert reg.get_sample_value("vllm:kvbridge_failed_load_seconds_sum", labels) == 0.2


B = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
PINNED = {  # name: (type, labels besides the engine's, buckets): dashboards rely on these
    "vllm:kvbridge_loads": ("counter", ["outcome"], None),
    "vllm:kvbridge_loads_by_mover": ("counter", ["mover"], None),
    "vllm:kvbridge_loads_by_route": ("counter", ["mover", "route"], None),
    "vllm:kvbridge_load_failures": ("counter", ["cause"], None),
    "vllm:kvbridge_transferred_bytes": ("counter", [], None),
    "vllm:kvbridge_descriptors": ("counter", [], None),
    "vllm:kvbridge_load_seconds": ("histogram", [], B),
    "vllm:kvbridge_failed_load_seconds": ("histogram", ["cause"], [*B, 15, 30, 60, 120, 300]),
    "vllm:kvbridge_load_stage_seconds": ("histogram", ["stage"], B),
    "vllm:kvbridge_leases": ("counter", ["end"], None),
    "vllm:kvbridge_parks": ("counter", ["where"], None),
    "vllm:kvbridge_releases": ("counter", [], None),
    "vllm:kvbridge_refused": ("counter", ["what", "cause"], None),
}


def test_the_metric_names_types_labels_and_buckets_are_pinned() -> None:
    """The Prometheus series as released: a change to the metric table that renames,
    relabels or rebuckets one fails here (a new metric is added to this list)."""
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVBridgeConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}
    )
    ok = Outcome("a", True, bytes=1, descriptors=1, seconds=0.1, stages={"post": 0.1}, mover="pull")
    failed = Outcome("b", False, seconds=1.0, error="TransferTimeout: x")
    events = {"lease_done": 1, "release": 1, "refused_lease:other engine": 1, "park_held": 1}
    prom.observe({"loads": [observation(ok), observation(failed)], "events": events})
    got = {}
    for fam in reg.collect():
        if not fam.name.startswith("vllm:kvbridge_"):
            continue
        labels = sorted({k for s in fam.samples for k in s.labels} - {"engine", "le"})
        les = sorted({float(s.labels["le"]) for s in fam.samples if "le" in s.labels})
        got[fam.name] = (fam.type, labels, [x for x in les if x != float("inf")] or None)
    want = {k: (t, sorted(lab), b) for k, (t, lab, b) in PINNED.items()}
    built_in = {f"vllm:kvbridge_{m.name}" for m in BUILT_IN}  # not a test's own
    assert built_in == set(want)
    assert {k: v for k, v in got.items() if k in built_in} == want


def test_loads_are_counted_by_route() -> None:
    reg = _observe(
        Outcome("a", True, bytes=1, mover="pull", staged_runs=300),
        Outcome("b", True, bytes=1, mover="pull"),
        Outcome("c", True, bytes=1, mover="kernel"),
        Outcome("d", False, mover="push", error="TransferTimeout: x"),
    )
    for mover, route in (("pull", "staged"), ("pull", "direct"), ("kernel", "direct")):
        labels = {"engine": "0", "mover": mover, "route": route}
        assert reg.get_sample_value("vllm:kvbridge_loads_by_route_total", labels) == 1
    push = {"engine": "0", "mover": "push", "route": "direct"}
    assert reg.get_sample_value("vllm:kvbridge_loads_by_route_total", push) is None
