"""The movers a D rank's load may take, by name in one registry (``docs/gpu.md``): D tries
them in ``order`` and the first that serves moves the load (``Outcome.mover``). Built in:
``kernel``, ``push`` and ``pull``. In :attr:`~kvbridge.connector.load.Mode.AUTO` push or
pull is measured once per P epoch: D READs up to PROBE_BYTES of a P rank's first region
into a staging slot, then asks that rank to WRITE the same bytes there, ``PROBE_ROUNDS``
times in turn, and keeps each direction's fastest; push wins when WRITE took less than
1/``MARGIN`` of READ's time, all within ``PROBE_TIMEOUT_S``. A probe still running at its deadline
keeps the slot out of the pool.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvbridge.connector.load import Mode, _Load
from kvbridge.connector.peers import Peer
from kvbridge.connector.pull import pull
from kvbridge.connector.push import Pusher, choose_push, push_staged, reply_runs
from kvbridge.control.messages import PushRuns
from kvbridge.errors import KVBridgeError
from kvbridge.plan.geometry import Geometry
from kvbridge.plan.plan import Plan
from kvbridge.registry import Registry

if TYPE_CHECKING:
    from kvbridge.connector.kernel_mover import KernelMover
    from kvbridge.connector.lease_calls import LeaseCalls
    from kvbridge.connector.staging import Stager
    from kvbridge.transport.base import Transport


class Rank(Protocol):
    """What the movers use of a D rank: its memory's movers (``kernel``, ``stager``,
    ``transport``), how it moves (``mode``, ``staging``, ``post_runs``, ``timeout_s``),
    AUTO's measured ``directions`` and their lock, its lease calls, its identity for P,
    and its notification wait. A :class:`~kvbridge.connector.consumer.Consumer` is one;
    the movers never see the rest of it."""

    @property
    def engine_id(self) -> str: ...

    @property
    def metadata(self) -> bytes: ...

    @property
    def kernel(self) -> KernelMover | None: ...

    @property
    def stager(self) -> Stager | None: ...

    @property
    def transport(self) -> Transport: ...

    @property
    def movers(self) -> tuple[MoverKind, ...]: ...

    @property
    def mode(self) -> Mode: ...

    @property
    def staging(self) -> bool: ...

    @property
    def post_runs(self) -> int: ...

    @property
    def timeout_s(self) -> float: ...

    @property
    def directions(self) -> dict[tuple[str, str], Directions]: ...

    @property
    def measuring(self) -> threading.Lock: ...

    @property
    def leases(self) -> LeaseCalls: ...

    def await_notifs(self, want: set[bytes], deadline: float) -> None: ...


@dataclass(frozen=True, slots=True)
class MoverKind:
    """A mover by name. ``serves(d, peer, plan, job)``: why it moves this load ("": it
    does not); ``run(d, peer, plan, job)``: moves it, returning only once every byte
    landed (and leaving what may still land in ``job.live`` / ``job.slot`` when it
    fails); ``plan_in(d, peer, job)``: the geometry the load must be planned in for this
    mover to move it (None: the pair's, and any mover); ``early(d)``: whether, for a
    load planned in its own geometry, it may start before P answered ``begin`` (it reads
    P's memory without asking P, and calls ``job.answer`` once its copies are launched,
    before waiting for them); ``ready(d, peer)``: whether ``plan_in`` would answer at
    once (needed for a load to start on the engine's thread, :meth:`Consumer.load`; a
    mover with ``plan_in`` and no ``ready`` never lets one); ``launch(d, peer, plan,
    job)``: an early mover's start on the engine's thread, without waiting (``run`` ends
    it, from a worker)."""

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
    if d.kernel is None or job.mapped is None:
        return ""
    return "P's memory is mapped here (same node)"


def _kernel_run(d: Rank, peer: Peer, plan: Plan, job: _Load) -> None:
    assert d.kernel is not None and job.mapped is not None
    if job.launched is not None:  # launched on the engine's thread (_kernel_launch)
        job.posted += job.launched.finish(job.answer)
    else:
        job.posted += d.kernel.move(peer, plan.runs, job.mapped, meanwhile=job.answer)


def _kernel_launch(d: Rank, peer: Peer, plan: Plan, job: _Load) -> None:
    assert d.kernel is not None and job.mapped is not None
    job.launched = d.kernel.launch(peer, plan.runs, job.mapped)


def _kernel_ready(d: Rank, peer: Peer) -> bool:
    return d.kernel is None or d.kernel.ready(peer)


PROBE_BYTES = 8 << 20
MARGIN = 1.5
PROBE_TIMEOUT_S = 5.0
PROBE_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class Directions:
    """What one measurement found: seconds for ``nbytes`` each way (inf: failed)."""

    nbytes: int
    read_s: float
    write_s: float
    note: str = ""

    def choice(self) -> tuple[Mode, str]:
        """``(pull or push, why)``."""
        if self.note:
            return Mode.PULL, f"auto: pull ({self.note})"
        speeds = f"READ {_rate(self.nbytes, self.read_s)}, WRITE {_rate(self.nbytes, self.write_s)}"
        if self.write_s * MARGIN < self.read_s:
            return Mode.PUSH, f"auto: push, measured {speeds}"
        return Mode.PULL, f"auto: pull, measured {speeds}"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if 0 < seconds < float("inf") else "failed"


def measure(d: Rank, peer: Peer, src: int) -> Directions:
    """Time a READ and a WRITE of the same bytes between P rank ``src`` and D's staging
    slot; both land in the slot, never in a KV block."""
    stager = d.stager
    if stager is None:
        return Directions(0, 0.0, 0.0, "no staging slot to probe into")
    info = peer.ranks.get(src)
    if info is None or not info.endpoint or not info.regions:
        return Directions(0, 0.0, 0.0, f"P rank {src} serves no push channel")
    size = min(PROBE_BYTES, stager.pool.slot_bytes, info.regions[0])
    slot = stager.pool.take(PROBE_TIMEOUT_S)
    if slot is None:
        return Directions(0, 0.0, 0.0, "no free staging slot")
    clean = False
    try:
        at = stager.pool.region.addr + slot * stager.pool.slot_bytes
        one = np.ones(1, np.uint64)
        local, remote, n = one * at, one * info.bases[0], one * size
        read_s = write_s = float("inf")
        end = time.monotonic() + PROBE_TIMEOUT_S  # the whole probe's, not each transfer's
        for i in range(PROBE_ROUNDS):  # interleaved; the first of each pays the pair's set-up
            if i and time.monotonic() > end:  # what was measured so far
                break
            t0 = time.perf_counter()
            handle = d.transport.read(peer.agents[src], local, remote, n)
            d.transport.wait(handle, max(end - time.monotonic(), 0.001))
            read_s = min(read_s, time.perf_counter() - t0)
            write_s = min(write_s, _write(d, peer, src, (local, remote, n), end))
        clean = True
    except KVBridgeError as exc:
        return Directions(size, float("inf"), float("inf"), f"probe failed: {exc}")
    finally:
        stager.pool.give_back(slot, clean)
    return Directions(size, read_s, write_s)


def _write(
    d: Rank,
    peer: Peer,
    src: int,
    runs: tuple[np.ndarray, np.ndarray, np.ndarray],
    end: float,
) -> float:
    """Seconds from asking P rank ``src`` to write ``runs`` (local = D) to their landing,
    which must come before ``end`` (``time.monotonic()``)."""
    local, remote, n = (a.astype("<u8").tobytes() for a in runs)
    notif = f"kvb-probe:{secrets.token_hex(8)}".encode()
    probe = PushRuns(
        "probe:" + notif.decode(), d.metadata, src=remote, dst=local, nbytes=n, notif=notif,
        nonce=notif.decode(), d_engine=d.engine_id,
    )  # fmt: skip
    t0 = time.perf_counter()
    reply_runs(peer.rank_client(src).call(probe), "probe")
    d.await_notifs({notif}, end)
    return time.perf_counter() - t0


def direction(d: Rank, peer: Peer, src: int) -> tuple[Mode, str]:
    """Pull or push, and why: the configured mode, or (AUTO) what D measured with
    this P epoch (once, :func:`measure`)."""
    if d.mode is not Mode.AUTO:
        return d.mode, f"{d.mode.value} mode"
    with d.measuring:
        key = (peer.engine_id, peer.epoch)
        if key not in d.directions:
            d.directions[key] = measure(d, peer, src)
        return d.directions[key].choice()


def _serves_in(mode: Mode) -> Callable[[Rank, Peer, Plan, _Load], str]:
    def serves(d: Rank, peer: Peer, plan: Plan, job: _Load) -> str:
        chosen, how = direction(d, peer, min(plan.runs.keys(), default=0))
        return f"{how}; no kernel mover: {job.no_kernel}" if chosen is mode else ""

    return serves


def _pull_run(d: Rank, peer: Peer, plan: Plan, job: _Load) -> None:
    pull(d.transport, d.stager, d.staging, peer, plan, job, d.timeout_s, d.post_runs)


def _push_run(d: Rank, peer: Peer, plan: Plan, job: _Load) -> None:
    """Direct runs first, then the staged ones in rounds through a slot that, should
    the load fail, returns to the pool only after the fence (``job.slot``)."""
    deadline = time.monotonic() + d.timeout_s
    t0 = time.perf_counter()
    runs = plan.runs
    stager = d.stager if d.staging else None
    staged = choose_push(stager, runs) if stager is not None else None
    if staged is not None:
        job.slot = staged.slot
        runs = {src: r for src, r in runs.items() if src not in staged.ranks}
    job.nonce = secrets.token_hex(16)  # retired at P with each rank's last message
    pusher = Pusher(peer, job, d.leases.who, d.metadata)
    want, job.posted = pusher.direct(runs)
    d.await_notifs(want, deadline)
    if stager is None or staged is None:
        if stager is not None:
            nbytes = sum(r.nbytes for r in runs.values())
            stager.costs.learn(job.posted, nbytes, time.perf_counter() - t0)
        return
    posted, job.staged_runs = push_staged(
        stager, pusher, staged, lambda w: d.await_notifs(w, deadline)
    )
    job.posted += posted
    stager.pool.give_back(staged.slot, True)
    job.slot = None


def _kernel_early(d: Rank) -> bool:
    return d.kernel is not None and d.kernel.overlap


KERNEL = MoverKind(
    "kernel", 0, _kernel_serves, _kernel_run, plan_in=_kernel_plan_in,
    early=_kernel_early, ready=_kernel_ready, launch=_kernel_launch,
)  # fmt: skip
register_mover(KERNEL)
register_mover(MoverKind("push", 10, _serves_in(Mode.PUSH), _push_run))
register_mover(MoverKind("pull", 20, _serves_in(Mode.PULL), _pull_run))

__all__ = [
    "MoverKind",
    "direction",
    "early",
    "launch_early",
    "mover_names",
    "movers",
    "plan_geometry",
    "plan_ready",
    "register_mover",
]
