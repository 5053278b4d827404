"""Move a request's KV from a P instance to a D instance in this process.

The kvbridge path end to end, with the loopback transport standing in for NIXL:

    P layouts + region addresses ─┐
                                  ├─► Geometry (per D rank) ─► plan(n, P tables, D tables,
    D layout + region addresses ──┘                                 cached) ─► read runs

Both instances must keep their caches in this process (TP 1, ``in_process``).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from kvbridge.api import Bound, Geometry, Region, Side, Transport, make_transport, read_runs
from refengine.errors import EngineError
from refengine.instance import Instance

TIMEOUT_S = 60.0
"""How long one D rank's READs may take (loopback copies inside the call)."""


@dataclass(frozen=True, slots=True)
class Moved:
    """What a transfer moved: bytes and descriptors (runs), summed over D ranks."""

    bytes: int
    descriptors: int


def move_kv(p: Instance, d: Instance, req_id: str) -> Moved:
    """Copy request ``req_id``'s KV (prefilled on ``p``, reserved on ``d``) into ``d``.

    Tokens ``d.computed(req_id)`` and on are moved, as the planner decides per layer kind.
    """
    if not (p.in_process and d.in_process):
        raise EngineError("move_kv needs both instances in this process (TP 1, in_process)")
    n, cached = p.computed(req_id), d.computed(req_id)
    if len(d.tokens(req_id)) != n or len(p.tokens(req_id)) != n + 1:
        raise EngineError(
            f"P has {n} prompt tokens computed (and must have sampled one), D reserved "
            f"{len(d.tokens(req_id))}: prefill on P, then reserve the same prompt on D"
        )
    agents: list[Transport] = []
    try:  # the agents go, whatever fails (the planner's and transport's errors, typed)
        return _move(p, d, req_id, n, cached, agents)
    finally:
        for a in agents:
            a.close()


def _move(
    p: Instance, d: Instance, req_id: str, n: int, cached: int, agents: list[Transport]
) -> Moved:
    tag = secrets.token_hex(4)
    p_meta = [_agent(agents, f"p{r}-{tag}", p.regions(r)) for r in range(p.tp)]
    p_side = Side(p.spec, p.parallel, [_bound(p, r) for r in range(p.tp)])
    total, runs_n = 0, 0
    for r in range(d.tp):
        _agent(agents, f"d{r}-{tag}", d.regions(r))
        agent = agents[-1]
        geom = Geometry(p_side, Side(d.spec, d.parallel, {r: _bound(d, r)}), r)
        plan = geom.plan(n, p.tables(req_id), d.tables(req_id), cached)
        peers = {src: agent.add_peer(p_meta[src]) for src in plan.runs}
        read_runs(agent, peers, plan.runs, time.monotonic() + TIMEOUT_S, [])
        total, runs_n = total + plan.nbytes, runs_n + plan.descriptors
    return Moved(total, runs_n)


def _agent(agents: list[Transport], name: str, regions: list[tuple[int, int]]) -> bytes:
    """A loopback agent over ``regions`` (appended to ``agents``); its metadata."""
    agents.append(make_transport("loopback", name))
    return agents[-1].register([Region(a, n) for a, n in regions])


def _bound(inst: Instance, rank: int) -> Bound:
    return Bound(inst.layout(rank), tuple(a for a, _ in inst.regions(rank)))
