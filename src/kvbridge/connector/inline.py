"""A load's start on the engine's thread (:attr:`Consumer.inline`): where nothing there
waits, :meth:`Consumer.load` sends ``begin``, plans and launches an early mover before it
returns, and a worker ends the load (``docs/performance.md``, "The queue hand-off")."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.connector.lease_calls import Answer
from kvbridge.connector.load import LoadState, _Load
from kvbridge.connector.movers import launch_early, plan_ready
from kvbridge.connector.peers import Peer
from kvbridge.plan.plan import Plan

if TYPE_CHECKING:
    from kvbridge.connector.consumer import Consumer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Started:
    """What :func:`start` did: the peer (in use), the plan (None: planning failed with
    ``error``), when ``begin`` was sent, P's answer to take, and the load's start
    (``perf_counter``: the end of its ``queue`` stage)."""

    peer: Peer
    plan: Plan | None
    begun: float
    answer: Answer
    error: Exception | None
    t0: float


def start(d: Consumer, job: _Load) -> Started | None:
    """``job`` started on the caller's thread, where nothing waits: P known (no
    handshake), nothing to map or make (:func:`plan_ready`), the peer's fast channel free
    (:meth:`LeaseCalls.try_begin`); then ``begin`` sent, the plan made, an early mover
    launched (the kernel mover on a GPU). None, nothing done, where something would
    wait. An error after ``begin`` went out is kept for the worker, which takes P's
    answer first."""
    peer = d.peers.ready(job.handle)
    if peer is None:
        return None
    begun, answer = time.monotonic(), None
    try:
        if plan_ready(d, peer):
            answer = d.leases.try_begin(peer, job)
    except Exception:  # never the caller's: the worker starts the load instead
        log.exception("starting %s on the caller's thread failed", job.handle.request_id)
    if answer is None:
        d.peers.done(peer)
        return None
    job.lap("queue")
    t0 = job.mark  # the load's seconds, as a worker's: from the end of "queue"
    job.move(LoadState.HANDSHAKE)
    job.lap("handshake")
    try:
        plan = d.plan(peer, job)
        if launch_early(d, peer, plan, job):
            job.lap("launch")
    except Exception as e:  # the worker reports it, after P's answer
        return Started(peer, None, begun, answer, e, t0)
    return Started(peer, plan, begun, answer, None, t0)


def taken_over(job: _Load, started: Started) -> tuple[Peer, Plan, float, Answer]:
    """A worker takes over a load :func:`start` began: (peer, plan, when ``begin`` was
    sent, P's answer); its error raised once P's answer was taken (the token goes with
    ``fail``)."""
    job.lap("handoff")
    if started.plan is None:
        started.answer.take(quiet=True)
        assert started.error is not None
        raise started.error
    return started.peer, started.plan, started.begun, started.answer


__all__ = ["Started", "start", "taken_over"]
