"""The movers a D rank's load may take, by name in one registry (``docs/gpu.md``): D tries
them in ``order`` and the first that serves moves the load (``Outcome.mover``). Built in:
``kernel``, ``push`` and ``pull``. In :attr:`~kvbridge.connector.load.Mode.AUTO` push or
pull is chosen per request from what D measured once per P epoch
(:mod:`kvbridge.connector.movers.choice`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvbridge.connector.load import Mode, _Load
from kvbridge.connector.movers.choice import PROBE_RETRY_S, PairCosts, Probing, choose, measure
from kvbridge.connector.movers.pull import pull
from kvbridge.connector.movers.push import Pusher, choose_push, push_staged
from kvbridge.connector.movers.staging import Link
from kvbridge.connector.peers import Peer
from kvbridge.errors import KVBridgeError
from kvbridge.plan.geometry import Geometry
from kvbridge.plan.plan import Plan
from kvbridge.registry import Registry

if TYPE_CHECKING:
    from kvbridge.connector.lease_calls import LeaseCalls
    from kvbridge.connector.movers.kernel import KernelMover


class Rank(Probing, Protocol):
    """What the movers use of a D rank (a :class:`~kvbridge.connector.consumer.Consumer`
    is one; the movers never see the rest of it): what the probe uses, its kernel mover,
    how it moves, AUTO's measured ``pair_costs`` and their lock, its lease calls."""

    kernel: KernelMover | None
    movers: tuple[MoverKind, ...]
    mode: Mode
    staging: bool
    post_runs: int
    timeout_s: float
    pair_costs: dict[tuple[str, str], PairCosts]
    measuring: threading.Lock
    leases: LeaseCalls


@dataclass(frozen=True, slots=True)
class MoverKind:
    """A mover by name, tried in ``order``. ``serves(d, peer, plan, job)``: why it moves
    this load ("": it does not); ``run(...)``: moves it, returning once every byte
    landed (what may still land left in ``job.live`` / ``job.slot`` when it fails);
    ``plan_in(d, peer, job)``: the geometry the load must be planned in for this mover
    (None: the pair's, any mover); ``ready(d, peer)``: whether ``plan_in`` answers at once
    (a load starts on the engine's thread only then, :meth:`Consumer.load`; never where
    a mover has ``plan_in`` and no ``ready``);
    ``early(d)``: whether, planned in its own geometry, it may start before P answered
    ``begin`` (it reads P's memory without asking P, and calls ``job.answer`` once its
    copies are launched); ``launch(...)``: such a start on the engine's thread, without
    waiting (``run`` ends it, from a worker)."""

    name: str
    order: int
    serves: Callable[[Rank, Peer, Plan, _Load], str]
    run: Callable[[Rank, Peer, Plan, _Load], None]
    plan_in: Callable[[Rank, Peer, _Load], Geometry | None] | None = None
    early: Callable[[Rank], bool] | None = None
    ready: Callable[[Rank, Peer], bool] | None = None
    launch: Callable[[Rank, Peer, Plan, _Load], None] | None = None


_MOVERS: Registry[MoverKind] = Registry("mover")


def register_mover(kind: MoverKind) -> None:
    _MOVERS.register(kind.name, kind)


def mover_names() -> tuple[str, ...]:
    return _MOVERS.names()


def movers() -> tuple[MoverKind, ...]:
    """Every registered mover, in the order D tries them."""
    return tuple(sorted((_MOVERS.get(n) for n in _MOVERS.names()), key=lambda m: m.order))


def plan_geometry(d: Rank, peer: Peer, job: _Load) -> Geometry:
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


def plan_ready(d: Rank, peer: Peer) -> bool:
    """Whether :func:`plan_geometry` would answer at once for ``peer`` (no mapping or
    geometry to make first)."""
    return all(m.plan_in is None or (m.ready is not None and m.ready(d, peer)) for m in d.movers)


def launch_early(d: Rank, peer: Peer, plan: Plan, job: _Load) -> bool:
    """Where the mover ``job`` was planned for is early and serves it, start it now
    (:attr:`MoverKind.launch`): ``job.launched_by`` names it and why → whether it did."""
    m = next((m for m in d.movers if m.name == job.planned_in), None)
    if m is None or m.launch is None or m.early is None or not m.early(d):
        return False
    why = m.serves(d, peer, plan, job)
    if not why:
        return False
    m.launch(d, peer, plan, job)
    job.launched_by = (m.name, why)
    return True


def early(d: Rank, job: _Load) -> bool:
    """Whether the mover ``job`` was planned for takes P's ``begin`` answer itself, while
    it moves (:attr:`MoverKind.early`)."""
    m = next((m for m in d.movers if m.name == job.planned_in), None)
    return m is not None and m.early is not None and m.early(d)


def transfer(d: Rank, peer: Peer, plan: Plan, job: _Load) -> tuple[str, str]:
    """Move ``plan``'s runs with the first mover that serves this load: ``(mover, why)``."""
    if job.launched_by is not None:  # started on the engine's thread: its run ends it
        name, why = job.launched_by
        _MOVERS.get(name).run(d, peer, plan, job)
        return name, why
    for m in d.movers:
        if job.planned_in in ("", m.name):
            why = m.serves(d, peer, plan, job)
            if why:
                m.run(d, peer, plan, job)
                return m.name, why
    raise KVBridgeError(f"no mover serves the load of {job.handle.request_id!r}")


def _kernel_plan_in(d: Rank, peer: Peer, job: _Load) -> Geometry | None:
    over, job.no_kernel = d.kernel.geometry(peer) if d.kernel else (None, "D maps nothing")
    job.mapped = over
    return over.geometry if over else None


def _kernel_serves(d: Rank, peer: Peer, plan: Plan, job: _Load) -> str:
    return "P's memory is mapped here (same node)" if d.kernel and job.mapped else ""


def _kernel_run(d: Rank, peer: Peer, plan: Plan, job: _Load) -> None:
    assert d.kernel is not None and job.mapped is not None
    # launched on the engine's thread already (_kernel_launch), else now
    launched = job.launched or d.kernel.launch(peer, plan.runs, job.mapped)
    job.posted += launched.finish(job.answer)


def _kernel_launch(d: Rank, peer: Peer, plan: Plan, job: _Load) -> None:
    assert d.kernel is not None and job.mapped is not None
    job.launched = d.kernel.launch(peer, plan.runs, job.mapped)


def _kernel_early(d: Rank) -> bool:
    return d.kernel is not None and d.kernel.overlap


def _kernel_ready(d: Rank, peer: Peer) -> bool:
    return d.kernel is None or d.kernel.ready(peer)


MEASURING = "being measured"


def costs_of(d: Rank, peer: Peer, src: int) -> PairCosts:
    """What D measured with ``peer``'s epoch (:func:`.choice.measure` with P rank ``src``,
    once; a probe failed for a cause that passes again after ``PROBE_RETRY_S``).
    Measured outside ``d.measuring``: loads that meet the epoch meanwhile pull, saying
    so, instead of waiting for it."""
    key = (peer.engine_id, peer.epoch)
    with d.measuring:
        found = d.pair_costs.get(key)
        if found is None or _due(found):
            d.pair_costs[key] = PairCosts(note=MEASURING)
        else:
            return found
    got = PairCosts(note="probe failed", at=time.monotonic())
    try:
        got = measure(d, peer, src)
    finally:
        with d.measuring:
            if d.pair_costs.get(key, got).note in ("", MEASURING):  # none better meanwhile
                d.pair_costs[key] = got
    return got


def _due(found: PairCosts) -> bool:
    """Whether a pair's probe that failed for a passing cause is to be made again."""
    if found.note in ("", MEASURING) or found.at is None:
        return False
    return time.monotonic() - found.at > PROBE_RETRY_S


def direction(d: Rank, peer: Peer, plan: Plan, job: _Load) -> tuple[Mode, str]:
    """Pull or push for ``job``, and why: the configured mode, or (AUTO) the request
    priced both ways with the pair's measured costs (:func:`.choice.choose`); decided
    once per load (``job.direction``)."""
    if job.direction is None:
        if d.mode is not Mode.AUTO:
            job.direction = d.mode, f"{d.mode.value} mode"
        else:
            costs = costs_of(d, peer, min(plan.runs.keys(), default=0))
            staging = d.stager.priced if d.stager and d.staging else None
            job.direction = choose(costs, plan.runs, staging)
    return job.direction


def link(d: Rank, peer: Peer, push: bool) -> Link | None:
    """The pair's measured costs in that direction, where D measured them (AUTO)."""
    with d.measuring:
        costs = d.pair_costs.get((peer.engine_id, peer.epoch))
    if costs is None:
        return None
    return costs.write if push else costs.read


def learn(d: Rank, peer: Peer, push: bool, job: _Load, moved: tuple[int, float]) -> None:
    """A direct transfer of ``job`` timed (one round), ``moved`` = (bytes, seconds): the
    pair's measured costs learn from it (AUTO), else the stager's."""
    nbytes, seconds = moved
    with d.measuring:
        key = (peer.engine_id, peer.epoch)
        costs = d.pair_costs.get(key)
        if costs is not None and not costs.note:
            d.pair_costs[key] = costs.learned(push, job.posted, nbytes, seconds)
            return
    if d.stager is not None:
        d.stager.costs.learn(job.posted, nbytes, seconds)


def _serves_in(mode: Mode) -> Callable[[Rank, Peer, Plan, _Load], str]:
    def serves(d: Rank, peer: Peer, plan: Plan, job: _Load) -> str:
        chosen, how = direction(d, peer, plan, job)
        return f"{how}; no kernel mover: {job.no_kernel}" if chosen is mode else ""

    return serves


def _pull_run(d: Rank, peer: Peer, plan: Plan, job: _Load) -> None:
    stager = d.stager if d.staging else None
    limits = (d.timeout_s, d.post_runs)
    seconds = pull(d.transport, stager, peer, plan, job, limits, link(d, peer, False))
    if seconds:
        learn(d, peer, False, job, (plan.nbytes, seconds))


def _push_run(d: Rank, peer: Peer, plan: Plan, job: _Load) -> None:
    """Direct runs first, then the staged ones in rounds through a slot that, should
    the load fail, returns to the pool only after the fence (``job.slot``)."""
    deadline = time.monotonic() + d.timeout_s
    runs = plan.runs
    stager = d.stager if d.staging else None
    staged = choose_push(stager, runs, link(d, peer, True)) if stager is not None else None
    t0 = time.perf_counter()  # the transfer's, not the choice's
    if staged is not None:
        job.slot = staged.slot
        runs = {src: r for src, r in runs.items() if src not in staged.ranks}
    job.nonce = secrets.token_hex(16)  # retired at P with each rank's last message
    pusher = Pusher(peer, job, d.leases.who, d.metadata)
    want, job.posted = pusher.direct(runs)
    d.await_notifs(want, deadline)
    if stager is None or staged is None:  # one round: every P rank asked at once
        learn(d, peer, True, job, (sum(r.nbytes for r in runs.values()), time.perf_counter() - t0))
        return
    posted, job.staged_runs = push_staged(
        stager, pusher, staged, lambda w: d.await_notifs(w, deadline)
    )
    job.posted += posted
    stager.pool.give_back(staged.slot, True)
    job.slot = None


KERNEL = MoverKind(
    "kernel",
    0,
    _kernel_serves,
    _kernel_run,
    plan_in=_kernel_plan_in,
    early=_kernel_early,
    ready=_kernel_ready,
    launch=_kernel_launch,
)
register_mover(KERNEL)
register_mover(MoverKind("push", 10, _serves_in(Mode.PUSH), _push_run))
register_mover(MoverKind("pull", 20, _serves_in(Mode.PULL), _pull_run))
