"""The movers a D rank's load may take (``docs/gpu.md``), by name in one registry.

A :class:`MoverKind` says when it serves a load and how it moves it; D tries them in
``order`` (lowest first, fixed when the :class:`~kvbridge.connector.consumer.Consumer` is
made) and the first that serves runs; its name is ``Outcome.mover``. A mover may plan the
load in a geometry of its own (``plan_in``, asked before the load is planned): such a
plan is then moved by that mover only. Built in: ``kernel`` (P's memory mapped within a
node), ``push`` and ``pull`` (over the transport, as the configured or measured direction
says).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.connector.directions import measure
from kvbridge.connector.load import Mode, _Load
from kvbridge.connector.peers import Peer
from kvbridge.connector.pull import pull
from kvbridge.connector.push import PushBind, push_runs
from kvbridge.connector.push_staging import StagedPusher, choose_push
from kvbridge.errors import KVBridgeError
from kvbridge.plan.geometry import Geometry
from kvbridge.plan.plan import Plan
from kvbridge.registry import Registry

if TYPE_CHECKING:
    from kvbridge.connector.consumer import Consumer


@dataclass(frozen=True, slots=True)
class MoverKind:
    """A mover by name. ``serves(d, peer, plan, job)``: why it moves this load ("": it
    does not); ``run(d, peer, plan, job)``: moves it, returning only once every byte
    landed (and leaving what may still land in ``job.live`` / ``job.slot`` when it
    fails); ``plan_in(d, peer, job)``: the geometry the load must be planned in for this
    mover to move it (None: the pair's, and any mover)."""

    name: str
    order: int
    serves: Callable[[Consumer, Peer, Plan, _Load], str]
    run: Callable[[Consumer, Peer, Plan, _Load], None]
    plan_in: Callable[[Consumer, Peer, _Load], Geometry | None] | None = None


_MOVERS: Registry[MoverKind] = Registry("mover")


def register_mover(kind: MoverKind) -> None:
    _MOVERS.register(kind.name, kind)


def mover_names() -> tuple[str, ...]:
    return _MOVERS.names()


def movers() -> tuple[MoverKind, ...]:
    """Every registered mover, in the order D tries them."""
    return tuple(sorted((_MOVERS.get(n) for n in _MOVERS.names()), key=lambda m: m.order))


def plan_geometry(d: Consumer, peer: Peer, job: _Load) -> Geometry:
    """The geometry ``job`` is planned in: the first mover's own (``job.planned_in``
    names it), else the pair's."""
    job.planned_in = ""
    for m in d.movers:
        if m.plan_in is not None:
            geometry = m.plan_in(d, peer, job)
            if geometry is not None:
                job.planned_in = m.name
                return geometry
    return peer.geometry


def transfer(d: Consumer, peer: Peer, plan: Plan, job: _Load) -> tuple[str, str]:
    """Move ``plan``'s runs with the first mover that serves this load: ``(mover, why)``."""
    for m in d.movers:
        if job.planned_in in ("", m.name):
            why = m.serves(d, peer, plan, job)
            if why:
                m.run(d, peer, plan, job)
                return m.name, why
    raise KVBridgeError(f"no mover serves the load of {job.handle.request_id!r}")


def _kernel_plan_in(d: Consumer, peer: Peer, job: _Load) -> Geometry | None:
    over, job.no_kernel = d.kernel.geometry(peer) if d.kernel else (None, "D maps nothing")
    job.mapped = over.bases if over else None
    return over.geometry if over else None


def _kernel_serves(d: Consumer, peer: Peer, plan: Plan, job: _Load) -> str:
    if d.kernel is None or job.mapped is None:
        return ""
    return "P's memory is mapped here (same node)"


def _kernel_run(d: Consumer, peer: Peer, plan: Plan, job: _Load) -> None:
    assert d.kernel is not None and job.mapped is not None
    job.posted += d.kernel.move(peer, plan.runs, job.mapped)


def direction(d: Consumer, peer: Peer, src: int) -> tuple[Mode, str]:
    """Pull or push, and why: the configured mode, or (AUTO) what D measured with
    this P epoch (once; :mod:`kvbridge.connector.directions`)."""
    if d.mode is not Mode.AUTO:
        return d.mode, f"{d.mode.value} mode"
    with d.measuring:
        key = (peer.engine_id, peer.epoch)
        if key not in d.directions:
            args = (d.stager, peer, src, d.metadata, d.await_notifs, d.engine_id)
            d.directions[key] = measure(d.transport, *args)
        return d.directions[key].choice()


def _serves_in(mode: Mode) -> Callable[[Consumer, Peer, Plan, _Load], str]:
    def serves(d: Consumer, peer: Peer, plan: Plan, job: _Load) -> str:
        chosen, how = direction(d, peer, min(plan.runs.keys(), default=0))
        return f"{how}; no kernel mover: {job.no_kernel}" if chosen is mode else ""

    return serves


def _pull_run(d: Consumer, peer: Peer, plan: Plan, job: _Load) -> None:
    pull(d.transport, d.stager, d.staging, peer, plan, job, d.timeout_s, d.post_runs)


def _push_run(d: Consumer, peer: Peer, plan: Plan, job: _Load) -> None:
    """Direct runs first, then the staged ones in rounds through a slot that, should
    the load fail, returns to the pool only after the fence (``job.slot``)."""
    deadline = time.monotonic() + d.timeout_s
    t0 = time.perf_counter()
    rid, runs = job.handle.request_id, plan.runs
    stager = d.stager if d.staging else None
    staged = choose_push(stager, runs) if stager is not None else None
    if staged is not None:
        job.slot = staged.slot
        runs = {src: r for src, r in runs.items() if src not in staged.ranks}
    job.nonce = secrets.token_hex(16)  # retired at P with each rank's last message
    bind = PushBind(job.token, d.leases.epoch, job.nonce, d.engine_id)
    want, job.posted = push_runs(peer, rid, runs, d.rank, d.metadata, job.pushed, bind)
    d.await_notifs(want, deadline)
    if stager is None or staged is None:
        if stager is not None:
            nbytes = sum(r.nbytes for r in runs.values())
            stager.costs.learn(job.posted, nbytes, time.perf_counter() - t0)
        return
    pusher = StagedPusher(
        stager, peer, rid, d.rank, d.metadata, lambda w: d.await_notifs(w, deadline), bind
    )
    posted, job.staged_runs = pusher.run(staged, job.pushed)
    job.posted += posted
    stager.pool.give_back(staged.slot, True)
    job.slot = None


register_mover(MoverKind("kernel", 0, _kernel_serves, _kernel_run, plan_in=_kernel_plan_in))
register_mover(MoverKind("push", 10, _serves_in(Mode.PUSH), _push_run))
register_mover(MoverKind("pull", 20, _serves_in(Mode.PULL), _pull_run))

__all__ = ["MoverKind", "direction", "mover_names", "movers", "plan_geometry", "register_mover"]
