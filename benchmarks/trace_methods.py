"""D's ways of moving one request, each timed end to end (plan + post + land).

init      kvbridge's plan, one ``initialize_xfer`` per 16,384 runs (the consumer's path)
prep      kvbridge's plan, both lists ``prep_xfer_dlist``-ed per request, then
          ``make_prepped_xfer`` over all of them
strided   as prep, each side's runs compressed to NIXL's strided rows (Nx5) first
staged    kvbridge's plan through :class:`~kvbridge.connector.movers.staging.Stager`: long
          source spans into a staging slot, then a local scatter
vllm      the vLLM-like read path (:mod:`benchmarks.trace_vllm`)
contig    one READ of the same byte count between contiguous scratch buffers
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.nixl_prepped import prep as prep_list
from benchmarks.nixl_prepped import read_prepped
from benchmarks.trace_alloc import TraceRequest
from benchmarks.trace_vllm import VllmLike
from kvbridge.connector.movers.pull import read_runs
from kvbridge.connector.movers.spans import Regions
from kvbridge.connector.movers.staging import Chunk, Stager
from kvbridge.errors import TransportError
from kvbridge.plan import Geometry, Plan, Runs
from kvbridge.transport.base import XferHandle
from kvbridge.transport.nixl import NixlTransport

TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Timed:
    """One transfer: wall seconds end to end, bytes moved, descriptors posted (after the
    method's own joining: staged spans, strided rows count as runs), planning seconds."""

    seconds: float
    nbytes: int
    descriptors: int
    plan_s: float = 0.0
    rows: int = 0
    """Rows handed to NIXL per side (strided: the compressed rows; else the descriptors)."""
    runs: int = 0
    """Runs of the plan (staged: moved by the scatter); vllm: descriptors."""


@dataclass
class DSide:
    """What D holds for one pair: its agent, P's agent per source rank, the geometry
    and the request's block tables as the plan wants them."""

    transport: NixlTransport
    agents: dict[int, str]
    geom: Geometry
    stager: Stager
    vllm: VllmLike | None
    scratch: tuple[int, int]
    """(P scratch address, D scratch address)."""
    state: tuple[bool, ...]
    """Per spec group: whether it holds state (its table is one slot)."""
    starts: tuple[np.ndarray, np.ndarray]
    """Sorted start addresses of D's and of P's registered regions."""
    p_regions: Regions
    """P's registered regions (starts, ends): staged spans read over gaps inside one."""

    def tables(self, req: TraceRequest) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(P tables, D tables) per spec group: blocks, or ``[slot]`` for state groups."""
        p = [np.array([req.p_slot]) if s else req.p_blocks for s in self.state]
        d = [np.array([req.d_slot]) if s else req.d_blocks for s in self.state]
        return p, d

    def plan(self, req: TraceRequest) -> Plan:
        p, d = self.tables(req)
        return self.geom.plan(req.tokens, p, d)

    def wait(self, handles: Sequence[XferHandle]) -> None:
        for h in handles:
            self.transport.wait(h, TIMEOUT_S)


def _timed_plan(ctx: DSide, req: TraceRequest) -> tuple[Plan, float, float]:
    t0 = time.perf_counter()
    plan = ctx.plan(req)
    return plan, t0, time.perf_counter() - t0


def init(ctx: DSide, req: TraceRequest) -> Timed:
    plan, t0, plan_s = _timed_plan(ctx, req)
    read_runs(ctx.transport, ctx.agents, plan.runs, time.monotonic() + TIMEOUT_S, [])
    runs = plan.descriptors
    return Timed(time.perf_counter() - t0, plan.nbytes, runs, plan_s, runs, runs)


def rows3(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``(addr, len, 0)`` uint64 rows."""
    out = np.zeros((addr.shape[0], 3), np.uint64)
    out[:, 0], out[:, 1] = addr, length
    return out


def rows5(addr: np.ndarray, length: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """NIXL strided rows ``(addr, len, 0, stride, count)``: consecutive runs of equal
    length whose addresses step by the same positive stride (≥ the length) share a row,
    within one registered region (``starts``: the regions' sorted start addresses; NIXL
    refuses a row that spans two). Expanded in order, the rows are the runs again."""
    n = addr.shape[0]
    step = np.diff(addr)
    region = np.searchsorted(starts, addr, side="right")
    ok = (length[1:] == length[:-1]) & (step >= length[:-1]) & (step > 0)
    ok &= region[1:] == region[:-1]
    new = np.ones(n, bool)
    new[1:] = ~ok
    if n > 2:
        new[2:] |= ok[:-1] & (step[1:] != step[:-1])
    first = np.flatnonzero(new)
    count = np.diff(np.append(first, n))
    stride = np.where(count > 1, np.append(step, 0)[first], length[first])
    out = np.zeros((first.shape[0], 5), np.uint64)
    out[:, 0], out[:, 1], out[:, 3], out[:, 4] = addr[first], length[first], stride, count
    return out


def _prepped(ctx: DSide, req: TraceRequest, strided: bool) -> Timed:
    plan, t0, plan_s = _timed_plan(ctx, req)
    handles, rows = [], 0
    for src, r in plan.runs.items():
        agent = ctx.agents[src]
        if strided:
            local, remote = (
                rows5(r.dst, r.length, ctx.starts[0]),
                rows5(r.src, r.length, ctx.starts[1]),
            )
        else:
            local, remote = rows3(r.dst, r.length), rows3(r.src, r.length)
        rows += local.shape[0] + remote.shape[0]
        lists = (prep_list(ctx.transport, "", local), prep_list(ctx.transport, agent, remote))
        idx = np.arange(len(r), dtype=np.int32)
        handles.append(read_prepped(ctx.transport, agent, lists, (idx, idx), r.nbytes))
    ctx.wait(handles)
    runs = plan.descriptors
    return Timed(time.perf_counter() - t0, plan.nbytes, runs, plan_s, rows // 2, runs)


def prep(ctx: DSide, req: TraceRequest) -> Timed:
    return _prepped(ctx, req, False)


def strided(ctx: DSide, req: TraceRequest) -> Timed:
    return _prepped(ctx, req, True)


def staged(ctx: DSide, req: TraceRequest) -> Timed:
    """Every source rank's runs staged (a run longer than a slot sends that rank direct)."""
    plan, t0, plan_s = _timed_plan(ctx, req)
    todo: dict[int, list[Chunk]] = {}
    direct: dict[int, Runs] = {}
    for src, r in plan.runs.items():
        try:
            todo[src] = ctx.stager.chunks(r, ctx.p_regions)
        except TransportError:
            direct[src] = r
    slot = ctx.stager.pool.take(1.0)
    if slot is None:
        raise TransportError("no staging slot free")
    deadline = time.monotonic() + TIMEOUT_S
    staged_posted = 0

    def pull_staged() -> None:  # as the consumer: direct sources posted, then the staged
        nonlocal staged_posted
        staged_posted, _ = ctx.stager.pull(ctx.transport, ctx.agents, todo, slot, deadline, [])

    posted = read_runs(ctx.transport, ctx.agents, direct, deadline, [], then=pull_staged)
    posted += staged_posted
    return Timed(time.perf_counter() - t0, plan.nbytes, posted, plan_s, posted, plan.descriptors)


def vllm(ctx: DSide, req: TraceRequest) -> Timed:
    assert ctx.vllm is not None
    p, d = ctx.tables(req)
    t0 = time.perf_counter()
    handles, descs, nbytes = [], 0, 0
    for src, (li, ri, n) in ctx.vllm.indices(p, d, req.tokens).items():
        handles.append(
            read_prepped(ctx.transport, ctx.agents[src], ctx.vllm.lists[src], (li, ri), n)
        )
        descs, nbytes = descs + li.shape[0], nbytes + n
    ctx.wait(handles)
    return Timed(time.perf_counter() - t0, nbytes, descs, 0.0, descs, descs)


def contiguous(ctx: DSide, nbytes: int) -> Timed:
    """One READ of ``nbytes`` from P's scratch to D's (the agent of source rank 0)."""
    one = np.array([nbytes], np.uint64)
    p_addr, d_addr = (np.array([a], np.uint64) for a in ctx.scratch)
    t0 = time.perf_counter()
    ctx.transport.wait(ctx.transport.read(ctx.agents[0], d_addr, p_addr, one), TIMEOUT_S)
    return Timed(time.perf_counter() - t0, nbytes, 1, 0.0, 1, 1)


METHODS: dict[str, Callable[[DSide, TraceRequest], Timed]] = {
    "init": init,
    "prep": prep,
    "strided": strided,
    "staged": staged,
    "vllm": vllm,
}
