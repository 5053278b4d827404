"""One case, driven from the parent process, phase by phase:

    set-up     every rank builds its memory, agent and connector end; the driver holds the
               P instance's :class:`~kvbridge.api.Producer` (side channel, leases)
    connector  kvbridge's choice: the consumer loads each request (handshake, lease, plan,
               mover; on the GPU it must be the kernel mover where P shares its memory);
               once per run the ordering case (:mod:`.ordering`); then the connector ends
               close (the consumer unmaps P's memory)
    kernel     D maps P's memory itself: the kernel mover's steps, and a contiguous copy
    triton     each D rank: did the fused Triton kernel run (:mod:`.facts`)
    nixl       direct, staged and one contiguous WRITE over kvbridge's NIXL agents
    vllm       per UCX thread count, fresh raw agents: READ by D, WRITE by P

A phase maps P's memory only after the one before unmapped it: a process may open a CUDA
IPC handle once. Every transfer: P writes a fresh pattern (untimed), the method runs, each
D rank compares every byte it received with the pattern (:mod:`.pattern`). Per request a
method runs once cold, then up to ``reps`` times, fewer once ``rep_budget_s`` is spent.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from benchmarks.gpu_check import facts, ordering
from benchmarks.gpu_check import messages as m
from benchmarks.gpu_check.cases import Case, Request, requests
from benchmarks.gpu_check.plans import rank_bytes, vllm_refusal
from benchmarks.gpu_check.procs import Ranks, Target, fatal
from kvbridge.connector import Producer
from refengine.processes import RankError


@dataclass(frozen=True, slots=True)
class Options:
    gpu: bool
    threads: tuple[int, ...] = (0, 4, 8)
    rep_budget_s: float = 1.0
    method_budget_s: float = 5.0
    call_timeout_s: float = 90.0
    setup_timeout_s: float = 180.0
    shm_prefix: str = ""
    secret: bytes = b"gpu-check"
    prepare: bool = True
    """D prepares the pair before kvbridge's first load (``Consumer.prepare``)."""


@dataclass(slots=True)
class Sample:
    method: str
    variant: str
    request: int
    rep: int
    """0: the cold transfer (not in the medians)."""
    seconds: float
    nbytes: int
    descriptors: int
    plan_s: float
    host_s: float
    bad: int
    checked: int
    detail: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class CaseResult:
    case: Case
    samples: list[Sample] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    """Per method that could not run here: why."""
    errors: dict[str, str] = field(default_factory=dict)
    error: str = ""
    """What stopped the case (a rank died or hung), if anything."""
    skipped: str = ""
    seconds: float = 0.0
    setup_s: float = 0.0
    bytes: list[tuple[int, ...]] = field(default_factory=list)
    facts: list[dict[str, object]] = field(default_factory=list)
    """What each rank process runs on (torch, CUDA, NIXL build, Triton)."""
    triton: list[dict[str, object]] = field(default_factory=list)
    """Per D rank after the kernel phase: did the fused Triton kernel run (:mod:`.facts`)."""
    ordering: dict[str, object] = field(default_factory=dict)
    """The ordering case, where it ran (:mod:`.ordering`)."""
    remarks: list[str] = field(default_factory=list)
    """What the table notes under the case without failing it."""
    prepare_s: float | None = None
    """D ranks' :meth:`Consumer.prepare` of the pair before its first load (the slowest;
    None: not prepared, ``--no-prepare``)."""


class OutOfBudget(Exception):
    pass


Go = Callable[[Request, int], tuple[float, list[m.Timing]]]


class CaseRun:
    def __init__(
        self,
        ranks: Ranks,
        case: Case,
        opts: Options,
        deadline: float,
        tag: str,
        ordering: bool = False,
    ):
        self.ranks, self.case, self.opts, self.deadline, self.tag = ranks, case, opts, deadline, tag
        self.want_ordering = ordering
        """Run the ordering case (:mod:`.ordering`) in the connector phase."""
        self.reqs = requests(case)
        self.res = CaseResult(case, bytes=rank_bytes(case, self.reqs), facts=ranks.facts)
        self.seed = 0
        self.producer: Producer | None = None
        self.ready: tuple[list[m.Ready], list[m.Ready]] = ([], [])

    # --- plumbing ---------------------------------------------------------------------

    def ranks_of(self, role: str) -> list[tuple[str, int]]:
        return [(role, r) for r in range(self.case.p_tp if role == "P" else self.case.d_tp)]

    def ask(self, targets: list[Target], timeout_s: float | None = None) -> list:
        left = self.deadline + 30.0 - time.monotonic()
        timeout = min(timeout_s or self.opts.call_timeout_s, max(left, 5.0))
        return self.ranks.ask(targets, timeout)

    def every(self, role: str, cmd: object) -> list:
        return self.ask([(ro, r, cmd) for ro, r in self.ranks_of(role)])

    def check_budget(self) -> None:
        if time.monotonic() > self.deadline:
            raise OutOfBudget

    # --- the case ---------------------------------------------------------------------

    def run(self) -> CaseResult:
        t0 = time.monotonic()
        try:
            self.setup()
            self.res.setup_s = time.monotonic() - t0
            for phase in (self.connector, self.kernel, self.triton, self.nixl, self.vllm):
                phase()
        except OutOfBudget:
            self.res.skipped = "the time budget ran out during this case"
        except RankError as e:
            self.res.error = str(e)
        except Exception as e:  # the driver's own failure: reported with the case
            traceback.print_exc()
            self.res.error = f"driver: {type(e).__name__}: {e}"
        finally:
            self.teardown()
            self.res.seconds = time.monotonic() - t0
        return self.res

    def setup(self) -> None:
        c, o = self.case, self.opts
        seg = max(max(b) for b in self.res.bytes)
        shm = (lambda r: f"{o.shm_prefix}-{self.tag}-P{r}") if o.shm_prefix and not o.gpu else None
        targets: list[Target] = [
            ("P", r, m.Setup(c, "P", r, o.gpu, o.secret, shm(r) if shm else "", seg * c.d_tp))
            for r in range(c.p_tp)
        ]
        targets += [("D", d, m.Setup(c, "D", d, o.gpu, o.secret, "", seg)) for d in range(c.d_tp)]
        replies = self.ask(targets, o.setup_timeout_s)
        self.ready = (replies[: c.p_tp], replies[c.p_tp :])
        sp, pp = c.specs()[0], c.pars()[0]
        producer = Producer(f"P-check-{self.tag}", sp, pp, o.secret, lease_s=120.0)
        for ready in self.ready[0]:
            producer.add_rank(ready.info)
        self.producer = producer
        self.connect()

    def connect(self) -> None:
        cmd = m.Connect(tuple(self.ready[0]), tuple(self.ready[1]))
        self.ask([(ro, r, cmd) for ro, r in self.ranks_of("P") + self.ranks_of("D")])

    def teardown(self) -> None:
        if self.ranks.alive() and not self.res.error:
            try:  # D first: it unmaps P's memory before P frees it
                self.every("D", m.Teardown())
                self.every("P", m.Teardown())
            except RankError as e:
                self.res.error = self.res.error or f"teardown: {e}"
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    # --- one transfer, one method -------------------------------------------------------

    def fill_blocks(self, req: Request, seed: int) -> None:
        self.every("P", m.Fill(req, seed))

    def fill_staging(self, req: Request, seed: int) -> None:
        self.ask([("P", 0, m.FillStaging(max(self.res.bytes[req.index]), seed))])

    def verify(self, req: Request, seed: int, staging: bool) -> tuple[int, int]:
        nb = self.res.bytes[req.index]
        targets: list[Target] = [
            ("D", d, m.Verify(req, seed, staging, nb[d])) for d in range(self.case.d_tp)
        ]
        checked = self.ask(targets)
        return sum(c.bad for c in checked), sum(c.nbytes for c in checked)

    def transfer(
        self, method: str, variant: str, req: Request, rep: int, go: Go, staging: bool
    ) -> Sample:
        self.seed += 1
        seed = self.seed
        (self.fill_staging if staging else self.fill_blocks)(req, seed)
        seconds, ts = go(req, seed)
        bad, checked = self.verify(req, seed, staging)
        nbytes = sum(t.nbytes for t in ts)
        detail = dict(ts[0].detail) if ts else {}
        per_desc = [(t.end - t.start) * 1e6 / t.descriptors for t in ts if t.descriptors]
        if per_desc:  # each rank's own time per descriptor it posted, the slowest rank's
            detail["us_per_desc"] = max(per_desc)
        for key in ("gpu_ms", "back_to_back_ms"):  # the slowest D rank's, as the wall time
            got = [v for t in ts if isinstance(v := t.detail.get(key), float)]
            if got:
                detail[key] = max(got)
        return Sample(
            method,
            variant,
            req.index,
            rep,
            seconds,
            nbytes,
            sum(t.descriptors for t in ts),
            max(t.plan_s for t in ts),
            max(t.host_s for t in ts),
            bad,
            checked,
            detail,
        )

    def measure(
        self,
        method: str,
        variant: str,
        go: Go,
        staging: bool = False,
        also: Sequence[tuple[str, Go]] = (),
    ) -> None:
        """Every request: a cold transfer, then up to ``reps`` timed ones (fewer once they
        took ``rep_budget_s``); no more requests once the method took ``method_budget_s``
        with one timed transfer at least (a READ of GPU memory crawls over TCP). ``also``:
        other methods (name, go) measured with this one, transfer by transfer, the order
        turning at each transfer so that none always comes later (pages mapped, caches
        warm); the budgets are per method (the slowest decides)."""
        goes = [(method, go), *also]
        n = len(goes)
        total, timed, name = 0.0, 0, method
        try:
            for req in self.reqs:
                spent = 0.0
                for rep in range(1 + self.case.reps):
                    if timed and total > self.opts.method_budget_s * n:
                        return
                    bad = False
                    for name, each in goes[rep % n :] + goes[: rep % n]:
                        self.check_budget()
                        s = self.transfer(name, variant, req, rep, each, staging)
                        self.res.samples.append(s)
                        total, timed = total + s.seconds, timed + (rep > 0)
                        spent += s.seconds if rep else 0.0
                        bad = bad or bool(s.bad)
                    if bad or (rep and spent > self.opts.rep_budget_s * n):
                        break
        except RankError as e:
            if fatal(e, self.ranks):
                raise
            self.res.errors[f"{name} {variant}".strip()] = e.error

    def run_on(self, targets: list[tuple[str, int]], method: str, starts: str = "") -> Go:
        """A :data:`Go` sending :class:`Run` to ``targets``; its time runs from the first
        start of role ``starts`` (default: any) to the last end."""

        def go(req: Request, seed: int) -> tuple[float, list[m.Timing]]:
            cmd = m.Run(method, req, seed, self.res.bytes[req.index])
            ts = self.ask([(ro, r, cmd) for ro, r in targets])
            pairs = zip(targets, ts, strict=True)
            first = [t.start for (ro, _), t in pairs if not starts or ro == starts]
            return max(t.end for t in ts) - min(first), ts

        return go

    # --- the phases ---------------------------------------------------------------------

    def go_load(
        self, req: Request, seed: int, inline: bool = True, nixl_only: bool = False
    ) -> tuple[float, list[m.Timing]]:
        rid = f"{self.tag}-r{req.index}-{seed}"
        assert self.producer is not None
        handle = self.producer.prefill_done(rid, req.lists("P"), req.tokens)
        wire = handle.to_bytes()
        ts = self.every("D", m.Load(wire, req, self.opts.call_timeout_s, inline, nixl_only))
        self.producer.freed()  # drained: P may reuse them (the check does not)
        return max(t.end - t.start for t in ts), ts

    def connector(self) -> None:
        if self.opts.prepare:  # the pair connected before its first request
            self.guarded("prepare", self.prepare)
        # in turn with the same loads handed to a worker whole (the queue hand-off), and
        # as across nodes: nothing of P mapped, the connector choosing among NIXL movers
        queued = partial(self.go_load, inline=False)
        nixl = partial(self.go_load, nixl_only=True)
        also = [("queued", queued), ("nixl", nixl)]
        self.measure("kvbridge", self.case.mode, self.go_load, also=also)
        facts.check_mover(self)
        if self.want_ordering:
            self.guarded("ordering", lambda: ordering.run(self))
        self.ask([(ro, r, m.CloseConnector()) for ro, r in self.ranks_of("D") + self.ranks_of("P")])
        self.connect()  # the consumer's close dropped P's agents from D's

    def prepare(self) -> None:
        assert self.producer is not None
        left = self.deadline + 30.0 - time.monotonic()  # as ask() bounds the call
        call = min(self.opts.call_timeout_s, max(left, 5.0))
        timeout = max(call - 10.0, 1.0)  # the rank's own, so it answers within the call
        cmd = m.Prepare(self.producer.endpoint, self.producer.engine_id, timeout)
        self.res.prepare_s = max(self.every("D", cmd))

    def guarded(self, name: str, body: Callable[[], None]) -> None:
        """Run ``body``; a command that failed in a rank that goes on is recorded under
        ``name`` and the case goes on (a dead or silent rank still stops it)."""
        try:
            body()
        except RankError as e:
            if fatal(e, self.ranks):
                raise
            self.res.errors[name] = e.error

    def kernel(self) -> None:
        infos = [ready.info for ready in self.ready[0]]
        why = next((f"P rank {i.rank} shares no memory" for i in infos if i and not i.shares), "")
        share = self.ready[0][0].staging_share
        if why or share is None:
            for method in ("kernel", "copy"):
                self.res.notes[method] = why or "P rank 0's staging buffer cannot be mapped"
            return

        def body() -> None:
            self.every("D", m.OpenMaps(tuple(i for i in infos if i is not None), share))
            try:
                self.measure("kernel", "", self.run_on(self.ranks_of("D"), "kernel"))
                self.measure("copy", "", self.run_on(self.ranks_of("D"), "copy"), staging=True)
            finally:
                self.every("D", m.CloseMaps())

        self.guarded("kernel", body)

    def triton(self) -> None:
        """Each D rank's fused-kernel facts, after the kernel mover's copies."""
        self.guarded("triton", lambda: facts.check_triton(self, self.every("D", m.TritonFacts())))

    def nixl(self) -> None:
        pull = self.case.mode == "pull"
        who = self.ranks_of("D") if pull else self.ranks_of("P")
        self.measure("direct", "READ" if pull else "WRITE", self.run_on(who, "direct"))
        both = self.ranks_of("D") + self.ranks_of("P")  # D waits first; P starts the clock
        self.measure("staged", "READ" if pull else "WRITE", self.run_on(both, "staged", "P"))
        self.measure("contig", "WRITE", self.run_on([("P", 0)], "contig"), staging=True)

    def vllm(self) -> None:
        why = vllm_refusal(self.case)
        if why:
            self.res.notes["vllm"] = why
            return
        everyone = self.ranks_of("P") + self.ranks_of("D")
        for threads in self.opts.threads:
            self.check_budget()

            def body(threads: int = threads) -> None:
                metas = self.ask([(ro, r, m.VllmOpen(threads)) for ro, r in everyone])
                try:
                    p, d = tuple(metas[: self.case.p_tp]), tuple(metas[self.case.p_tp :])
                    self.ask([(ro, r, m.VllmConnect(p, d)) for ro, r in everyone])
                    self.measure(
                        "vllm", f"WRITE t{threads}", self.run_on(self.ranks_of("P"), "vllm")
                    )
                    self.measure(
                        "vllm", f"READ t{threads}", self.run_on(self.ranks_of("D"), "vllm")
                    )
                finally:
                    self.ask([(ro, r, m.VllmClose()) for ro, r in everyone])

            self.guarded(f"vllm t{threads}", body)
