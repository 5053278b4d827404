"""The two processes of one case: P (every P rank's memory behind one NIXL agent) and D
(rank 0 of D's TP), with typed messages between them over a pipe.

P writes each request's pattern into its blocks when D asks (untimed, as the engine
wrote them during prefill), and a scratch pattern before each contiguous READ. D runs
the trace; per measured request and per method: P fills → D times the method → D checks
every byte → P fills its scratch → D times one contiguous READ of the same byte count →
D checks it. The methods' order rotates from request to request.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from benchmarks import trace_case as tc
from benchmarks import trace_pattern as pat
from benchmarks.trace_alloc import TraceRequest, simulate
from benchmarks.trace_methods import METHODS, DSide, contiguous
from benchmarks.trace_vllm import VllmLike
from kvbridge.connector.movers.spans import regions_of
from kvbridge.connector.movers.staging import Stager
from kvbridge.errors import PlanError
from kvbridge.layout import RankLayout
from kvbridge.plan import Bound, Geometry, Side
from kvbridge.spec import ModelSpec, Parallel
from kvbridge.transport.base import Region
from kvbridge.transport.nixl import NixlTransport

STAGING_BYTES = 16 << 20
"""One staging slot, as the consumer's default (32 MiB over two workers)."""


@dataclass(frozen=True, slots=True)
class PReady:
    metadata: bytes
    bases: tuple[tuple[int, ...], ...]
    """Region addresses per P rank."""
    scratch: int


@dataclass(frozen=True, slots=True)
class Fill:
    tables: tuple[np.ndarray, ...]
    seed: int


@dataclass(frozen=True, slots=True)
class FillScratch:
    nbytes: int
    seed: int


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Sample:
    """One method on one request, and the contiguous READ right after it."""

    method: str
    request: int
    tokens: int
    seconds: float
    contig_s: float
    nbytes: int
    descriptors: int
    rows: int
    runs: int
    plan_s: float
    bad_words: int
    bad_contig: int
    merged: int = 0
    """vllm: descriptors left after NIXL joins adjacent ones."""


@dataclass
class CaseResult:
    case: tc.Case
    blocks: dict[str, int]
    median_tokens: float
    max_tokens: int
    word: int
    samples: list[Sample] = field(default_factory=list)
    auto: dict[str, int] = field(default_factory=dict)
    """The cost model's choice per request (``staged`` / ``direct``)."""
    vllm_note: str = ""
    error: str = ""
    seconds: float = 0.0


def _agent_name(side: str) -> str:
    return f"trace-{side}-{os.getpid()}-{time.monotonic_ns()}"


def p_main(conn: Connection, case: tc.Case) -> None:
    """P: all P ranks' pools and a scratch buffer behind one agent; fills on request."""
    spec = tc.model_spec(case.model)
    size = tc.sizing(spec, case)
    p_lays, d_lay = tc.layouts(spec, case, size)
    word = pat.word_bytes([*p_lays, d_lay])
    mems = [tc.allocate(lay) for lay in p_lays]
    scratch = np.zeros(size.scratch_bytes, np.uint8)
    regions = [Region(int(r.ctypes.data), r.nbytes) for _, rs in mems for r in rs]
    with NixlTransport(_agent_name("p")) as transport:
        meta = transport.register([*regions, Region(int(scratch.ctypes.data), scratch.nbytes)])
        bases = tuple(tuple(int(r.ctypes.data) for r in rs) for _, rs in mems)
        conn.send(PReady(meta, bases, int(scratch.ctypes.data)))
        while not isinstance(msg := conn.recv(), Stop):
            if isinstance(msg, Fill):
                for lay, (_, rs) in zip(p_lays, mems, strict=True):
                    pat.fill(spec, lay, rs, msg.tables, msg.seed, word)
            else:
                scratch[: msg.nbytes] = pat.scratch_pattern(msg.nbytes, msg.seed)
            conn.send(True)


@dataclass
class _D:
    """D's state for one case."""

    spec: ModelSpec
    layout: RankLayout
    regions: list[np.ndarray]
    scratch: np.ndarray
    word: int
    ctx: DSide
    p: Connection
    seed: int = 0

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def pair(self, req: TraceRequest, method: str) -> Sample:
        p_tabs, d_tabs = self.ctx.tables(req)
        seed = self.next_seed()
        self.p.send(Fill(tuple(p_tabs), seed))
        self.p.recv()
        t = METHODS[method](self.ctx, req)
        bad = pat.mismatches(
            self.spec, self.layout, self.regions, d_tabs, req.tokens, seed, self.word
        )
        seed_c = self.next_seed()
        self.p.send(FillScratch(t.nbytes, seed_c))
        self.p.recv()
        c = contiguous(self.ctx, t.nbytes)
        bad_c = int(
            np.count_nonzero(self.scratch[: t.nbytes] != pat.scratch_pattern(t.nbytes, seed_c))
        )
        merged = self._merged(req) if method == "vllm" else 0
        return Sample(method, req.index, req.tokens, t.seconds, c.seconds, t.nbytes,
                      t.descriptors, t.rows, t.runs, t.plan_s, bad, bad_c, merged)  # fmt: skip

    def _merged(self, req: TraceRequest) -> int:
        vl = self.ctx.vllm
        assert vl is not None
        p_tabs, d_tabs = self.ctx.tables(req)
        idx = vl.indices(p_tabs, d_tabs, req.tokens)
        return sum(vl.merged(src, li, ri) for src, (li, ri, _) in idx.items())

    def auto(self, req: TraceRequest) -> str:
        """What the consumer's cost model would pick for this request."""
        runs = self.ctx.plan(req).runs
        staged, slot = self.ctx.stager.choose(runs, dict.fromkeys(runs, self.ctx.p_regions))
        if slot is not None:
            self.ctx.stager.pool.give_back(slot, True)
        return "staged" if staged else "direct"


def _d_setup(p: Connection, case: tc.Case, res: CaseResult) -> tuple[_D, NixlTransport]:
    spec = tc.model_spec(case.model)
    size = tc.sizing(spec, case)
    p_lays, d_lay = tc.layouts(spec, case, size)
    _, regions = tc.allocate(d_lay)
    scratch = np.zeros(size.scratch_bytes, np.uint8)
    own = [Region(int(r.ctypes.data), r.nbytes) for r in regions]
    stager = Stager(own, 1, STAGING_BYTES)
    transport = NixlTransport(_agent_name("d"))
    transport.register([*own, Region(int(scratch.ctypes.data), scratch.nbytes), stager.pool.region])
    ready: PReady = p.recv()
    peer = transport.add_peer(ready.metadata)
    agents = dict.fromkeys(range(case.p_tp), peer)
    p_bound = [Bound(lay, b) for lay, b in zip(p_lays, ready.bases, strict=True)]
    d_bound = Bound(d_lay, tuple(int(r.ctypes.data) for r in regions))
    par_p, par_d = Parallel(case.p_tp), Parallel(case.d_tp)
    geom = Geometry(Side(spec, par_p, p_bound), Side(spec, par_d, [d_bound]), 0, pad_blocks=True)
    vllm = _vllm(case, p_lays, d_lay, geom, transport, agents, res)
    state = tuple(spec.is_state_group(g) for g in range(len(spec.groups)))
    starts = (
        np.sort(np.array([r.ctypes.data for r in regions], np.int64)),
        np.sort(np.array([b for bs in ready.bases for b in bs], np.int64)),
    )
    scratch_at = (ready.scratch, int(scratch.ctypes.data))
    p_regions = regions_of(
        [b for bs in ready.bases for b in bs], [n for lay in p_lays for n in lay.regions]
    )
    ctx = DSide(transport, agents, geom, stager, vllm, scratch_at, state, starts, p_regions)
    word = pat.word_bytes([*p_lays, d_lay])
    res.word = word
    return _D(spec, d_lay, regions, scratch, word, ctx, p), transport


def _vllm(
    case: tc.Case,
    p_lays: list[RankLayout],
    d_lay: RankLayout,
    geom: Geometry,
    transport: NixlTransport,
    agents: dict[int, str],
    res: CaseResult,
) -> VllmLike | None:
    """The vLLM-like lists where vLLM could read this pair, else None with the reason."""
    if case.p_layout != case.d_layout:
        res.vllm_note = "vLLM reads between equal layouts only"
    elif case.p_layout != "hnd" and tc.head_split(p_lays, d_lay):
        res.vllm_note = "vLLM needs HND under a head split"
    else:
        try:
            return VllmLike(geom, transport, agents)
        except PlanError as e:
            res.vllm_note = str(e)
    return None


def d_main(p: Connection, out: Connection, case: tc.Case) -> None:
    """D: set up, run the trace, send a :class:`CaseResult` on ``out``."""
    spec = tc.model_spec(case.model)
    size = tc.sizing(spec, case)
    res = CaseResult(case, size.num_blocks, size.trace.median_tokens, size.trace.max_tokens, 0)
    t0 = time.perf_counter()
    d, transport = _d_setup(p, case, res)
    try:
        reqs, _ = simulate(size.trace, case.requests + 1)
        _measure(d, reqs, case, res)
    except Exception as e:  # reported in the case's row, not raised past the bench
        res.error = f"{type(e).__name__}: {e}"
    finally:
        p.send(Stop())
        transport.close()
    res.seconds = time.perf_counter() - t0
    out.send(res)


def _measure(d: _D, reqs: list[TraceRequest], case: tc.Case, res: CaseResult) -> None:
    methods = [m for m in METHODS if m != "vllm" or d.ctx.vllm is not None]
    for m in methods:  # warm-up on the first request (connections, caches): checked only
        if _failed(d.pair(reqs[0], m), res):
            return
    start = time.perf_counter()
    for i, req in enumerate(reqs[1:]):
        if i >= case.min_requests and time.perf_counter() - start > case.budget_s:
            break
        choice = d.auto(req)
        res.auto[choice] = res.auto.get(choice, 0) + 1
        for m in methods[i % len(methods) :] + methods[: i % len(methods)]:
            res.samples.append(d.pair(req, m))
            if _failed(res.samples[-1], res):
                return


def _failed(s: Sample, res: CaseResult) -> bool:
    """A mismatch fails the case (its figures are dropped): True, with the reason."""
    if s.bad_words or s.bad_contig:
        res.error = (
            f"request {s.request} ({s.tokens} tokens) via {s.method}: {s.bad_words} words "
            f"differ from P's pattern, {s.bad_contig} bytes of the contiguous READ"
        )
    return bool(res.error)
