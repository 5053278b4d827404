"""A load's start on the engine's thread (:attr:`Consumer.inline`): where nothing there
waits — a worker idle for it, P known (no handshake), no mapping or geometry to make,
the peer's fast channel free — :meth:`Consumer.load` sends ``begin``, plans and, on a
GPU, launches the kernel mover's copies before it returns, and a worker ends the load
(``docs/performance.md``, "The queue hand-off")."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from kvbridge.connector.load import LoadState, Started, _Load
from kvbridge.connector.movers.registry import Rank, launch_early, plan_ready
from kvbridge.connector.peers import Peer, PeerCache
from kvbridge.plan.plan import Plan
from kvbridge.spec.model import ModelSpec

log = logging.getLogger(__name__)


class Starting(Rank, Protocol):
    """What the inline start and :func:`~kvbridge.connector.prepare.prepare` use of a D
    rank (a :class:`~kvbridge.connector.consumer.Consumer` is one)."""

    @property
    def peers(self) -> PeerCache: ...

    @property
    def spec(self) -> ModelSpec: ...

    def closing(self) -> bool: ...

    def release_peer(self, peer: Peer) -> None: ...

    def plan(self, peer: Peer, job: _Load) -> Plan: ...


def start(d: Starting, job: _Load) -> Started | None:
    """``job`` started on the caller's thread (see the module), else None, nothing done,
    where something would wait (:func:`plan_ready`, :meth:`LeaseCalls.try_begin`). An
    error after ``begin`` went out is kept for the worker, which takes P's answer first."""
    peer = d.peers.ready(job.handle)
    if peer is None:
        return None
    answer = None
    try:
        if plan_ready(d, peer):
            answer = d.leases.try_begin(peer, job)
    except Exception:  # never the caller's: the worker starts the load instead
        log.exception("starting %s on the caller's thread failed", job.handle.request_id)
    if answer is None:
        d.release_peer(peer)
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
        return Started(None, answer, e, t0)
    except BaseException:  # the caller's (an interrupt): nothing held past it
        answer.take(quiet=True)
        if job.launched is not None:
            job.launched.finish()
        d.release_peer(peer)
        raise
    return Started(plan, answer, None, t0)


def abandon(d: Starting, job: _Load, call: Callable[..., object]) -> None:
    """A load :func:`start` began (``job.started``) that no worker will run
    (:meth:`Consumer.close`, or ``load`` failing after it): P's answer taken (its channel
    freed), the copies ended, ``fail`` sent (through ``call``: at once, or by another
    thread), the peer released."""
    started, job.started = job.started, None
    if started is None:
        return
    started.answer.take(quiet=True)
    if job.launched is not None:
        with contextlib.suppress(Exception):
            job.launched.finish()
    with contextlib.suppress(Exception):
        call(d.leases.report_failure, job)
    if job.peer is not None:
        d.peers.done(job.peer)


def taken_over(job: _Load, started: Started) -> Plan:
    """A worker takes over a load :func:`start` began → its plan, or its error raised
    (the worker takes P's answer before it reports it)."""
    job.lap("handoff")
    if started.plan is None:
        assert started.error is not None
        raise started.error
    return started.plan


__all__ = ["Started", "abandon", "start", "taken_over"]
