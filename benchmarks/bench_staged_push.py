"""Direct vs staged push (or ``--mode pull``) over real NIXL between processes: P TP 1 →
D TP 2, NHD, Llama-3.1-8B shapes (32 layers, 8 KV heads of 128, bf16), blocks of 16 on both sides.
Every token row of K and V splits into a 1 KiB run per D rank: 65,536 runs per D rank
for 1,024 tokens. Requests alternate direct, staged (A B A B ...); the figure is the
post + transfer stages (slowest D rank), medians over the repeats; bytes checked once per mode.

    UCX_MODULES=^ib NIXL_LOG_LEVEL=WARN .venv/bin/python -m benchmarks.bench_staged_push --repeats 7
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.connector.producer import Producer
from kvbridge.layout.side import SideConfig
from kvbridge.spec.load import load_model
from kvbridge.spec.model import ModelSpec
from refengine.processes import RankProcesses, serve
from tests.support.procs import RankSpec
from tests.support.rank_worker import Fill, Info, Load, Verify, Wait
from tests.support.scenario import random_tables

SECRET = b"bench-staged-push"


@dataclass(frozen=True, slots=True)
class Staging:
    """D: let the cost model stage requests (``Consumer.staging``) or not."""

    on: bool


def _rank_main(conn: Connection, rs: RankSpec) -> None:
    from tests.support.rank_worker import RankWorker

    worker = RankWorker(rs)

    def staging(cmd: Staging) -> None:
        assert worker.consumer is not None
        worker.consumer.staging = cmd.on

    worker._handlers[Staging] = staging
    conn.send("ready")
    try:
        serve(conn, worker.handle, rs.rank)
    finally:
        worker.close()


def _start(role: str, side: SideConfig, spec: ModelSpec, mode: str) -> RankProcesses:
    ranks = [(RankSpec(role, spec, side, r, SECRET, 60.0, 20.0, mode),) for r in range(side.world)]
    return RankProcesses(mp.get_context("spawn"), _rank_main, ranks, f"bench-{role}")


def _moving(outcome: Any) -> float:
    """Seconds from posting the first run to the last byte landed (and scattered)."""
    return float(outcome.stages.get("post", 0.0) + outcome.stages["transfer"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mode", choices=["push", "pull"], default="push")
    args = ap.parse_args()
    model = load_model("llama-3.1-8b").spec
    p_side, d_side = SideConfig(1, 16, "nhd", 80), SideConfig(2, 16, "nhd", 80)
    p_spec, d_spec = p_side.spec(model), d_side.spec(model)
    p = _start("P", p_side, p_spec, args.mode)
    d = _start("D", d_side, d_spec, args.mode)
    producer = Producer(f"P-{uuid.uuid4().hex[:6]}", p_spec, p_side.parallel, SECRET, 60.0)
    try:
        for info in p.call(Info(), 120):
            producer.add_rank(info)
        d.call(Info(), 120)
        rng = np.random.default_rng(5)
        n = args.tokens
        p_tabs = random_tables(p_spec, n, 80, rng)
        p.call(Fill(n, p_tabs), 300)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.repeats * 2 + 2):  # the first pair warms up
            staged = bool(i % 2)
            d.call(Staging(staged), 30)
            rid = f"r{i}"
            d_tabs = random_tables(d_spec, n, 80, rng)
            check = i in (2, 3)
            d.call(Load(producer.prefill_done(rid, p_tabs, n).to_bytes(), d_tabs, 0, check), 60)
            outs = [o[rid] for o in d.call(Wait([rid], 120), 180)]
            assert all(o.ok for o in outs), [o.error for o in outs]
            assert all((o.staged_runs > 0) == staged for o in outs), outs
            if check:
                assert d.call(Verify(rid, n, 0, d_tabs), 600) == [0, 0], "bytes differ"
            if i >= 2:
                times[staged].append(max(_moving(o) for o in outs))
            desc = [o.descriptors for o in outs]
            print(f"{rid} {'staged' if staged else 'direct'}: transfer "
                  f"{max(_moving(o) for o in outs) * 1e3:.1f} ms, descriptors {desc}, "
                  f"staged runs {[o.staged_runs for o in outs]}", flush=True)  # fmt: skip
            producer.freed()
        direct, staged_ms = statistics.median(times[False]), statistics.median(times[True])
        print(f"median direct {direct * 1e3:.1f} ms, staged {staged_ms * 1e3:.1f} ms, "
              f"staged is {direct / staged_ms:.1f}x faster ({args.repeats} pairs)")  # fmt: skip
    finally:
        d.close()
        p.close()
        producer.close()


if __name__ == "__main__":
    main()
