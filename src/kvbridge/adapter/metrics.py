"""The outcome → metrics schema: one table, :func:`metrics` (:data:`BUILT_IN`, then
each :func:`register_metric`), of what an engine reports about loads (read from each
:class:`Outcome`) and events (counted by name). It drives the per-load
:func:`observation`, its summary (:func:`reduce`) and an engine's metric objects: a new
metric is one entry. An observation maps a metric's name to the samples one load gave
it (plain tuples: observations cross process boundaries)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.api import Outcome, Policy
from kvbridge.registry import Registry

Sample = tuple[Any, ...]
"""``(label value, ..., amount)``."""

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FAILED_BUCKETS = (*BUCKETS, 15.0, 30.0, 60.0, 120.0, 300.0)
"""A failure often comes at a deadline (``timeout_s``, 10 s by default) or later."""


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric: a counter, or a histogram where it has ``buckets``; its samples come
    from each load (``load``) or from events (``event``: an event's name → its label
    values, None if the event is not this metric's); ``summary``: its key in
    :func:`reduce` and how the samples' amounts are summed up there."""

    name: str
    doc: str
    labels: tuple[str, ...] = ()
    load: Callable[[Outcome], list[Sample]] | None = None
    event: Callable[[str], tuple[str, ...] | None] | None = None
    buckets: tuple[float, ...] = ()
    summary: tuple[str, Callable[[list[Any]], int | float]] | None = None


def done(read: Callable[[Outcome], Any]) -> Callable[[Outcome], list[Sample]]:
    """One unlabelled sample, ``read(outcome)``, per load done."""
    return lambda o: [(read(o),)] if o.ok else []


def cause(out: Outcome) -> str:
    """A failed load's error type (the error text up to its first ``:``)."""
    return out.error.split(":", 1)[0] or "unknown"


def _route(o: Outcome) -> str:
    return "staged" if o.staged_runs else "direct"


def _failed_time(o: Outcome) -> list[Sample]:
    """A failed load's time, queued to failed: its own metric, not ``load_seconds`` under
    an ``outcome`` label (a new label would change that metric's series and break the
    queries built on it); a load refused before it was queued (0 s, no stages) is counted,
    not timed."""
    return [(cause(o), o.seconds)] if not o.ok and (o.seconds or o.stages) else []


def _median_ms(secs: list[float]) -> float:
    s = sorted(secs) or [0.0]
    return round(s[len(s) // 2] * 1e3, 3)


def _prefixed(prefix: str) -> Callable[[str], tuple[str, ...] | None]:
    return lambda n: (n.removeprefix(prefix),) if n.startswith(prefix) else None


def _refused(name: str) -> tuple[str, ...] | None:
    what, _, why = name.removeprefix("refused_").partition(":")
    return (what, why or "unknown") if name.startswith("refused_") else None


_METRICS: Registry[Metric] = Registry("metric")


def register_metric(metric: Metric) -> None:
    """Observations, :func:`reduce` and metric objects built after this include ``metric``."""
    _METRICS.register(metric.name, metric)


def metrics() -> tuple[Metric, ...]:
    """Every metric, in registration order (the order of :func:`reduce`'s keys)."""
    return tuple(_METRICS.get(n) for n in _METRICS.names())


BUILT_IN: tuple[Metric, ...] = (
    Metric(
        "loads",
        "KV loads finished, per D rank.",
        ("outcome",),
        lambda o: [("ok" if o.ok else "failed", 1)],
        summary=("loads", sum),
    ),
    Metric(
        "loads_by_mover",
        "KV loads done, by mover (kernel, pull, push).",
        ("mover",),
        lambda o: [(o.mover or "unknown", 1)] if o.ok else [],
    ),
    Metric(
        "loads_by_route",
        "KV loads done, by mover and route (direct, or staged where any source rank "
        "went through the staging area).",
        ("mover", "route"),
        lambda o: [(o.mover or "unknown", _route(o), 1)] if o.ok else [],
    ),
    Metric(
        "load_failures",
        "Failed KV loads by cause.",
        ("cause",),
        lambda o: [] if o.ok else [(cause(o), 1)],
        summary=("failed", sum),
    ),
    Metric(
        "transferred_bytes",
        "Bytes moved into D.",
        load=done(lambda o: o.bytes),
        summary=("MiB", lambda b: round(sum(b) / 2**20, 3)),
    ),
    Metric(
        "descriptors",
        "Runs posted to the transport.",
        load=done(lambda o: o.descriptors),
        summary=("descriptors", sum),
    ),
    Metric(
        "load_seconds",
        "Load time, queued to verified.",
        load=done(lambda o: o.seconds),
        buckets=BUCKETS,
        summary=("median_load_ms", _median_ms),
    ),
    Metric(
        "failed_load_seconds",
        "Time to the failure of failed loads, queued to failed, by cause.",
        ("cause",),
        _failed_time,
        buckets=FAILED_BUCKETS,
    ),
    Metric(
        "load_stage_seconds",
        "Time per load stage.",
        ("stage",),
        lambda o: list(o.stages.items()) if o.ok else [],
        buckets=BUCKETS,
    ),
    Metric(
        "leases", "P: leases ended (done, expired, aborted).", ("end",), event=_prefixed("lease_")
    ),
    Metric(
        "parks",
        "P with a park: finished requests by where their KV waits for D (parked; held in "
        "vLLM's blocks: park full, or blocks not those copied).",
        ("where",),
        event=_prefixed("park_"),
    ),
    Metric(
        "releases",
        "D: handles released unread (prompt cached whole on D).",
        event=lambda n: () if n == "release" else None,
    ),
    Metric(
        "refused",
        "P: refused or foreign lease ops and pushes, by cause.",
        ("what", "cause"),
        event=_refused,
    ),
)
"""The metrics every engine reports, registered below in this order."""
for _m in BUILT_IN:
    register_metric(_m)


def observation(out: Outcome) -> dict[str, list[Sample]]:
    """One finished load as the samples it gives each load metric."""
    return {m.name: list(m.load(out)) for m in metrics() if m.load is not None}


def reduce(loads: Sequence[Mapping[str, Any]], events: Mapping[str, int]) -> dict[str, int | float]:
    """A summary of ``loads`` (observations) and ``events``: one key per metric with a
    ``summary``, then each event's count."""
    out: dict[str, int | float] = {}
    for m in metrics():
        if m.summary is not None:
            key, how = m.summary
            out[key] = how([s[-1] for o in loads for s in o.get(m.name, ())])
    return {**out, **{k: int(n) for k, n in sorted(events.items())}}


def increase(counts: Mapping[str, int], seen: dict[str, int]) -> dict[str, int]:
    """What ``counts`` (a counter by cause) gained since ``seen``, which becomes a copy
    of it."""
    now = dict(counts)  # one copy: the counter may grow on another thread meanwhile
    out = {k: n - seen.get(k, 0) for k, n in now.items() if n > seen.get(k, 0)}
    seen.clear()
    seen.update(now)
    return out


class Tally:
    """Loads finished (as observations) and events counted since the last
    :meth:`take`, and totals since start."""

    def __init__(self) -> None:
        self.observed: list[dict[str, list[Sample]]] = []
        self.events: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()  # loads ok / failed (by cause), bytes, events

    def load(self, out: Outcome) -> None:
        self.totals.update(
            loads_ok=int(out.ok),
            loads_failed=int(not out.ok),
            bytes=out.bytes,
            descriptors=out.descriptors,
        )
        self.observed.append(observation(out))
        if not out.ok:
            self.totals[f"failed_{(out.error or 'unknown').split(':', 1)[0]}"] += 1

    def event(self, name: str, n: int = 1, total: str = "", report: bool = True) -> None:
        """Count event ``name`` in the totals (as ``total``, if given) and, if
        ``report``, in the next :meth:`take`."""
        self.totals[total or name] += n
        if report:
            self.events[name] += n

    def take(self) -> tuple[list[dict[str, list[Sample]]], dict[str, int]]:
        out, events = self.observed, dict(self.events)
        self.observed, self.events = [], Counter()
        return out, events


def summed(request_id: str, outcomes: Sequence[Outcome]) -> Outcome:
    """One request's outcomes on several D ranks as one: ok if every rank's is; bytes
    and descriptors summed, seconds of the slowest rank, the failed ranks' errors."""
    error = "; ".join(f"D rank {r}: {o.error}" for r, o in enumerate(outcomes) if not o.ok)
    fail = any(o.action is Policy.FAIL for o in outcomes)
    return Outcome(
        request_id,
        all(o.ok for o in outcomes),
        bytes=sum(o.bytes for o in outcomes),
        descriptors=sum(o.descriptors for o in outcomes),
        seconds=max((o.seconds for o in outcomes), default=0.0),
        action=Policy.FAIL if fail else Policy.RECOMPUTE,
        error=error,
    )
