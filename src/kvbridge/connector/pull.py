"""The pull mover over a transport: D READs a request's runs from P, each source rank's
runs posted as they are (direct) or, where the cost model says so, through D's staging
area (:mod:`kvbridge.connector.staging`)."""

from __future__ import annotations

import time

from kvbridge.connector.load import _Load
from kvbridge.connector.peers import Peer
from kvbridge.connector.staging import Stager
from kvbridge.errors import TransferTimeout
from kvbridge.plan.plan import Plan
from kvbridge.plan.runs import Runs
from kvbridge.transport.base import Transport, XferHandle


def pull(
    transport: Transport,
    stager: Stager | None,
    staging: bool,
    peer: Peer,
    plan: Plan,
    job: _Load,
    timeout_s: float,
    post_runs: int,
) -> None:
    """READ ``plan``'s runs within ``timeout_s``, staged where ``staging`` allows and the
    cost model says so; READs still running when it fails are left in ``job.live`` (and
    the staging slot they may land in in ``job.slot``)."""
    deadline = time.monotonic() + timeout_s
    t0 = time.perf_counter()
    staged, slot = stager.choose(plan.runs, peer.regions) if stager and staging else ({}, None)
    handles: list[XferHandle] = []
    try:
        for src, r in plan.runs.items():
            if src not in staged:
                _post(transport, peer.agents[src], r, deadline, handles, job, post_runs)
        job.lap("post")
        if stager is not None and slot is not None:
            staged_live: list[XferHandle] = []
            try:
                posted, moved = stager.pull(
                    transport, peer.agents, staged, slot, deadline, staged_live
                )
            finally:
                if staged_live:
                    job.live += staged_live
                    job.slot = slot
            job.posted += posted
            job.staged_runs += moved
        for h in handles:
            transport.wait_or_keep(h, max(deadline - time.monotonic(), 0.0))
    except BaseException:
        job.live += [h for h in handles if not transport.ended(h)]
        raise
    if stager is not None and not staged:
        stager.costs.learn(job.posted, plan.nbytes, time.perf_counter() - t0)


def _post(
    transport: Transport,
    agent: str,
    r: Runs,
    deadline: float,
    handles: list[XferHandle],
    job: _Load,
    post_runs: int,
) -> None:
    """READ ``r`` in requests of at most ``post_runs`` runs, the deadline checked before
    each (posting may copy inside the call: 512,000 small runs once took the whole
    deadline and more)."""
    s, d, n = r.as_uint64()
    for lo in range(0, len(r), post_runs):
        if time.monotonic() > deadline:
            raise TransferTimeout(f"deadline passed while posting: {lo} of {len(r)} runs posted")
        hi = lo + post_runs
        handles.append(transport.read(agent, d[lo:hi], s[lo:hi], n[lo:hi]))
        job.posted += len(n[lo:hi])
