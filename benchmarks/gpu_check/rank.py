"""A rank process: its set-up for a case, and the commands of :mod:`.messages`.

P ranks hold the P instance's regions and a :class:`~kvbridge.api.ProducerWorker`; D ranks
hold D's regions and a :class:`~kvbridge.api.Consumer` (kvbridge's choice, the real path:
side channel, lease, mover). Each rank has one :class:`NixlTransport`, shared by its
connector end and the check's own direct, staged and contiguous transfers; its staging
buffer is registered first so the metadata the connector sends covers it.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from benchmarks.gpu_check import messages as m
from benchmarks.gpu_check import pattern
from benchmarks.gpu_check.memory import Pools, allocate
from benchmarks.triton_state import wait_compiled
from kvbridge.connector import Consumer, Mode, ProducerWorker, TransferHandle
from kvbridge.connector.movers.kernel import Span
from kvbridge.layout.tensor import Region, regions_at
from kvbridge.layout.view import RankLayout
from kvbridge.plan import Bound, Geometry, Side
from kvbridge.spec import ModelSpec, Parallel
from kvbridge.transport.ipc import Opened, export
from kvbridge.transport.memory import byte_tensor
from kvbridge.transport.nixl import NixlTransport

LOAD_POLL_S = 0.0002


RESTORE_WAIT_S = 10.0
"""Most a NIXL-only load's end waits for the consumer to run no load before its kernel
mover and mode come back (left off otherwise: the next loads show it)."""
BUSY_S = 1.0
"""On a GPU a rank polls for its next command this long after each one, as vLLM's
workers wait for their next step (``refengine.processes.serve``); a blocking rank's core
goes idle and its next load's host work runs 2–4× slower (docs/performance.md). Not on
the CPU, where polling ranks would take the cores the copies need."""
COMPILE_WAIT_S = 60.0
"""Most a rank waits, after a transfer, for the fixed-length kernels it queued."""


@dataclass
class RankState:
    """Everything one rank holds for one case."""

    setup: m.Setup
    specs: tuple[ModelSpec, ModelSpec]
    pars: tuple[Parallel, Parallel]
    layouts: tuple[list[RankLayout], list[RankLayout]]
    pools: Pools
    transport: NixlTransport
    words: pattern.Words
    own: Span
    stream: Any = None
    worker: ProducerWorker | None = None
    consumer: Consumer | None = None
    peers: m.Connect | None = None
    agents: dict[tuple[str, int], str] = field(default_factory=dict)
    geoms: dict[int, Geometry] = field(default_factory=dict)
    """Per D rank, its pairing with all of P (D: its own; P: every D rank's)."""
    bounds: tuple[list[Bound], list[Bound]] = ([], [])
    maps: dict[int, Span] = field(default_factory=dict)
    kernel_geom: Geometry | None = None
    """D: its pairing over the offsets of :attr:`maps` and :attr:`own` (as the kernel
    mover plans)."""
    divisors: dict[int, int] = field(default_factory=dict)
    """D: per P rank, :meth:`Geometry.divisor` of :attr:`kernel_geom`."""
    p0_staging: torch.Tensor | None = None
    opened: list[Opened] = field(default_factory=list)
    notifs: set[bytes] = field(default_factory=set)
    vllm: Any = None
    late: Any = None
    """P: a late KV write in flight (:class:`benchmarks.gpu_check.ordering.Late`)."""

    @property
    def role(self) -> str:
        return self.setup.role

    @property
    def rank(self) -> int:
        return self.setup.rank

    @property
    def layout(self) -> RankLayout:
        return self.layouts[0 if self.role == "P" else 1][self.rank]

    @property
    def spec(self) -> ModelSpec:
        return self.specs[0 if self.role == "P" else 1]

    @property
    def mode(self) -> str:
        return self.setup.case.mode

    def on_stream(self) -> Any:
        """The rank's CUDA stream as torch's current one (on CPU: nothing)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def sync(self) -> None:
        if self.setup.gpu:
            torch.cuda.synchronize()


def build(cmd: m.Setup) -> tuple[RankState, m.Ready]:
    """Memory, agent, connector end for ``cmd.case``; what peers need to know of them."""
    case = cmd.case
    specs, pars, layouts = case.specs(), case.pars(), case.layouts()
    lay = layouts[0 if cmd.role == "P" else 1][cmd.rank]
    pools = allocate(lay.regions, cmd.staging, cmd.gpu, cmd.shm_path)
    transport = NixlTransport(f"check-{cmd.role}{cmd.rank}-{os.getpid()}-{time.monotonic_ns()}")
    transport.register([pools.staging_region()])
    own = Span(pools.region_list())
    st = RankState(
        cmd,
        specs,
        pars,
        layouts,
        pools,
        transport,
        pattern.word_sizes(layouts[0] + layouts[1]),
        own,
    )
    if cmd.gpu:
        st.stream = torch.cuda.Stream()
    info = None
    if cmd.role == "P":
        st.worker = ProducerWorker(
            cmd.rank, lay, pools.bases, transport, cmd.secret, memory=pools.kind, device=0
        )
        info, share = st.worker.info, export(pools.staging_region())
        meta = info.agent  # the bytes D's connector gets at the handshake: one metadata
    else:
        st.consumer = Consumer(
            "D-check",
            specs[1],
            pars[1],
            cmd.rank,
            lay,
            pools.bases,
            transport,
            cmd.secret,
            transfer_timeout_s=60.0,
            mode=Mode(case.mode),
            memory=pools.kind,
            device=0,
        )
        meta, share = st.consumer.metadata, None
    staging = int(pools.staging.data_ptr())
    return st, m.Ready(tuple(pools.bases), staging, meta, share, info)


def connect(st: RankState, cmd: m.Connect) -> None:
    """Know every peer's agent; the geometry of each pairing this rank plans."""
    st.peers = cmd
    other = cmd.d if st.role == "P" else cmd.p
    for r, ready in enumerate(other):
        st.agents[("D" if st.role == "P" else "P", r)] = st.transport.add_peer(ready.metadata)
    p_lays, d_lays = st.layouts
    p_b = [Bound(lay, ready.bases) for lay, ready in zip(p_lays, cmd.p, strict=True)]
    d_b = [Bound(lay, ready.bases) for lay, ready in zip(d_lays, cmd.d, strict=True)]
    st.bounds = (p_b, d_b)
    (sp, sd), (pp, pd) = st.specs, st.pars
    for d in [st.rank] if st.role == "D" else range(pd.world):
        if d not in st.geoms:
            st.geoms[d] = Geometry(Side(sp, pp, p_b), Side(sd, pd, d_b), d)


def load(st: RankState, cmd: m.Load) -> m.Timing:
    """kvbridge's choice: the consumer loads the handle; its outcome, timed by itself
    (queue, then the load: not this rank's polling)."""
    d = st.consumer
    assert d is not None
    if not cmd.nixl_only:
        return _load(d, cmd)
    kernel, mode = d.kernel, d.mode
    d.kernel, d.mode = None, Mode.AUTO  # D's choice of mover as across nodes, AUTO's
    try:
        return _load(d, cmd)
    finally:  # back once no load runs (a timed-out one may still be moving)
        end = time.monotonic() + RESTORE_WAIT_S
        while d.pending() and time.monotonic() < end:
            time.sleep(LOAD_POLL_S)
        if not d.pending():
            d.kernel, d.mode = kernel, mode


def _load(d: Consumer, cmd: m.Load) -> m.Timing:
    handle = TransferHandle.from_bytes(cmd.handle)
    d.inline = cmd.inline
    d.load(handle, cmd.request.lists("D"), 0)
    end = time.monotonic() + cmd.timeout_s
    while time.monotonic() < end:
        for out in d.poll():
            if out.request_id != handle.request_id:
                continue
            if not out.ok:
                raise RuntimeError(f"load of {out.request_id} failed: {out.error}")
            now = time.monotonic()
            detail = {
                "mover": out.mover,
                "reason": out.reason,
                "verified": out.verified,
                "stages_ms": {k: round(v * 1e3, 4) for k, v in out.stages.items()},
            }
            plan_s = out.stages.get("plan", 0.0)
            took = out.seconds + out.stages.get("queue", 0.0)  # load() → outcome, its clock
            return m.Timing(now - took, now, out.bytes, out.descriptors, plan_s, 0.0, detail)
        time.sleep(LOAD_POLL_S)
    raise TimeoutError(f"no outcome for {handle.request_id} within {cmd.timeout_s} s")


def prepare(st: RankState, cmd: m.Prepare) -> float:
    assert st.consumer is not None
    t0 = time.perf_counter()
    st.consumer.prepare(cmd.endpoint, cmd.engine_id).result(timeout=cmd.timeout_s)
    return time.perf_counter() - t0


def close_connector(st: RankState, _: m.CloseConnector) -> None:
    if st.consumer is not None:
        st.consumer.close()  # unmaps P's regions, forgets P's agents
        st.consumer = None
    if st.worker is not None:
        st.worker.close()
        st.worker = None


def open_maps(st: RankState, cmd: m.OpenMaps) -> None:
    """Map every P rank's regions (as the kernel mover does) and P rank 0's staging."""
    from kvbridge.control.messages import rank_shares

    for info in cmd.infos:
        opened = Opened(rank_shares(info), st.pools.kind, 0)
        st.opened.append(opened)
        sizes = tuple(s.nbytes for s in rank_shares(info))
        here = regions_at(opened.bases, sizes, st.pools.kind, 0)
        st.maps[info.rank] = Span(here, names=list(info.bases))
    p_b, d_b = st.bounds
    (sp, sd), (pp, pd) = st.specs, st.pars
    p_off = [Bound(b.layout, st.maps[r].bases) if r in st.maps else b for r, b in enumerate(p_b)]
    d_off = Bound(d_b[st.rank].layout, st.own.bases)
    st.kernel_geom = Geometry(Side(sp, pp, p_off), Side(sd, pd, {st.rank: d_off}), st.rank)
    st.divisors = {r: st.kernel_geom.divisor(r) for r in st.maps}
    if cmd.staging is not None:
        opened = Opened([cmd.staging], st.pools.kind, 0)
        st.opened.append(opened)
        region = Region(opened.bases[0], cmd.staging.nbytes, st.pools.kind, 0)
        st.p0_staging = byte_tensor(region)


def close_maps(st: RankState, _: m.CloseMaps | None = None) -> None:
    st.maps, st.p0_staging = {}, None
    for opened in st.opened:
        opened.close()
    st.opened = []


def fill(st: RankState, cmd: m.Fill) -> None:
    pattern.fill(st.spec, st.layout, st.pools.regions, cmd.request.p_tables, cmd.seed, st.words)
    st.sync()


def fill_staging(st: RankState, cmd: m.FillStaging) -> None:
    pattern.fill_flat(st.pools.staging, cmd.nbytes, cmd.seed)
    st.sync()


def verify(st: RankState, cmd: m.Verify) -> m.Checked:
    # a fixed-length kernel the transfer queued compiles now, outside the timed transfers
    # (a process compiles each once; its seconds are in the triton facts)
    wait_compiled(COMPILE_WAIT_S)
    if cmd.staging:
        return m.Checked(
            pattern.flat_mismatches(st.pools.staging, cmd.nbytes, cmd.seed), cmd.nbytes
        )
    req = cmd.request
    args = (st.spec, st.layout, st.pools.regions, req.d_tables, req.tokens, cmd.seed, st.words)
    return m.Checked(*pattern.mismatches(*args))


def teardown(st: RankState) -> None:
    from benchmarks.gpu_check.ordering import finish

    finish(st)  # a late KV write still running ends before its memory goes
    close_connector(st, m.CloseConnector())
    if st.vllm is not None:
        st.vllm.close()
        st.vllm = None
    close_maps(st)
    st.transport.close()
    st.pools.close()
    gc.collect()


Handler = Callable[[RankState, Any], Any]


def handlers() -> dict[type, Handler]:
    from benchmarks.gpu_check import facts, methods, ordering, vllm_rank

    return {
        m.Connect: connect,
        m.Load: load,
        m.Prepare: prepare,
        m.CloseConnector: close_connector,
        m.OpenMaps: open_maps,
        m.CloseMaps: close_maps,
        m.Fill: fill,
        m.FillStaging: fill_staging,
        m.Verify: verify,
        m.Run: methods.run,
        m.VllmOpen: vllm_rank.open_agent,
        m.VllmConnect: vllm_rank.connect,
        m.VllmClose: vllm_rank.close,
        m.TritonFacts: facts.triton_facts,
        m.LateFill: ordering.late_fill,
        m.Written: ordering.written,
        m.LateJoin: ordering.late_join,
    }


class Rank:
    """A rank process's command loop state: at most one case at a time."""

    def __init__(self) -> None:
        self.state: RankState | None = None
        self.table = handlers()

    def handle(self, cmd: Any) -> Any:
        if isinstance(cmd, m.Setup):
            if self.state is not None:
                teardown(self.state)
                self.state = None
            self.state, ready = build(cmd)
            return ready
        if isinstance(cmd, m.Teardown):
            if self.state is not None:
                teardown(self.state)
            self.state = None
            return None
        if self.state is None:
            raise RuntimeError(f"{type(cmd).__name__} before Setup")
        return self.table[type(cmd)](self.state, cmd)

    def close(self) -> None:
        if self.state is not None:
            teardown(self.state)
            self.state = None


def main(conn: Connection, index: int, gpu: bool) -> None:
    """Rank process entry (spawned): boot (torch, CUDA, NIXL), then serve commands."""
    from refengine.processes import Failed, serve

    try:
        facts = boot(gpu)
    except Exception as e:  # reported as the boot reply
        conn.send(Failed(index, f"{type(e).__name__}: {e}"))
        return
    conn.send(facts)
    rank = Rank()
    try:
        serve(conn, rank.handle, index, busy_s=BUSY_S if gpu else 0.0)
    finally:
        rank.close()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def boot(gpu: bool) -> dict[str, object]:
    """Initialise CUDA (before NIXL loads: UCX's CUDA transports find the runtime torch
    loaded) and NIXL; what this process runs on."""
    if gpu:
        torch.cuda.set_device(0)
        torch.cuda.init()
        torch.empty(1, device="cuda")
    from kvbridge.transport.nixl import NIXL_BUILD

    return {
        "triton": _version("triton") or _version("pytorch-triton"),
        "pid": os.getpid(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "nixl": NIXL_BUILD,
    }
