"""The job record, its block tables (a state group cut to its one slot), and the handle
↔ request bookkeeping of an engine adapter.

The scheduler (one per engine) decides per request: load the handle's tokens
(:class:`LoadJob`), or release the handle unread; :class:`Requests` remembers what it
decided and queues it for the ranks. A D rank starts each job, maps the outcome back
from P's request id to its own, and reports a job refused before it began as a failed
:class:`Outcome` (:class:`Loading`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvbridge.adapter.handles import decode_handle
from kvbridge.api import (
    KVBridgeError,
    Outcome,
    PlanError,
    Policy,
    PromptMismatch,
    Tables,
    TransferHandle,
    checked_tables,
)


@dataclass(frozen=True, slots=True)
class LoadJob:
    """D: load ``handle``'s tokens beyond ``cached`` into local ``tables`` (per group;
    checked where the engine hands them over, :func:`~kvbridge.api.checked_tables`)."""

    request_id: str
    handle: str
    tables: Tables
    cached: int
    refused: str = ""
    """Why the scheduler refused the handle (e.g. it holds another prompt's KV): the
    load fails with this error, nothing is sent to P."""


def state_slot(block_size: int, mode: str, n_computed: int) -> int:
    """Where in a state group's block table the running state after ``n_computed``
    tokens is: block 0 in vLLM's ``mamba_cache_mode`` ``"none"``, block ``(n-1) //
    size`` in ``"align"``."""
    return 0 if mode == "none" else max(n_computed - 1, 0) // block_size


def state_tables(
    tables: Tables, state_blocks: Mapping[int, int], mode: str, n_computed: int
) -> Tables:
    """``tables`` with each state group ``g`` (``state_blocks[g]``: its block size in
    tokens) cut to its one state slot: the block holding the running state after
    ``n_computed`` tokens, block 0 in ``mode`` ``"none"`` and block ``(n-1) // size``
    in ``"align"`` (earlier entries: null or checkpoints). A group whose slot is missing
    (a null block, a short table) gets an empty table, which the plan refuses: that
    request fails alone. Checked tables stay checked (a slice of their ids)."""
    if not state_blocks:
        return tables
    ids = list(tables.ids)
    for g, bs in state_blocks.items():
        i = state_slot(bs, mode, n_computed)
        if g < len(ids):  # else too few tables: the rank's check refuses their count
            tab = ids[g]
            ids[g] = tab[i : i + 1] if i < len(tab) and tab[i] != 0 else tab[:0]
    return Tables(tuple(ids), tables.limits, tables.seal)


def edge_tables(tables: Sequence[Sequence[int]], limits: Sequence[int], who: str) -> Tables:
    """An engine's block ids as :class:`Tables`, checked once, where they enter. Ids the
    check refuses go on unsealed: the rank's :meth:`~kvbridge.api.Consumer.load` refuses
    them again, typed, so that load alone fails and P's lease is released at once."""
    try:
        return checked_tables(tables, limits, who)
    except PlanError:
        return Tables.unchecked(tables, limits)


def failure(request_id: str, error: Exception, action: Policy = Policy.RECOMPUTE) -> Outcome:
    """A load that failed before it was queued: 0 s and no stages, so it is counted but
    not timed (:mod:`kvbridge.adapter.metrics`)."""
    return Outcome(request_id, False, action=action, error=f"{type(error).__name__}: {error}")


class Requests:
    """The scheduler's view: requests prefilled for remote decode (P, until they end),
    requests whose handle was dealt with (D), and the loads and releases not yet sent to
    the ranks."""

    def __init__(self) -> None:
        self.remote: set[str] = set()
        self.started: set[str] = set()
        self._loads: list[LoadJob] = []
        self._releases: list[str] = []

    def prefill_for_remote(self, request_id: str) -> None:
        self.remote.add(request_id)

    def any_remote(self, request_ids: Iterable[str] | None) -> bool:
        """Whether one of ``request_ids`` (None: unknown, assume so) leaves with a handle."""
        return request_ids is None or any(r in self.remote for r in request_ids)

    def begun(self, request_id: str) -> bool:
        return request_id in self.started

    def load(self, job: LoadJob) -> None:
        self.started.add(job.request_id)
        self._loads.append(job)

    def release(self, request_id: str, handle: str = "") -> None:
        """D needs none of the handle's blocks; ``handle`` "" keeps it (it is not this
        prompt's: releasing it would end another request's lease)."""
        self.started.add(request_id)
        if handle:
            self._releases.append(handle)

    def finished(self, request_id: str) -> None:
        self.started.discard(request_id)
        self.remote.discard(request_id)

    def take(self) -> tuple[list[LoadJob], list[str]]:
        """The loads and releases queued since the last call."""
        out = self._loads, self._releases
        self._loads, self._releases = [], []
        return out


class Loading:
    """A D rank's loads: P request id → D request id while loading, and the failures of
    jobs that never began."""

    def __init__(self) -> None:
        self._by_handle: dict[str, str] = {}
        self._failed: list[Outcome] = []

    def start(self, job: LoadJob, load: Callable[[TransferHandle, LoadJob], None]) -> None:
        """Decode ``job``'s handle and ``load(handle, job)``; :class:`KVBridgeError` if the job is
        refused (by the scheduler, a malformed handle, one already loading) or the load."""
        if job.refused:  # by the scheduler, which has the prompt: nothing reaches P
            raise PromptMismatch(job.refused)
        handle = decode_handle(job.handle)
        if handle.request_id in self._by_handle:
            raise KVBridgeError(f"handle of P request {handle.request_id!r} is loading")
        self._by_handle[handle.request_id] = job.request_id
        try:
            load(handle, job)
        except KVBridgeError:
            self._by_handle.pop(handle.request_id, None)
            raise

    def fail(self, request_id: str, error: Exception) -> None:
        self._failed.append(failure(request_id, error))

    def finished(self, polled: Iterable[Outcome]) -> list[Outcome]:
        """The failures since the last call, then ``polled`` under D's request ids."""
        done, self._failed = self._failed, []
        for out in polled:
            rid = self._by_handle.pop(out.request_id, out.request_id)
            done.append(replace(out, request_id=rid))
        return done
