"""The connector's metrics in vLLM: per-load observations from the workers
(:class:`KVBridgeStats`, carried by vLLM from workers to its stat loggers) and their
Prometheus form (:class:`KVBridgePromMetrics`, on the server's ``/metrics``)::

    vllm:kvbridge_loads_total{outcome}          loads finished, per D rank
    vllm:kvbridge_loads_by_mover_total{mover}   loads done, by how the bytes moved: kernel
                                                (P's memory mapped), pull or push
    vllm:kvbridge_load_failures_total{cause}    failed loads by error type
    vllm:kvbridge_transferred_bytes_total       bytes moved into D
    vllm:kvbridge_descriptors_total             runs posted to the transport
    vllm:kvbridge_load_seconds                  load time, queue to verified (histogram;
                                                loads done only)
    vllm:kvbridge_failed_load_seconds{cause}    time from queue to the failure of each
                                                failed load, e.g. a timeout (histogram,
                                                to 300 s; loads refused before they
                                                were queued are counted, not timed)
    vllm:kvbridge_load_stage_seconds{stage}     queue, handshake, lease, plan, post,
                                                transfer, verify (histogram)
    vllm:kvbridge_leases_total{end}             P: leases ended (done: every D rank
                                                confirmed; expired; aborted)
    vllm:kvbridge_releases_total                D: handles released unread (the prompt
                                                was cached whole on D)
    vllm:kvbridge_refused_total{what, cause}    P: refused or foreign messages, by cause
                                                (what: lease, a confirm/fail/renew/begin;
                                                push, a PushRuns to a rank)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.api import Outcome

_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_FAILED_BUCKETS = [*_BUCKETS, 15.0, 30.0, 60.0, 120.0, 300.0]
"""A failure often comes at a deadline (``timeout_s``, 10 s by default) or later."""


def observation(out: Outcome) -> dict[str, Any]:
    cause = out.error.split(":", 1)[0] if out.error else ""
    return {
        "ok": out.ok,
        "bytes": out.bytes,
        "descriptors": out.descriptors,
        "seconds": out.seconds,
        "stages": dict(out.stages),
        "cause": cause,
        "mover": out.mover,
    }


def increase(counts: Mapping[str, int], seen: dict[str, int]) -> dict[str, int]:
    """What ``counts`` (a counter by cause) gained since ``seen``, which becomes a copy
    of it."""
    now = dict(counts)  # one copy: the counter may grow on another thread meanwhile
    out = {k: n - seen.get(k, 0) for k, n in now.items() if n > seen.get(k, 0)}
    seen.clear()
    seen.update(now)
    return out


@dataclass
class KVBridgeStats(KVConnectorStats):
    """``data = {"loads": [observation, ...], "events": {name: count}}`` since the last
    report; events are ``lease_done``, ``lease_expired``, ``lease_aborted``, ``release``,
    and refusals at P: ``refused_lease:<cause>`` (a lease op, counted by rank 0) and
    ``refused_push:<cause>`` (a push, counted by the rank it reached)."""

    def __post_init__(self) -> None:
        self.data.setdefault("loads", [])
        self.data.setdefault("events", {})

    def reset(self) -> None:
        fresh: dict[str, Any] = {"loads": [], "events": {}}
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data["loads"] = self.data["loads"] + list(other.data.get("loads", []))
        events = dict(self.data["events"])
        for k, n in other.data.get("events", {}).items():
            events[k] = events.get(k, 0) + n
        self.data["events"] = events
        return self

    def reduce(self) -> dict[str, int | float]:
        loads = self.data["loads"]
        ok = [o for o in loads if o["ok"]]
        secs = sorted(o["seconds"] for o in ok) or [0.0]
        return {
            "loads": len(loads),
            "failed": len(loads) - len(ok),
            "MiB": round(sum(o["bytes"] for o in ok) / 2**20, 3),
            "descriptors": sum(o["descriptors"] for o in ok),
            "median_load_ms": round(secs[len(secs) // 2] * 1e3, 3),
            **{k: int(n) for k, n in sorted(self.data["events"].items())},
        }

    def is_empty(self) -> bool:
        return not self.data["loads"] and not self.data["events"]


class KVBridgePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        c, h = self._counter_cls, functools.partial(self._histogram_cls, buckets=_BUCKETS)
        self.loads = c(
            name="vllm:kvbridge_loads",
            documentation="KV loads finished, per D rank.",
            labelnames=[*labelnames, "outcome"],
        )
        self.movers = c(
            name="vllm:kvbridge_loads_by_mover",
            documentation="KV loads done, by mover (kernel, pull, push).",
            labelnames=[*labelnames, "mover"],
        )
        self.failures = c(
            name="vllm:kvbridge_load_failures",
            documentation="Failed KV loads by cause.",
            labelnames=[*labelnames, "cause"],
        )
        self.bytes = c(
            name="vllm:kvbridge_transferred_bytes",
            documentation="Bytes moved into D.",
            labelnames=labelnames,
        )
        self.descs = c(
            name="vllm:kvbridge_descriptors",
            documentation="Runs posted to the transport.",
            labelnames=labelnames,
        )
        self.seconds = h(
            name="vllm:kvbridge_load_seconds",
            documentation="Load time, queued to verified.",
            labelnames=labelnames,
        )
        self.failed_seconds = self._histogram_cls(
            buckets=_FAILED_BUCKETS,
            name="vllm:kvbridge_failed_load_seconds",
            documentation="Time to the failure of failed loads, queued to failed, by cause.",
            labelnames=[*labelnames, "cause"],
        )
        self.stages = h(
            name="vllm:kvbridge_load_stage_seconds",
            documentation="Time per load stage.",
            labelnames=[*labelnames, "stage"],
        )
        self.leases = c(
            name="vllm:kvbridge_leases",
            documentation="P: leases ended (done, expired, aborted).",
            labelnames=[*labelnames, "end"],
        )
        self.releases = c(
            name="vllm:kvbridge_releases",
            documentation="D: handles released unread (prompt cached whole on D).",
            labelnames=labelnames,
        )
        self.refused = c(
            name="vllm:kvbridge_refused",
            documentation="P: refused or foreign lease ops and pushes, by cause.",
            labelnames=[*labelnames, "what", "cause"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """A failed load's time goes to its own histogram, not to ``load_seconds`` under
        an ``outcome`` label: a new label would change that metric's series and break
        queries and dashboards built on it. A load refused before it was queued (bad
        handle, prompt mismatch: 0 s, no stages) is counted but not timed."""
        lv = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for name, n in transfer_stats_data.get("events", {}).items():
            if name.startswith("lease_"):
                self.leases.labels(*lv, name.removeprefix("lease_")).inc(n)
            elif name == "release":
                self.releases.labels(*lv).inc(n)
            elif name.startswith("refused_"):
                what, _, cause = name.removeprefix("refused_").partition(":")
                self.refused.labels(*lv, what, cause or "unknown").inc(n)
        for o in transfer_stats_data.get("loads", []):
            self.loads.labels(*lv, "ok" if o["ok"] else "failed").inc()
            if not o["ok"]:
                self.failures.labels(*lv, o["cause"] or "unknown").inc()
                if o["seconds"] or o["stages"]:  # it was queued
                    cause = o["cause"] or "unknown"
                    self.failed_seconds.labels(*lv, cause).observe(o["seconds"])
                continue
            self.movers.labels(*lv, o.get("mover") or "unknown").inc()
            self.bytes.labels(*lv).inc(o["bytes"])
            self.descs.labels(*lv).inc(o["descriptors"])
            self.seconds.labels(*lv).observe(o["seconds"])
            for stage, s in o["stages"].items():
                self.stages.labels(*lv, stage).observe(s)
