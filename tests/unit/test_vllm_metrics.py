"""D's load metrics in vLLM's Prometheus form: failed loads keep their time."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbridge.adapter import observation
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
