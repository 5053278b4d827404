"""D side of the connector: one :class:`Consumer` per D rank. ``load(handle, local block
tables, cached tokens)`` starts a request on the caller's thread where nothing there waits
(:mod:`kvbridge.connector.inline`) and queues it; a worker thread runs (the rest of) its
state machine and :meth:`Consumer.poll` returns finished and failed requests:

    QUEUED → HANDSHAKE → TRANSFER → VERIFY → DONE
       └──────────┴──────────┴─────────┴──► FAILED   (any error, deadline or lapsed lease)

Lease-time verification, renewals and the fence holding a failure: ``docs/faults.md``."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import numpy as np

from kvbridge.connector.fence import Check, Fence, Held, ProbeArea, push_fence_checks
from kvbridge.connector.handle import Tokens, TransferHandle
from kvbridge.connector.inline import abandon, start, taken_over
from kvbridge.connector.lease_calls import LeaseCalls
from kvbridge.connector.load import (
    NO_TABLES,
    Answer,
    LoadState,
    Mode,
    Outcome,
    Policy,
    Started,
    _Load,
    failed_blocks,
)
from kvbridge.connector.movers.choice import PairCosts
from kvbridge.connector.movers.kernel import kernel_mover
from kvbridge.connector.movers.pull import POST_RUNS
from kvbridge.connector.movers.registry import early, movers, plan_geometry, transfer
from kvbridge.connector.movers.staging import Stager
from kvbridge.connector.peers import Peer, PeerCache, Target
from kvbridge.connector.prepare import prepare
from kvbridge.control.security import Keys
from kvbridge.errors import KVBridgeError, PlanError, TransferFailed, TransferTimeout
from kvbridge.fdtable import reserve_fds
from kvbridge.layout.tensor import MemKind, Region, regions_at
from kvbridge.layout.view import RankLayout
from kvbridge.plan.pattern import Bound
from kvbridge.plan.plan import Plan
from kvbridge.plan.tables import Tables, checked_tables
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel
from kvbridge.transport.base import Transport

log = logging.getLogger(__name__)
_WAITING = (LoadState.QUEUED, LoadState.HANDSHAKE)


class Consumer:
    post_runs = POST_RUNS
    """Runs per posted READ request (the deadline is checked between requests)."""
    trust_lease = 0.5
    """A load whose last byte landed within this fraction of the lease time P granted at
    ``begin`` is done without asking P again (:mod:`kvbridge.control.lease`)."""
    require_prompt = False
    """Refuse a load without ``prompt``, or of a handle whose P named no prompt."""
    inline = True
    """Start a load on the caller's thread where nothing there waits, a worker ending it
    (:mod:`kvbridge.connector.inline`): no queue hand-off before the first byte moves.
    False: a worker does it all."""

    def __init__(
        self,
        engine_id: str,
        spec: ModelSpec,
        par: Parallel,
        rank: int,
        layout: RankLayout,
        bases: list[int],
        transport: Transport,
        secret: bytes,
        policy: Policy = Policy.RECOMPUTE,
        transfer_timeout_s: float = 10.0,
        workers: int = 2,
        mode: Mode = Mode.PULL,
        model_id: str = "",
        pad_blocks: bool = False,
        staging_bytes: int = 32 << 20,
        keys: Keys | None = None,
        staging: bool = True,
        memory: MemKind = MemKind.HOST,
        device: int = 0,
        kernel: bool = True,
    ):
        """``model_id``: what this D serves; a P serving another id is refused.
        ``pad_blocks``: the engine tolerates writes to the slots of a request's partial
        first and last blocks that lie outside the tokens D needs (see
        :class:`~kvbridge.plan.geometry.Geometry`): fewer, larger runs.
        ``staging_bytes``: registered staging area for pulls and pushes of many small
        runs, one slot per worker (0: none; :mod:`kvbridge.connector.movers.staging`).
        ``staging``: let the cost model stage a request (False: always direct; may be
        changed between requests).
        ``keys``: CURVE keys of the side channel (default: derived from ``secret``).
        ``memory``, ``device``: where ``bases`` point (host memory, or GPU ``device``).
        ``kernel``: copy with one kernel from P ranks of this node that share their memory
        (:mod:`kvbridge.connector.movers.kernel`), whatever ``mode`` says."""
        self.engine_id, self.spec, self.par, self.rank = engine_id, spec, par, rank
        self.transport, self.secret, self.policy = transport, secret, policy
        self.timeout_s, self.mode, self.staging = transfer_timeout_s, mode, staging
        regions = regions_at(bases, layout.regions, memory, device)
        self.kernel, self.movers = kernel_mover(regions) if kernel else None, movers()
        self.metadata = self._register(regions, staging_bytes, workers)
        self._notifs: set[bytes] = set()
        self.pair_costs: dict[tuple[str, str], PairCosts] = {}
        """READ and WRITE as measured per P (engine id, epoch), in AUTO mode."""
        self.measuring = threading.Lock()
        self.peers = PeerCache(
            engine_id, spec, par, rank, Bound(layout, tuple(bases)), transport, secret,
            timeout_s=transfer_timeout_s, model_id=model_id, pad_blocks=pad_blocks, keys=keys,
        )  # fmt: skip
        self.leases = LeaseCalls(engine_id, rank, par.world, self.peers)
        self._lock = threading.Lock()
        self._loads: dict[str, _Load] = {}
        self._done: list[Outcome] = []
        self.fence = Fence(transport, self._deliver)
        self._threads(rank, workers)

    def _threads(self, rank: int, workers: int) -> None:
        """The load workers, the thread telling P of failures, the lease renewer."""
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"kvbridge-d{rank}")
        self._free = workers  # minus loads queued or running: inline only if one is idle
        self._tell_p = ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-d{rank}-fail")
        self._prep = ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-d{rank}-prep")
        self._stop = threading.Event()
        renew = (self._stop, self._waiting)
        self._renewer = threading.Thread(target=self.leases.renew_loop, args=renew, daemon=True)
        self._renewer.start()

    def _register(self, regions: list[Region], staging_bytes: int, workers: int) -> bytes:
        """Register the KV ``regions``, the staging area (in the same memory) and the
        push fence's probe area with the transport; this rank's metadata."""
        self.stager: Stager | None = None
        if staging_bytes >= workers * 4096 and regions:
            self.stager = Stager(regions, workers, staging_bytes // workers)
        self._probe = ProbeArea()
        extra = [self.stager.pool.region] if self.stager else []
        extra.append(self._probe.region)  # the push fence's probes (any mode: it may change)
        meta = self.transport.register(regions + extra)
        reserve_fds()  # a first handshake must not wait for the table to grow
        return meta

    def load(
        self,
        handle: TransferHandle,
        tables: Sequence[Sequence[int] | np.ndarray] | Tables,
        cached: int = 0,
        prompt: Tokens | None = None,
    ) -> None:
        """Queue the transfer of ``handle``'s request into local ``tables`` (per group, a
        list of ints or a 1-D integer array; checked here once, into :class:`Tables`);
        ``prompt``: the token ids D decodes from, checked first
        (:meth:`TransferHandle.check_prompt`)."""
        handle.check_prompt(prompt, self.require_prompt)
        try:
            tabs = checked_tables(tables, self.peers.bound.layout.num_blocks, "D's block tables")
            if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
                raise PlanError(f"cached tokens must be an int >= 0, got {cached!r}")
        except PlanError:  # refused before it began: P may free the blocks now
            self._pool.submit(self.leases.release, _Load(handle, NO_TABLES, 0), "fail")
            raise
        job = _Load(handle, tabs, cached)
        with self._lock:
            if handle.request_id in self._loads:
                raise KVBridgeError(f"request {handle.request_id!r} is already loading")
            self._loads[handle.request_id] = job
            self._free -= 1
            inline = self.inline and self._free >= 0  # a worker idle for it: no wait
        try:
            job.started = start(self, job) if inline else None
            self._pool.submit(self._run, job, job.started)
        except BaseException:  # nothing of it may stay: not registered, nothing held
            with self._lock:
                self._loads.pop(handle.request_id, None)
                self._free += 1
            abandon(self, job, self._tell_p.submit)
            raise

    def release_peer(self, peer: Peer) -> None:
        """:meth:`PeerCache.done` off the caller's thread (it may close channels)."""
        self._tell_p.submit(self.peers.done, peer)

    def prepare(self, endpoint: str, engine_id: str) -> Future[str]:
        """Connect to the P instance ``engine_id`` at ``endpoint`` before its first
        request, on a thread of its own (:mod:`kvbridge.connector.prepare`): its first
        load then costs what a warm one does. The future's result: the P epoch."""
        return self._prep.submit(prepare, self, Target(engine_id, endpoint))

    def release(self, handle: TransferHandle) -> None:
        """Tell P this rank needs none of ``handle``'s blocks (D computed or cached them
        itself), so P frees them once every D rank has said so, not at lease expiry."""
        self._pool.submit(self.leases.release, _Load(handle, NO_TABLES, 0))

    def poll(self) -> list[Outcome]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def pending(self) -> int:
        with self._lock:
            return len(self._loads)

    def _run(self, job: _Load, started: Started | None = None) -> None:
        job.started = None  # a worker runs it: close() need not end it
        try:
            self._run_load(job, started)
        finally:
            with self._lock:
                self._free += 1

    def _run_load(self, job: _Load, started: Started | None) -> None:
        t0 = time.perf_counter() if started is None else started.t0
        answer = None if started is None else started.answer
        try:
            if started is None:
                job.lap("queue")
                job.move(LoadState.HANDSHAKE)
                job.peer = self.peers.get(job.handle, since=job.queued)
                job.lap("handshake")
                answer = self.leases.begin(job.peer, job)
                plan = self.plan(job.peer, job)  # made while P answers
            else:
                plan = taken_over(job, started)
            assert answer is not None and job.peer is not None
            mover, why, left = self._move(job.peer, plan, job, answer)
            job.move(LoadState.VERIFY)
            late = time.monotonic() - answer.sent > left * self.trust_lease
            if late:  # ask P whether the lease held after the last byte landed
                self.leases.call(job.peer, job, "confirm")
            job.lap("verify")
            job.move(LoadState.DONE)
        except Exception as e:  # every failure ends the request, typed in `error`
            self._failed(job, e, t0, answer)
            return
        except BaseException as e:  # an interrupt: the load fails as on an error, then it goes on
            log.warning("load of %s interrupted", job.handle.request_id, exc_info=e)
            cause = TransferFailed(f"load interrupted by {type(e).__name__}")
            self._failed(job, cause, t0, answer)
            raise
        self._deliver(
            Outcome(
                job.handle.request_id,
                True,
                plan.nbytes,
                job.posted,
                time.perf_counter() - t0,
                stages=job.stages,
                staged_runs=job.staged_runs,
                verified="at P" if late else "lease time",
                mover=mover,
                reason=why,
            )
        )
        if late:
            self.peers.done(job.peer)
        else:  # P frees the blocks when every D rank has confirmed: tell it, off the path
            self._tell_p.submit(self.leases.tell, job.peer, job, "confirm", time.monotonic())

    def _failed(self, job: _Load, e: Exception, t0: float, answer: Answer | None) -> None:
        """``job`` failed with ``e``: P's answer taken (its token goes with ``fail``), the
        copies started ended, P told, the outcome fenced until nothing can land."""
        if not isinstance(e, KVBridgeError):
            log.exception("load of %s failed", job.handle.request_id)
        job.state = LoadState.FAILED
        if answer is not None:
            answer.take(quiet=True)
        if job.launched is not None:  # copies started on the engine's thread
            try:
                job.launched.finish()
            except Exception:
                log.exception("ending the copies of %s failed", job.handle.request_id)
        self._tell_p.submit(self.leases.report_failure, job)
        out = Outcome(
            job.handle.request_id,
            False,
            seconds=time.perf_counter() - t0,
            failed_blocks=failed_blocks(self.spec, job),
            action=self.policy,
            error=f"{type(e).__name__}: {e}",
            stages=job.stages,
        )
        try:
            self.fence.hold(self._held(job, out))
        except Exception:  # never lose the outcome: hold on the transfers alone
            log.exception("fencing %s failed", job.handle.request_id)
            self.fence.hold(Held(out, job.live))

    def plan(self, peer: Peer, job: _Load) -> Plan:
        """``job`` planned (in a mover's own geometry where one asks for it,
        :func:`plan_geometry`)."""
        try:
            h = job.handle
            geometry = plan_geometry(self, peer, job)
            return geometry.plan(h.n_tokens, h.block_tables, job.tables, job.cached)
        finally:
            job.lap("plan")

    def _move(self, peer: Peer, plan: Plan, job: _Load, answer: Answer) -> tuple[str, str, float]:
        """Move ``plan`` once P's ``begin`` answer says the lease is held, or, where its
        mover runs early (:func:`~kvbridge.connector.movers.registry.early`: the kernel
        mover on a GPU), while P answers, the mover taking the answer (``job.answer``)
        once its copies are launched. Either way the load counts only if P answered
        "held" (``docs/faults.md``) → (mover, why, lease seconds left at ``begin``)."""
        overlap = early(self, job)
        job.move(LoadState.TRANSFER)
        if overlap:
            job.answer = answer.take
        else:
            answer.take()
            job.lap("lease")
        mover, why = transfer(self, peer, plan, job)
        left = answer.take()  # "held", or the load fails here
        job.lap("transfer")
        if overlap:
            job.stages["lease"] = answer.waited  # inside "transfer", while the copies ran
        return mover, why, left

    def _deliver(self, out: Outcome) -> None:
        with self._lock:
            self._loads.pop(out.request_id, None)
            self._done.append(out)

    def _held(self, job: _Load, out: Outcome) -> Held:
        """What must end before ``out`` (a failure) may reach the engine."""
        on_end: list[Callable[[], None]] = []
        if job.slot is not None and self.stager is not None:
            on_end.append(partial(self.stager.pool.give_back, job.slot, True))
        if job.peer is not None:
            on_end.append(partial(self.peers.done, job.peer))
        checks: list[Check] = []
        if job.pushed and job.peer is not None:
            fences = push_fence_checks(
                job.peer,
                job.handle.request_id,
                job.pushed,
                d=self.transport,
                probe=self._probe.region.addr,
                d_engine=self.engine_id,
            )
            checks.extend(fences)
            on_end.extend(fence.close for fence in fences)
        return Held(out, job.live, checks, on_end)

    def await_notifs(self, want: set[bytes], deadline: float) -> None:
        """Until every notification in ``want`` arrived; TransferTimeout at ``deadline``."""
        while True:
            with self._lock:
                self._notifs.update(m for _, m in self.transport.notifications())
                if want <= self._notifs:
                    self._notifs -= want
                    return
                if len(self._notifs) > 65536:  # late ones of failed requests: forget
                    self._notifs = set(want & self._notifs)
            if time.monotonic() > deadline:
                raise TransferTimeout(f"push notifications missing after {self.timeout_s} s")
            time.sleep(0.0005)

    def _waiting(self) -> list[_Load]:
        """Loads whose lease the renewer keeps: in the queue or in a handshake, before
        their ``begin`` may be out (a token-less renew of a rank that began is refused)."""
        with self._lock:
            return [j for j in self._loads.values() if j.state in _WAITING and j.peer is None]

    def closing(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        self._prep.shutdown(wait=False, cancel_futures=True)  # a running one sees closing()
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # started on the caller's thread, then cancelled in the queue
            stranded = [j for j in self._loads.values() if j.started is not None]
        for job in stranded:
            abandon(self, job, lambda fn, *a: fn(*a))
        self._renewer.join(timeout=2)
        for item in self.fence.close():
            log.warning("closing with %s still fenced", item.outcome.request_id)
            for fn in item.on_end:
                with contextlib.suppress(Exception):
                    fn()
        self._tell_p.shutdown(wait=False, cancel_futures=True)
        self._prep.shutdown(wait=True)
        self.peers.close()
        if self.kernel is not None:
            self.kernel.close()
