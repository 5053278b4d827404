"""Pushed loads from a P of TP ``--p-tp``, each P rank a process of its own (its
ProducerWorker, NIXL agent and push channel; rank 0's process also runs the Producer), to
one D rank in this process (a Consumer in push mode, staging off: every P rank asked to
WRITE its runs directly). Prints the median load and its transfer stage: with P ranks
asked in turn, the transfer stage grows by a side-channel round trip per P rank; asked at
once, by one. Meant to compare two versions of kvbridge on one machine in one sitting.

Usage: PYTHONPATH=src python -m benchmarks.bench_push_ranks [--p-tp N] [--requests N]
       [--tokens T]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from benchmarks.bench_request_path import SECRET, outcome
from kvbridge.api import (
    Consumer,
    Mode,
    Parallel,
    Producer,
    ProducerWorker,
    build_layout,
    load_model,
    make_transport,
)

BLOCK = 16


def _layout(tp: int, rank: int, tokens: int) -> Any:
    spec = load_model("llama-3.1-8b").spec.with_block_sizes(BLOCK)
    return spec, build_layout(spec, Parallel(tp), rank, "hnd", 4 * -(-tokens // BLOCK))


def _p_rank(conn: Connection, tp: int, rank: int, tokens: int) -> None:
    """P rank ``rank``: sends its RankInfo; rank 0 then takes every rank's infos, makes
    the Producer and serves ``prefill_done`` / ``freed`` calls until None."""
    spec, lay = _layout(tp, rank, tokens)
    mem = [np.zeros(n, np.uint8) for n in lay.regions]
    worker = ProducerWorker(
        rank, lay, [int(b.ctypes.data) for b in mem], make_transport("nixl", f"P{rank}"),
        SECRET, "127.0.0.1",
    )  # fmt: skip
    conn.send(worker.info)
    producer = None
    while (call := conn.recv()) is not None:
        name, args = call
        if name == "ranks":
            producer = Producer("P", spec, Parallel(tp), SECRET, lease_s=30)
            for info in args:
                producer.add_rank(info)
            conn.send(None)
        elif name == "prefill_done":
            assert producer is not None
            conn.send(producer.prefill_done(*args))
        else:
            assert producer is not None
            producer.freed(wait_for=1, timeout_s=5.0)
            conn.send(None)
    worker.close()
    if producer is not None:
        producer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p-tp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    conns, children = [], []
    for r in range(args.p_tp):
        here, there = ctx.Pipe()
        child = ctx.Process(target=_p_rank, args=(there, args.p_tp, r, args.tokens), daemon=True)
        child.start()
        there.close()
        conns.append(here)
        children.append(child)
    infos = [c.recv() for c in conns]
    conns[0].send(("ranks", infos))
    conns[0].recv()
    spec, lay = _layout(1, 0, args.tokens)
    d_mem = [np.zeros(n, np.uint8) for n in lay.regions]
    consumer = Consumer(
        "D", spec, Parallel(1), 0, lay, [int(b.ctypes.data) for b in d_mem],
        make_transport("nixl", "D0"), SECRET, mode=Mode.PUSH, staging=False,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    blocks, need = 4 * -(-args.tokens // BLOCK), -(-args.tokens // BLOCK)
    loads: list[float] = []
    transfers: list[float] = []
    try:
        for i in range(args.requests):
            p_tab = [[int(b) for b in rng.permutation(blocks)[:need]]]
            d_tab = [[int(b) for b in rng.permutation(blocks)[:need]]]
            conns[0].send(("prefill_done", (f"r{i}", p_tab, args.tokens)))
            consumer.load(conns[0].recv(), d_tab, 0)
            got = outcome(consumer)
            assert got.mover == "push", got
            loads.append(got.seconds)
            transfers.append(got.stages["transfer"])
            conns[0].send(("freed", ()))
            conns[0].recv()
    finally:
        consumer.close()
        for c, child in zip(conns, children, strict=True):
            c.send(None)
            child.join(10)
            if child.is_alive():
                child.terminate()
    warm = slice(args.requests // 10, None)
    print(
        f"P TP {args.p_tp} (a process per rank) → D TP 1, {args.requests} pushed loads × "
        f"{args.tokens} tokens over nixl: load median "
        f"{statistics.median(loads[warm]) * 1e3:.3f} ms, transfer stage "
        f"{statistics.median(transfers[warm]) * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
