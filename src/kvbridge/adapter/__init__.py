"""The engine-neutral half of an engine adapter: what every engine's connector needs
between its own hooks and :mod:`kvbridge.api`.

    handles.py   the handle codec (text in a request's transfer params, or bytes) and
                 the prompt check D makes before a load
    jobs.py      the job record (:class:`LoadJob`), its tables (:func:`state_tables`:
                 the block holding a state group's running state), a failed load's
                 :class:`Outcome`, the handle ↔ request bookkeeping of the scheduler
                 (:class:`Requests`) and of a D rank (:class:`Loading`)
    metrics.py   the outcome → metrics schema: one table (:func:`metrics`) drives the
                 per-load observation, its summary and an engine's metric objects

The vLLM integration (``kvbridge.integrations.vllm``) uses all of these; the reference
engine (``src/refengine``, which has no scheduler queue or Mamba slots of vLLM's kind)
the handle codec, ``LoadJob``, ``failure`` and ``summed``. An engine adapter adds only
that engine's hooks. Nothing here imports an engine, torch or numpy.
"""

from kvbridge.adapter.handles import HANDLE_KEY, decode_handle, encode_handle, refusal
from kvbridge.adapter.jobs import Loading, LoadJob, Requests, failure, state_tables
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
    "encode_handle",
    "failure",
    "increase",
    "metrics",
    "observation",
    "reduce",
    "refusal",
    "register_metric",
    "state_tables",
    "summed",
]
