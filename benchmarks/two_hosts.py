"""NIXL READ over TCP between two simulated hosts vs a plain socket copy of the same bytes.

P (namespace p) registers ``size`` bytes of random data and also serves them on a plain
TCP socket; D (namespace d) reads them with NIXL (runs of ``run`` bytes, block order
shuffled) and with ``recv_into`` from the socket, alternating A B A B so both see the
same load. UCX is forced onto TCP (``UCX_TLS=tcp``), as between machines, with
kvbridge's UCX defaults (:mod:`kvbridge.envs`); each setting given with ``--ucx``
(``NAME=VALUE,NAME=VALUE``, e.g. UCX's own ``UCX_TCP_TX_SEG_SIZE=8k,UCX_TCP_RX_SEG_SIZE=8k``)
is one more row. Every NIXL
read is checked byte for byte.

    python -m benchmarks.two_hosts [--size-mib 256] [--run-kib 64 2048] [--rounds 3]
        [--ucx UCX_TCP_TX_SEG_SIZE=64k,UCX_TCP_RX_SEG_SIZE=64k]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.jsonio import dumps
from refengine.netns import Hosts, enter, unavailable

PORT = 47111


def _p_main(conn: Connection, netns: str, addr: str, size: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    enter(netns)
    from kvbridge.transport.base import Region
    from kvbridge.transport.nixl import NixlTransport

    buf = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    with NixlTransport("P-bench") as t, socket.create_server((addr, PORT)) as srv:
        md = t.register([Region(buf.ctypes.data, buf.nbytes)])
        conn.send((md, buf.ctypes.data))
        srv.settimeout(0.05)
        while not conn.poll(0):
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            with c:
                c.sendall(buf.data)
        conn.recv()


def _d_main(conn: Connection, netns: str, args: dict[str, Any], env: dict[str, str]) -> None:
    os.environ.update(env)
    enter(netns)
    from kvbridge.transport.base import Region
    from kvbridge.transport.nixl import NixlTransport

    size, p_addr = args["size"], args["p_addr"]
    md, remote = conn.recv()
    want = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    buf = np.zeros(size, np.uint8)
    out: dict[str, list[float]] = {}
    with NixlTransport("D-bench") as t:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        peer = t.add_peer(md)
        for _ in range(args["rounds"]):
            for run in args["runs"]:
                n = size // run
                order = np.random.default_rng(run).permutation(n).astype(np.uint64) * run
                buf[:] = 0
                t0 = time.perf_counter()
                h = t.read(
                    peer, order + buf.ctypes.data, order + remote, np.full(n, run, np.uint64)
                )
                t.wait(h, 600)
                out.setdefault(f"nixl {run >> 10} KiB runs", []).append(time.perf_counter() - t0)
                assert np.array_equal(buf, want), "NIXL read wrong bytes"
            t0 = time.perf_counter()
            with socket.create_connection((p_addr, PORT)) as s:
                view, got = buf.data, 0
                while got < size:
                    k = s.recv_into(view[got:], size - got)
                    if k == 0:
                        raise RuntimeError("socket closed early")
                    got += k
            out.setdefault("socket copy", []).append(time.perf_counter() - t0)
    conn.send(out)


def run(size: int, runs: list[int], rounds: int, env: dict[str, str]) -> dict[str, float]:
    """GB/s (median over rounds) per method, for one UCX environment."""
    ctx = mp.get_context("spawn")
    with Hosts(subnet=78) as hosts:
        p_conn, p_child = ctx.Pipe()
        d_conn, d_child = ctx.Pipe()
        args = {"size": size, "p_addr": hosts.p_addr, "runs": runs, "rounds": rounds}
        p = ctx.Process(target=_p_main, args=(p_child, hosts.p, hosts.p_addr, size, env))
        d = ctx.Process(target=_d_main, args=(d_child, hosts.d, args, env))
        p.start()
        d.start()
        try:
            d_conn.send(p_conn.recv())
            times = d_conn.recv()
            p_conn.send("stop")
        finally:
            for proc in (d, p):
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    return {k: size / statistics.median(v) / 1e9 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--run-kib", type=int, nargs="+", default=[64, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ucx", action="append", default=[], help="NAME=VALUE,... (a row each)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(f"two-host bench skipped: {why}", file=sys.stderr)
        return 2
    base = {"UCX_TLS": "tcp"}
    rows = [("kvbridge defaults (UCX_TLS=tcp)", base)]
    for spec in a.ucx:
        extra = dict(kv.split("=", 1) for kv in spec.split(","))
        rows.append((spec, {**base, **extra}))
    report = {}
    for label, env in rows:
        gbps = run(a.size_mib << 20, [k << 10 for k in a.run_kib], a.rounds, env)
        report[label] = gbps
        sock = gbps.pop("socket copy")
        cells = "  ".join(f"{k}: {v:.2f} GB/s ({v / sock:.0%})" for k, v in gbps.items())
        print(f"{label:60s} socket copy {sock:.2f} GB/s  {cells}", flush=True)
        gbps["socket copy"] = sock
    if a.json:
        print(dumps(report, indent=None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
