"""The engine-neutral half of an engine adapter, between an engine's own hooks and
:mod:`kvbridge.api`: the handle codec and D's prompt check (``handles.py``), the job
record, its tables and the handle ↔ request bookkeeping (``jobs.py``), the outcome →
metrics schema (``metrics.py``). The vLLM integration uses all of these; the reference
engine the handle codec, ``LoadJob``, ``edge_tables``, ``failure`` and ``summed``. Nothing
here imports an engine or torch."""

from kvbridge.adapter.handles import HANDLE_KEY, decode_handle, encode_handle, refusal
from kvbridge.adapter.jobs import (
    Loading,
    LoadJob,
    Requests,
    edge_tables,
    failure,
    state_slot,
    state_tables,
)
from kvbridge.adapter.metrics import (
    Metric,
    Tally,
    increase,
    metrics,
    observation,
    reduce,
    register_metric,
    summed,
)

__all__ = [
    "HANDLE_KEY",
    "LoadJob",
    "Loading",
    "Metric",
    "Requests",
    "Tally",
    "decode_handle",
    "edge_tables",
    "encode_handle",
    "failure",
    "increase",
    "metrics",
    "observation",
    "reduce",
    "refusal",
    "register_metric",
    "state_slot",
    "state_tables",
    "summed",
]
