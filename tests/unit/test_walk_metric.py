"""Change-walk "a new metric": one entry in the adapter's table, registered here, reaches
vLLM's Prometheus registry (through the connector's stats classes) and the summary."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbridge.adapter import Metric, metrics, observation, register_metric
from kvbridge.adapter.metrics import done
from kvbridge.api import Outcome
from kvbridge.integrations.vllm.connector import KVBridgeConnector
from kvbridge.integrations.vllm.stats import KVBridgeStats

# the change: one line per metric (a counter of an Outcome field, a labelled histogram)
NEW = (
    Metric("walk_staged_runs", "Runs moved through staging.", load=done(lambda o: o.staged_runs), summary=("walk_staged", sum)),  # noqa: E501
    Metric("walk_load_bytes", "Bytes per load, by mover.", ("mover",), lambda o: [(o.mover, o.bytes)] if o.ok else [], buckets=(1e3, 5e3)),  # noqa: E501
)  # fmt: skip
for _m in NEW:
    if _m.name not in {m.name for m in metrics()}:
        register_metric(_m)

LOADS = (
    Outcome("a", True, bytes=4096, descriptors=2, seconds=0.004, staged_runs=3, mover="pull"),
    Outcome("b", True, bytes=2_000_000, descriptors=9, seconds=0.02, staged_runs=5, mover="push"),
    Outcome("c", False, seconds=0.5, staged_runs=7, error="TransferTimeout: late"),
)


def _registry(*outcomes: Outcome) -> tuple[CollectorRegistry, KVBridgeStats]:
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVBridgeConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}
    )
    stats = KVBridgeStats(data={"loads": [observation(o) for o in outcomes]})
    prom.observe(stats.data)
    return reg, stats


def test_a_registered_counter_reaches_prometheus_and_the_summary() -> None:
    reg, stats = _registry(*LOADS)
    # loads done only (done()): 3 + 5, the failed load's 7 is not counted
    assert reg.get_sample_value("vllm:kvbridge_walk_staged_runs_total", {"engine": "0"}) == 8
    assert stats.reduce()["walk_staged"] == 8
    assert list(stats.reduce())[:6] == [
        "loads",
        "failed",
        "MiB",
        "descriptors",
        "median_load_ms",
        "walk_staged",
    ]
    doc = [m for m in reg.collect() if m.name == "vllm:kvbridge_walk_staged_runs"]
    assert (
        doc and doc[0].documentation == "Runs moved through staging." and doc[0].type == "counter"
    )


def test_a_registered_histogram_has_its_label_and_buckets() -> None:
    reg, _ = _registry(*LOADS)
    name = "vllm:kvbridge_walk_load_bytes"
    push, pull = {"engine": "0", "mover": "push"}, {"engine": "0", "mover": "pull"}
    assert reg.get_sample_value(name + "_bucket", {**pull, "le": "1000.0"}) == 0
    assert reg.get_sample_value(name + "_bucket", {**pull, "le": "5000.0"}) == 1
    assert reg.get_sample_value(name + "_bucket", {**push, "le": "5000.0"}) == 0
    assert reg.get_sample_value(name + "_sum", push) == 2_000_000


def test_the_built_in_metrics_keep_their_summary() -> None:
    """The table's built-in entries give vLLM's log line its keys and values."""
    _, stats = _registry(*LOADS)
    stats.data["events"] = {"release": 2, "lease_done": 1}
    got = stats.reduce()
    mib = round((4096 + 2_000_000) / 2**20, 3)
    want = {"loads": 3, "failed": 1, "MiB": mib, "descriptors": 11, "median_load_ms": 20.0}
    assert {k: got[k] for k in want} == want
    assert list(got)[-2:] == ["lease_done", "release"] and got["release"] == 2
