"""The timed methods, each run by the rank that does the work (``time.monotonic`` stamps:
one clock for every process of the machine, so the driver may join a P rank's start with
a D rank's end).

direct     kvbridge's plan posted as it is: D READs (pull) or each P rank WRITEs (push)
staged     each P rank gathers its runs into its staging buffer (copy kernels as the
           library's device staging runs them), one transfer per (P rank, D rank) pair
           into D's staging buffer (push: P WRITEs and notifies; pull: P notifies, D
           READs), D scatters (kernels again)
kernel     D maps P's regions and copies every run with one kernel per group of equal
           runs (the kernel mover's steps, :mod:`kvbridge.connector.movers.kernel`)
copy       D copies the same bytes contiguously from P rank 0's mapped staging buffer
contig     P rank 0 WRITEs the same bytes contiguously into each D rank's staging buffer
vllm-like  :mod:`.vllm_like` over raw agents (:mod:`.vllm_agent`): D READs, or P WRITEs

Staging buffers: D's holds what it receives, packed in source-rank order; P's holds one
segment of ``seg`` bytes per D rank (``seg``: the staging size over D's world).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.gpu_check import messages as m
from benchmarks.gpu_check import vllm_rank
from benchmarks.gpu_check.rank import RankState
from kvbridge.connector.movers.device_copies import rows_copy
from kvbridge.connector.movers.kernel import copy_groups, run_copy
from kvbridge.connector.movers.memory import equal_runs
from kvbridge.plan import Plan, Runs
from kvbridge.transport.base import XferHandle

POST_RUNS = 16384
"""Runs per posted request, as the consumer posts them."""
TIMEOUT_S = 120.0
U64 = np.uint64


def _plan(st: RankState, d: int, req: m.Request) -> Plan:
    return st.geoms[d].plan(req.tokens, req.p_tables, req.d_tables)


def _post(
    st: RankState,
    op: str,
    peer: str,
    local: np.ndarray,
    remote: np.ndarray,
    size: np.ndarray,
    out: list[XferHandle],
) -> None:
    post = st.transport.read if op == "READ" else st.transport.write
    for lo in range(0, local.shape[0], POST_RUNS):
        hi = lo + POST_RUNS
        out.append(post(peer, local[lo:hi], remote[lo:hi], size[lo:hi]))


def _wait(st: RankState, handles: list[XferHandle]) -> None:
    for h in handles:
        st.transport.wait(h, TIMEOUT_S)


def direct(st: RankState, cmd: m.Run) -> m.Timing:
    """D: READ its plan's runs from every P rank. P: WRITE its runs to every D rank."""
    t0 = time.monotonic()
    handles: list[XferHandle] = []
    nbytes = runs = 0
    plan_s = 0.0
    for d in st.geoms:
        t = time.monotonic()
        plan = _plan(st, d, cmd.request)
        plan_s += time.monotonic() - t
        for src, r in plan.runs.items():
            s, dst, n = r.as_uint64()
            if st.role == "D":
                _post(st, "READ", st.agents[("P", src)], dst, s, n, handles)
            elif src == st.rank:
                _post(st, "WRITE", st.agents[("D", d)], s, dst, n, handles)
            else:
                continue
            nbytes, runs = nbytes + r.nbytes, runs + len(r)
    _wait(st, handles)
    return m.Timing(t0, time.monotonic(), nbytes, runs, plan_s, plan_s)


def _packed(r: Runs, base: int) -> np.ndarray:
    """Offsets of ``r``'s runs packed one after the other from ``base`` (int64)."""
    off = np.full(len(r), base, np.int64)
    off[1:] += np.cumsum(r.length[:-1])
    return off


def _copies(
    dst: torch.Tensor,
    d_off: np.ndarray,
    src: torch.Tensor,
    s_off: np.ndarray,
    length: np.ndarray,
    stream: object,
) -> int:
    """Copy runs of ``length`` bytes ``src[s_off] → dst[d_off]`` (tensor offsets, bytes),
    one kernel per group of :func:`equal_runs`; the number of kernels."""
    calls = 0
    for d, s, size in equal_runs(d_off, s_off, length):
        rows_copy(dst, d, src, s, size, stream=stream)
        calls += 1
    return calls


def _src_base(plan: Plan, src: int) -> int:
    """Where source rank ``src``'s bytes start in D's staging buffer."""
    return sum(r.nbytes for s, r in sorted(plan.runs.items()) if s < src)


def _segment(st: RankState) -> int:
    """Bytes of one P segment (one per D rank); D's staging buffer is as large."""
    assert st.peers is not None
    n = st.pools.staging.numel()
    return n // len(st.peers.d) if st.role == "P" else n


def staged_send(st: RankState, cmd: m.Run) -> m.Timing:
    """P: gather every D rank's runs of this rank into its segment, then WRITE each segment
    (push) or tell D it is ready (pull), with a notification."""
    t0 = time.monotonic()
    assert st.peers is not None
    seg, own, staging = _segment(st), st.own, st.pools.staging
    todo, calls = [], 0
    for d in st.geoms:
        plan = _plan(st, d, cmd.request)
        r = plan.runs.get(st.rank)
        if r is None:
            continue
        s_off = own.offsets(r.src, r.length, "P's")
        calls += _copies(staging, _packed(r, d * seg), own.tensor, s_off, r.length, st.stream)
        todo.append((d, r, _src_base(plan, st.rank)))
    if st.stream is not None:
        st.stream.synchronize()
    handles: list[XferHandle] = []
    empty = np.zeros(0, U64)
    for d, r, base in todo:
        peer, note = st.agents[("D", d)], f"stg:{cmd.seed}:{st.rank}".encode()
        if st.mode == "pull":  # D reads the segment once told
            handles.append(st.transport.write(peer, empty, empty, empty, note))
            continue
        local = np.array([staging.data_ptr() + d * seg], U64)
        remote = np.array([st.peers.d[d].staging + base], U64)
        handles.append(st.transport.write(peer, local, remote, np.array([r.nbytes], U64), note))
    _wait(st, handles)
    nbytes = sum(r.nbytes for _, r, _ in todo)
    return m.Timing(t0, time.monotonic(), nbytes, len(todo), 0.0, 0.0, {"copy_calls": calls})


def staged_recv(st: RankState, cmd: m.Run) -> m.Timing:
    """D: plan while P gathers; once every source's notification arrived, READ the
    segments (pull), then scatter them into the blocks."""
    t0 = time.monotonic()
    assert st.peers is not None
    plan = _plan(st, st.rank, cmd.request)
    _await_notifs(st, {f"stg:{cmd.seed}:{src}".encode() for src in plan.runs})
    base = {src: _src_base(plan, src) for src in plan.runs}
    if st.mode == "pull":
        handles: list[XferHandle] = []
        for src, r in plan.runs.items():
            local = np.array([st.pools.staging.data_ptr() + base[src]], U64)
            remote = np.array([st.peers.p[src].staging + st.rank * _segment(st)], U64)
            size = np.array([r.nbytes], U64)
            _post(st, "READ", st.agents[("P", src)], local, remote, size, handles)
        _wait(st, handles)
    calls = 0
    for src, r in plan.runs.items():
        d_off = st.own.offsets(r.dst, r.length, "D's")
        s_off = _packed(r, base[src])
        calls += _copies(st.own.tensor, d_off, st.pools.staging, s_off, r.length, st.stream)
    if st.stream is not None:
        st.stream.synchronize()
    detail: dict[str, object] = {"copy_calls": calls}
    return m.Timing(t0, time.monotonic(), plan.nbytes, len(plan.runs), 0.0, 0.0, detail)


def _await_notifs(st: RankState, want: set[bytes]) -> None:
    end = time.monotonic() + TIMEOUT_S
    while not want <= st.notifs:
        st.notifs.update(msg for _, msg in st.transport.notifications())
        if time.monotonic() > end:
            raise TimeoutError(f"staged: notifications {sorted(want - st.notifs)} missing")
    st.notifs -= want


def kernel(st: RankState, cmd: m.Run) -> m.Timing:
    """D: plan over the mapped spans' offsets, checks, one copy kernel per group of equal
    runs (as the kernel mover does), synchronise."""
    t0 = time.monotonic()
    req = cmd.request
    assert st.kernel_geom is not None
    plan = st.kernel_geom.plan(req.tokens, req.p_tables, req.d_tables)
    t1 = time.monotonic()
    work = []
    for src, r in plan.runs.items():
        span = st.maps[src]
        groups = copy_groups(span, st.own, r, f"P rank {src}'s")
        work += [(span, c, st.divisors[src]) for c in groups]
    events = _Events(st)
    t2 = time.monotonic()
    events.begin()
    for span, c, divisor in work:
        run_copy(st.own, span, c, divisor, st.stream)
    detail = events.done()
    return m.Timing(t0, time.monotonic(), plan.nbytes, len(work), t1 - t0, t2 - t0, detail)


BACK_TO_BACK = 10
"""Contiguous copies timed back to back (CUDA events): the floor without any host cost."""


def copy(st: RankState, cmd: m.Run) -> m.Timing:
    """D: one contiguous copy of this rank's bytes from P rank 0's mapped staging buffer
    (wall and GPU time), then, on a GPU, ``BACK_TO_BACK`` more between two events."""
    assert st.p0_staging is not None
    n = cmd.nbytes[st.rank]
    events = _Events(st)  # made before the clock starts: not the copy's time
    t0 = time.monotonic()
    events.begin()
    with st.on_stream():
        st.pools.staging[:n].copy_(st.p0_staging[:n])
    detail = events.done()
    end = time.monotonic()
    if st.stream is not None:
        events = _Events(st)
        events.begin()
        with st.on_stream():
            for _ in range(BACK_TO_BACK):
                st.pools.staging[:n].copy_(st.p0_staging[:n])
        gpu = events.done().get("gpu_ms")
        if isinstance(gpu, float):
            detail["back_to_back_ms"] = gpu / BACK_TO_BACK
    return m.Timing(t0, end, n, 1, detail=detail)


class _Events:
    """GPU time of what is queued on the rank's stream from :meth:`begin` to :meth:`done`
    (CUDA events: from the first copy's start to the last one's end, launch gaps and
    offset transfers included); on the CPU nothing (the copies are synchronous: their
    wall time is it)."""

    def __init__(self, st: RankState):
        self.stream = st.stream
        self.start = self.end = None
        if self.stream is not None:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        if self.start is not None:
            self.start.record(self.stream)

    def done(self) -> dict[str, object]:
        """Wait for the stream → ``{"gpu_ms": …}`` (empty on the CPU)."""
        if self.stream is None or self.start is None or self.end is None:
            return {}
        self.end.record(self.stream)
        self.stream.synchronize()
        return {"gpu_ms": float(self.start.elapsed_time(self.end))}


def contig(st: RankState, cmd: m.Run) -> m.Timing:
    """P rank 0: one WRITE per D rank of that rank's byte count, staging to staging."""
    assert st.peers is not None
    t0 = time.monotonic()
    handles = []
    local = np.array([st.pools.staging.data_ptr()], U64)
    for d, ready in enumerate(st.peers.d):
        size = np.array([cmd.nbytes[d]], U64)
        remote = np.array([ready.staging], U64)
        handles.append(st.transport.write(st.agents[("D", d)], local, remote, size))
    _wait(st, handles)
    return m.Timing(t0, time.monotonic(), sum(cmd.nbytes), len(handles))


METHODS: dict[tuple[str, str], Callable[[RankState, m.Run], m.Timing]] = {
    ("D", "direct"): direct,
    ("P", "direct"): direct,
    ("P", "staged"): staged_send,
    ("D", "staged"): staged_recv,
    ("D", "kernel"): kernel,
    ("D", "copy"): copy,
    ("P", "contig"): contig,
}


def run(st: RankState, cmd: m.Run) -> m.Timing:
    if cmd.method == "vllm":
        return vllm_rank.run(st, cmd)
    return METHODS[(st.role, cmd.method)](st, cmd)
