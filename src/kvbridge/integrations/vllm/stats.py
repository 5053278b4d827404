"""The connector's metrics in vLLM: per-load observations from the workers
(:class:`KVBridgeStats`, carried by vLLM from workers to its stat loggers) and their
Prometheus form (:class:`KVBridgePromMetrics`, on the server's ``/metrics``): one counter
(``vllm:kvbridge_<name>_total``) or histogram (``vllm:kvbridge_<name>``) per metric of
the adapter's table (:mod:`kvbridge.adapter.metrics`; listed in docs/vllm.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.adapter import metrics, reduce


@dataclass
class KVBridgeStats(KVConnectorStats):
    """``data = {"loads": [observation, ...], "events": {name: count}}`` since the last
    report (:func:`kvbridge.adapter.observation`); events are ``lease_done``,
    ``lease_expired``, ``lease_aborted``, ``release``, and refusals at P:
    ``refused_lease:<cause>`` (a lease op, counted by rank 0) and
    ``refused_push:<cause>`` (a push, counted by the rank it reached)."""

    def __post_init__(self) -> None:
        self.data.setdefault("loads", [])
        self.data.setdefault("events", {})

    def reset(self) -> None:
        fresh: dict[str, Any] = {"loads": [], "events": {}}
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data["loads"] = self.data["loads"] + list(other.data.get("loads", []))
        self.data["events"] = dict(
            Counter(self.data["events"]) + Counter(other.data.get("events", {}))
        )
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce(self.data["loads"], self.data["events"])

    def is_empty(self) -> bool:
        return not self.data["loads"] and not self.data["events"]


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter or histogram per metric of the adapter's table."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: Any,
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.table = metrics()
        self.prom: dict[str, Any] = {}
        for m in self.table:
            kind = self._histogram_cls if m.buckets else self._counter_cls
            extra = {"buckets": list(m.buckets)} if m.buckets else {}
            self.prom[m.name] = kind(
                name=f"vllm:kvbridge_{m.name}",
                documentation=m.doc,
                labelnames=[*labelnames, *m.labels],
                **extra,
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        lv = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for name, n in transfer_stats_data.get("events", {}).items():
            for m in self.table:
                labels = m.event(name) if m.event is not None else None
                if labels is not None:
                    self.prom[m.name].labels(*lv, *labels).inc(n)
                    break
        for o in transfer_stats_data.get("loads", []):
            for m in self.table:
                add = "observe" if m.buckets else "inc"
                for *labels, amount in o.get(m.name, ()):
                    getattr(self.prom[m.name].labels(*lv, *labels), add)(amount)
