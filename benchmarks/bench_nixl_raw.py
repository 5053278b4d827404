"""Measure NIXL READ throughput and descriptor posting cost between two processes.

Usage::

    .venv/bin/python -m benchmarks.bench_nixl_raw [--mib 256] [--repeat 5] [--threads 2]
        [--ucx-threads 0,2]

An owner process (P) registers a ``--mib`` MiB buffer and keeps its agent progressing;
this process (D) READs all of it in shuffled runs of 4 KiB, 64 KiB and 1 MiB and in
one contiguous run, through :class:`kvbridge.transport.nixl.NixlTransport`
(``--threads N``: also the same runs cut into N parts, each posted and waited for by its
own thread, to see whether parallel posting moves more: NIXL copies inside the post
over cma and releases the GIL). Reported:
median GB/s (10^9 B/s) of ``read()`` + ``wait()``, and the host cost per descriptor of
posting without moving data: ``initialize_xfer`` from Nx3 arrays (the path the
transport uses) against ``prep_xfer_dlist`` on both sides + ``make_prepped_xfer``,
and ``make_prepped_xfer`` alone on lists prepared once; and the end-to-end cost of
``read()`` + ``wait()`` per 64-byte descriptor.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.transport.base import Region
from kvbridge.transport.nixl import NixlTransport

KIB = 1024
MIB = 1024 * KIB
Runs = tuple[np.ndarray, np.ndarray, np.ndarray]  # local, remote, nbytes (uint64)


def _owner(conn: Connection, nbytes: int) -> None:
    """P: register ``nbytes`` of random bytes, send metadata, wait for "stop"."""
    buf = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    with NixlTransport("bench-P", threads=0) as transport:  # P at NIXL's default
        conn.send((transport.register([Region(buf.ctypes.data, buf.nbytes)]), buf.ctypes.data))
        conn.recv()
    conn.close()


def _runs(base_l: int, base_r: int, total: int, run: int) -> Runs:
    """Shuffled ``run``-byte runs covering ``total`` bytes: (local, remote, nbytes)."""
    count = total // run
    src = np.random.default_rng(run).permutation(count).astype(np.uint64) * np.uint64(run)
    dst = np.arange(count, dtype=np.uint64) * np.uint64(run)
    return dst + np.uint64(base_l), src + np.uint64(base_r), np.full(count, run, np.uint64)


def _throughput(d: NixlTransport, runs: Runs, repeat: int) -> float:
    """Median GB/s of read + wait over ``repeat`` passes, after one warm-up pass."""
    seconds = []
    d.wait(d.read("bench-P", *runs), timeout_s=30.0)
    for _ in range(repeat):
        start = time.perf_counter()
        d.wait(d.read("bench-P", *runs), timeout_s=30.0)
        seconds.append(time.perf_counter() - start)
    return float(runs[2].sum()) / statistics.median(seconds) / 1e9


def _split(d: NixlTransport, runs: Runs, repeat: int, threads: int) -> float:
    """As :func:`_throughput`, the runs cut into ``threads`` parts posted in parallel."""
    parts = [tuple(a[i::threads] for a in runs) for i in range(threads)]

    def one(part: tuple[np.ndarray, ...]) -> None:
        d.wait(d.read("bench-P", *part), timeout_s=30.0)

    def all_parts() -> None:
        workers = [threading.Thread(target=one, args=(p,)) for p in parts[1:]]
        for w in workers:
            w.start()
        one(parts[0])
        for w in workers:
            w.join()

    all_parts()
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        all_parts()
        seconds.append(time.perf_counter() - start)
    return float(runs[2].sum()) / statistics.median(seconds) / 1e9


def _rows(addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    rows = np.zeros((addrs.shape[0], 3), np.uint64)
    rows[:, 0], rows[:, 1] = addrs, nbytes
    return rows


def _posting_cost(d: NixlTransport, runs: Runs, repeat: int) -> dict[str, float]:
    """Median µs per descriptor to create (not post) a request, three ways."""
    agent: Any = d._agent  # the raw nixl_agent, for the prepped-path comparison
    loc, rem = _rows(runs[0], runs[2]), _rows(runs[1], runs[2])
    idx = np.arange(loc.shape[0], dtype=np.int32)
    cost: dict[str, list[float]] = {"initialize_xfer": [], "prep+make": [], "make only": []}
    pre_l, pre_r = (
        agent.prep_xfer_dlist("", loc, "DRAM"),
        agent.prep_xfer_dlist("bench-P", rem, "DRAM"),
    )
    for _ in range(repeat):
        t0 = time.perf_counter()
        agent.initialize_xfer(
            "READ", agent.get_xfer_descs(loc, "DRAM"), agent.get_xfer_descs(rem, "DRAM"), "bench-P"
        ).release()
        t1 = time.perf_counter()
        side_l = agent.prep_xfer_dlist("", loc, "DRAM")
        side_r = agent.prep_xfer_dlist("bench-P", rem, "DRAM")
        agent.make_prepped_xfer("READ", side_l, idx, side_r, idx).release()
        t2 = time.perf_counter()
        agent.make_prepped_xfer("READ", pre_l, idx, pre_r, idx).release()
        t3 = time.perf_counter()
        side_l.release()
        side_r.release()
        for key, sec in zip(cost, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            cost[key].append(sec)
    pre_l.release()
    pre_r.release()
    return {k: statistics.median(v) / loc.shape[0] * 1e6 for k, v in cost.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per pass, MiB")
    parser.add_argument("--repeat", type=int, default=5, help="passes per figure")
    parser.add_argument("--threads", type=int, default=1, help="also post from N threads")
    parser.add_argument(
        "--ucx-threads",
        default="0",
        help="D's agent with each of these UCX worker thread counts in turn (e.g. 0,2,4)",
    )
    args = parser.parse_args()
    total = args.mib * MIB
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(child, total))
    owner.start()
    if not conn.poll(60):
        raise SystemExit("owner did not start within 60 s")
    metadata, remote = conn.recv()
    local = np.ones(total, np.uint8)  # touched: no page faults inside the timing
    for ucx in (int(x) for x in args.ucx_threads.split(",")):
        _reader(metadata, remote, local, ucx, args)
    conn.send("stop")
    owner.join(30)
    print(f"owner exit code {owner.exitcode}")


def _reader(
    metadata: bytes, remote: int, local: np.ndarray, ucx: int, args: argparse.Namespace
) -> None:
    """D's figures with an agent of ``ucx`` UCX worker threads."""
    total = local.nbytes
    with NixlTransport(f"bench-D-t{ucx}", threads=ucx) as d:
        d.register([Region(local.ctypes.data, local.nbytes)])
        d.add_peer(metadata)
        print(f"READ, 2 processes, {args.mib} MiB, median of {args.repeat}, D: {ucx} UCX threads")
        for run in (4 * KIB, 64 * KIB, 256 * KIB, MIB, total):
            runs = _runs(local.ctypes.data, remote, total, run)
            label = "contiguous" if run == total else f"{run // KIB} KiB shuffled"
            line = f"  {label:>18}: {_throughput(d, runs, args.repeat):6.2f} GB/s"
            if args.threads > 1 and run < total:
                split = _split(d, runs, args.repeat, args.threads)
                line += f", from {args.threads} threads {split:6.2f} GB/s"
            print(line)
        runs = _runs(local.ctypes.data, remote, 10_000 * 4 * KIB, 4 * KIB)
        for key, us in _posting_cost(d, runs, args.repeat).items():
            print(f"  create request, 10k shuffled 4 KiB descriptors, {key}: {us:.3f} µs/desc")
        tiny = _runs(local.ctypes.data, remote, 10_000 * 64, 64)
        per_desc = 64 / (_throughput(d, tiny, args.repeat) * 1e9) * 1e6
        print(f"  read() + wait(), 10k shuffled 64 B runs: {per_desc:.3f} µs/desc end to end")


if __name__ == "__main__":
    main()
