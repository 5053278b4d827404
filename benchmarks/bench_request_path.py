"""Per-request cost of the control path: P (Producer + one ProducerWorker) and D (one
Consumer) in one process over a transport, N requests one after another; prints the
median load time and its stages (queue, handshake, plan, lease, transfer, verify) and
P's lease bookkeeping per request. Meant to compare two versions of kvbridge on one
machine in one sitting (the script uses only API both have; where ``prefill_done`` /
``load`` take the prompt, it passes it, so the digest's cost is in the figures).

``--p-process``: P in a process of its own (NIXL only), so that P answering D's calls
and D posting its transfers run at once, as on two hosts, not taking turns for one
interpreter.

Usage: PYTHONPATH=src python -m benchmarks.bench_request_path [--requests N] [--tokens T]
       [--transport loopback|nixl] [--p-process]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.api import (
    Consumer,
    Parallel,
    Producer,
    ProducerWorker,
    build_layout,
    load_model,
    make_transport,
)

SECRET = b"bench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--transport", default="loopback")
    ap.add_argument("--p-process", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    spec = load_model("llama-3.1-8b").spec.with_block_sizes(16)
    blocks = 4 * -(-args.tokens // 16)
    lay = build_layout(spec, Parallel(1), 0, "hnd", blocks)
    d_mem = [np.zeros(n, np.uint8) for n in lay.regions]
    if args.p_process:
        if args.transport != "nixl":
            ap.error("--p-process needs --transport nixl (loopback stays in one process)")
        here, there = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(
            target=_p_main, args=(there, args.tokens), daemon=True
        )
        child.start()
        there.close()  # a dead child: the parent's recv ends, not waits
        producer: Any = _Remote(here, child)
    else:
        producer = _P(args.transport, args.tokens)
    consumer = Consumer(
        "D", spec, Parallel(1), 0, lay, [int(b.ctypes.data) for b in d_mem],
        make_transport(args.transport, "D0"), SECRET,
    )  # fmt: skip
    try:
        with_prompt = "prompt" in inspect.signature(Producer.prefill_done).parameters
        need = -(-args.tokens // 16)
        seconds: list[float] = []
        stages: dict[str, list[float]] = {}
        p_host: list[float] = []
        for i in range(args.requests):
            prompt = rng.integers(0, 50_000, args.tokens + 1).tolist()
            p_tab = [[int(b) for b in rng.permutation(blocks)[:need]]]
            d_tab = [[int(b) for b in rng.permutation(blocks)[:need]]]
            t0 = time.perf_counter()
            kw = {"prompt": prompt[: args.tokens]} if with_prompt else {}
            handle = producer.prefill_done(f"r{i}", p_tab, args.tokens, **kw)
            p_host.append(time.perf_counter() - t0)
            consumer.load(handle, d_tab, 0, **({"prompt": prompt} if with_prompt else {}))
            got = outcome(consumer)
            seconds.append(got.seconds)
            for k, v in got.stages.items():
                stages.setdefault(k, []).append(v)
            producer.freed()
        warm = slice(args.requests // 10, None)  # the first handshake and warm-up left out

        def ms(xs: list[float]) -> str:
            return f"{statistics.median(xs[warm]) * 1e3:.3f}"

        first = {k: round(v[0] * 1e3, 3) for k, v in stages.items()}
        print(f"first request on the new pair: {seconds[0] * 1e3:.3f} ms; stages {first}")
        print(
            f"{args.requests} requests × {args.tokens} tokens over {args.transport}"
            f"{' (with prompt digests)' if with_prompt else ''}: load median {ms(seconds)} ms; "
            f"P prefill_done {ms(p_host)} ms{' (with the pipe to P)' if args.p_process else ''}; "
            "stages " + " ".join(f"{k}={ms(v)}" for k, v in stages.items())
        )
    finally:
        consumer.close()
        producer.close()


def outcome(consumer: Consumer, timeout_s: float = 10.0) -> Any:
    """The one load's outcome ``consumer`` was given, polled for; it must be a success."""
    end, out = time.monotonic() + timeout_s, []
    while not out and time.monotonic() < end:
        out = consumer.poll()
        time.sleep(0.0002)
    assert out and out[0].ok, out
    return out[0]


class _P:
    """P's Producer and its one rank's worker, over ``transport``."""

    def __init__(self, transport: str, tokens: int) -> None:
        spec = load_model("llama-3.1-8b").spec.with_block_sizes(16)
        lay = build_layout(spec, Parallel(1), 0, "hnd", 4 * -(-tokens // 16))
        self.mem = [np.zeros(n, np.uint8) for n in lay.regions]
        bases = [int(b.ctypes.data) for b in self.mem]
        self.worker = ProducerWorker(0, lay, bases, make_transport(transport, "P0"))
        self.producer = Producer("P", spec, Parallel(1), SECRET, lease_s=30)
        self.producer.add_rank(self.worker.info)
        self.prefill_done = self.producer.prefill_done

    def freed(self) -> None:
        self.producer.freed(wait_for=1, timeout_s=5.0)

    def close(self) -> None:
        self.worker.close()
        self.producer.close()


def _p_main(conn: Connection, tokens: int) -> None:
    """P in a process of its own: serves :class:`_Remote`'s calls over ``conn``."""
    p = _P("nixl", tokens)
    while (call := conn.recv()) is not None:
        name, a, kw = call
        conn.send(p.prefill_done(*a, **kw) if name == "prefill_done" else p.freed())
    p.close()


class _Remote:
    """:class:`_P` in another process, called over a pipe."""

    def __init__(self, conn: Connection, child: Any) -> None:
        self.conn, self.child = conn, child
        self.prefill_done = lambda *a, **kw: self._call("prefill_done", a, kw)

    def _call(self, name: str, a: tuple, kw: dict) -> Any:
        self.conn.send((name, a, kw))
        return self.conn.recv()

    def freed(self) -> None:
        self._call("freed", (), {})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.child.join(10)
        if self.child.is_alive():
            self.child.terminate()


if __name__ == "__main__":
    main()
