"""Moving a plan's runs by READ: :func:`read_runs`, the one function that posts runs to
a transport and waits for them (the connector, the reference engine, the test scenarios
and the benches), and :func:`pull`, the connector's pull mover: D READs a request's runs
from P, each source rank's runs posted as they are (direct) or, where the cost model says
so, through D's staging area (:mod:`kvbridge.connector.movers.staging`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from kvbridge.connector.load import _Load
from kvbridge.connector.movers.staging import Link, Stager
from kvbridge.connector.peers import Peer
from kvbridge.errors import TransferTimeout
from kvbridge.plan.plan import Plan
from kvbridge.plan.runs import Runs
from kvbridge.transport.base import Transport, XferHandle

POST_RUNS = 16384
"""Runs per posted READ request unless told (the consumer's ``post_runs``)."""


def read_runs(
    transport: Transport,
    agents: Mapping[int, str],
    runs: Mapping[int, Runs],
    deadline: float,
    live: list[XferHandle],
    post_runs: int = POST_RUNS,
    then: Callable[[], object] | None = None,
) -> int:
    """READ each source rank's ``runs`` from its peer ``agents[src]`` in requests of at
    most ``post_runs`` runs, the deadline (monotonic) checked before each (posting may
    copy inside the call: 512,000 small runs once took the whole deadline and more); call
    ``then``; wait for every READ until ``deadline``. Returns the runs posted. If anything
    fails (:class:`~kvbridge.errors.TransferTimeout` once the deadline passed), the READs
    that may still land are appended to ``live`` (fence them) and the error is raised."""
    handles: list[XferHandle] = []
    posted = 0
    try:
        for src, r in runs.items():
            agent = agents[src]
            s, d, n = r.as_uint64()
            for lo in range(0, len(r), post_runs):
                if time.monotonic() > deadline:
                    raise TransferTimeout(
                        f"deadline passed while posting: {lo} of {len(r)} runs posted"
                    )
                hi = lo + post_runs
                handles.append(transport.read(agent, d[lo:hi], s[lo:hi], n[lo:hi]))
                posted += len(n[lo:hi])
        if then is not None:
            then()
        for h in handles:
            transport.wait_or_keep(h, max(deadline - time.monotonic(), 0.0))
    except BaseException:
        live += [h for h in handles if not transport.ended(h)]
        raise
    return posted


def pull(
    transport: Transport,
    stager: Stager | None,
    peer: Peer,
    plan: Plan,
    job: _Load,
    limits: tuple[float, int],
    link: Link | None = None,
) -> float:
    """READ ``plan``'s runs within ``limits`` = (timeout, runs per posted READ), staged
    through ``stager`` where given and the cost model says so (with the pair's measured
    READ ``link``); READs still running when it fails are left in ``job.live`` (and the
    staging slot they may land in in ``job.slot``). Returns the seconds of a transfer that
    went all direct, from its first post to its landing (0: some of it staged)."""
    timeout_s, post_runs = limits
    deadline = time.monotonic() + timeout_s
    staged, slot = stager.choose(plan.runs, peer.regions, link=link) if stager else ({}, None)
    pulling = False

    def then() -> None:  # direct runs posted: pull the staged ones while they move
        nonlocal pulling
        job.lap("post")
        if stager is None or slot is None:
            return
        pulling = True  # the slot is stager.pull's from here
        staged_live: list[XferHandle] = []
        try:
            posted, moved = stager.pull(transport, peer.agents, staged, slot, deadline, staged_live)
        finally:
            if staged_live:
                job.live += staged_live
                job.slot = slot
        job.posted += posted
        job.staged_runs += moved

    direct = {src: r for src, r in plan.runs.items() if src not in staged}
    t0 = time.perf_counter()
    try:
        posted = read_runs(transport, peer.agents, direct, deadline, job.live, post_runs, then)
    finally:
        if stager is not None and slot is not None and not pulling:  # nothing staged posted
            stager.pool.give_back(slot, True)
    job.posted += posted  # after the call: ``then`` adds the staged spans meanwhile
    return 0.0 if staged else time.perf_counter() - t0
