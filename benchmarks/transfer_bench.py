"""Transfer throughput over NIXL between two processes (``kvbridge bench transfer``).

Per case a P process (one rank) and a D process (D rank 0 of the case's D TP) start,
register a Llama-3.1-8B-shaped cache plus one contiguous scratch buffer each, and D
times: planning, posting (the same descriptors with 8-byte runs, one raw request: NIXL's
per-descriptor cost), the full READ of the plan (:func:`~kvbridge.connector.movers.pull.read_runs`,
as the consumer posts it), one raw contiguous READ of the same byte count, and a memcpy
of it. Figures are medians of ``repeats`` runs.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from benchmarks.shapes import llama
from kvbridge.connector.movers.pull import read_runs
from kvbridge.layout import build_layout
from kvbridge.plan import Bound, Geometry, Side
from kvbridge.spec import Parallel


@dataclass(frozen=True)
class Case:
    layout: str
    p_tp: int
    d_tp: int
    tokens: int
    block_ids: str


def _side(layout: str, tp: int, rank: int, blocks: int, scratch: int) -> Any:
    from kvbridge.transport.base import Region
    from kvbridge.transport.nixl import NixlTransport

    lay = build_layout(llama(32), Parallel(tp), rank, layout, blocks)
    bufs = [np.ones(n, np.uint8) for n in [*lay.regions, scratch]]
    agent = NixlTransport(f"bench-{tp}-{rank}-{time.monotonic_ns()}")
    meta = agent.register([Region(int(b.ctypes.data), b.nbytes) for b in bufs])
    return lay, bufs, agent, meta


def _p_main(conn: Connection, case: Case, blocks: int, scratch: int) -> None:
    _, bufs, agent, meta = _side(case.layout, case.p_tp, 0, blocks, scratch)
    conn.send((meta, [int(b.ctypes.data) for b in bufs]))
    conn.recv()  # wait until D is done; our agent must stay alive meanwhile
    agent.close()


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _d_main(conn: Connection, case: Case, blocks: int, scratch: int, repeats: int) -> None:
    lay, bufs, agent, _ = _side(case.layout, case.d_tp, 0, blocks, scratch)
    p_meta, p_bases = conn.recv()
    peer = agent.add_peer(p_meta)
    spec = llama(32)
    p_lay = build_layout(spec, Parallel(case.p_tp), 0, case.layout, blocks)
    p_bound = Bound(p_lay, tuple(p_bases[:-1]))
    d_bound = Bound(lay, tuple(int(b.ctypes.data) for b in bufs[:-1]))
    p_side = Side(spec, Parallel(case.p_tp), [p_bound])
    geom = Geometry(p_side, Side(spec, Parallel(case.d_tp), [d_bound]), 0)
    need = -(-case.tokens // 16)
    rng = np.random.default_rng(0)
    if case.block_ids == "shuffled":
        p_ids, d_ids = [rng.permutation(blocks)[:need]], [rng.permutation(blocks)[:need]]
    else:
        p_ids, d_ids = [np.arange(need)], [np.arange(need)]
    plan = geom.plan(case.tokens, p_ids, d_ids)
    plan_s = _median_s(lambda: geom.plan(case.tokens, p_ids, d_ids), 50)
    s, d, n = plan.runs[0].as_uint64()
    tiny = np.full_like(n, 8)

    def read(src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> None:
        agent.wait(agent.read(peer, dst, src, ln), 60.0)

    post_s = _median_s(lambda: read(s, d, tiny), repeats)
    xfer_s = _median_s(
        lambda: read_runs(agent, {0: peer}, plan.runs, time.monotonic() + 60.0, []), repeats
    )
    total = int(n.sum())
    one = np.array([total], np.uint64)
    contig_s = _median_s(
        lambda: read(
            np.array([p_bases[-1]], np.uint64), np.array([bufs[-1].ctypes.data], np.uint64), one
        ),
        repeats,
    )
    src_np = np.ones(total, np.uint8)
    memcpy_s = _median_s(lambda: np.copyto(bufs[-1][:total], src_np), repeats)
    conn.send(
        {
            **asdict(case),
            "bytes": total,
            "descriptors": len(plan.runs[0]),
            "bytes_per_descriptor": total // max(len(plan.runs[0]), 1),
            "gbps": round(total / xfer_s / 1e9, 2),
            "contiguous_gbps": round(total / contig_s / 1e9, 2),
            "memcpy_gbps": round(total / memcpy_s / 1e9, 2),
            "plan_us": round(plan_s * 1e6, 1),
            "post_us": round(post_s * 1e6, 1),
            "host_us": round((plan_s + post_s) * 1e6, 1),
        }
    )
    agent.close()


def run_case(case: Case, repeats: int = 5) -> dict[str, Any]:
    blocks = -(-case.tokens // 16) + 16
    scratch = case.tokens * 32 * 2 * 8 * 128 * 2 // case.d_tp
    # P and D forked from a server that imported this module (torch, numpy, the planner)
    # once: 2 s of imports per process otherwise; NIXL loads in the process that uses it
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    p = ctx.Process(target=_p_main, args=(p_child, case, blocks, scratch), daemon=True)
    d = ctx.Process(target=_d_main, args=(d_child, case, blocks, scratch, repeats), daemon=True)
    p.start()
    d.start()
    try:
        if not p_conn.poll(60):
            raise TimeoutError("P process did not start")
        d_conn.send(p_conn.recv())
        if not d_conn.poll(300):
            raise TimeoutError(f"D process did not finish {case}")
        row: dict[str, Any] = d_conn.recv()
        p_conn.send("done")
        return row
    finally:
        for proc in (d, p):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def run_all(
    quick: bool = False, progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """Every case (``quick``: 1024 tokens only); ``progress`` gets a line per case."""
    todo = [
        Case(layout, p_tp, d_tp, tokens, ids)
        for tokens in ((1024,) if quick else (1024, 8192))
        for layout, p_tp, d_tp in (("nhd", 1, 1), ("hnd", 1, 2), ("block-major", 1, 1))
        for ids in ("consecutive", "shuffled")
    ]
    rows = []
    for i, case in enumerate(todo, 1):
        rows.append(run_case(case))
        if progress is not None:
            progress(f"[{i}/{len(todo)}] {_describe(case)}: {_figures(rows[-1])}")
    return rows


def _describe(case: Case) -> str:
    return f"{case.tokens} tokens TP {case.p_tp}→{case.d_tp} {case.layout} {case.block_ids}"


def _figures(row: dict[str, Any]) -> str:
    keys = ("gbps", "contiguous_gbps", "memcpy_gbps")
    return f"{row['descriptors']} descriptors, " + ", ".join(f"{k} {row[k]}" for k in keys)
