"""Per-request cost of the control path: P (Producer + one ProducerWorker) and D (one
Consumer) in one process over a transport, N requests one after another; prints the
median load time and its stages (queue, handshake, plan, lease, transfer, verify) and
P's lease bookkeeping per request. Meant to compare two versions of kvbridge on one
machine in one sitting (the script uses only API both have; where ``prefill_done`` /
``load`` take the prompt, it passes it, so the digest's cost is in the figures).

Usage: PYTHONPATH=src python -m benchmarks.bench_request_path [--requests N] [--tokens T]
       [--transport loopback|nixl]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

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
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    spec = load_model("llama-3.1-8b").spec.with_block_sizes(16)
    blocks = 4 * -(-args.tokens // 16)
    lay = build_layout(spec, Parallel(1), 0, "hnd", blocks)
    p_mem = [np.zeros(n, np.uint8) for n in lay.regions]
    d_mem = [np.zeros(n, np.uint8) for n in lay.regions]
    worker = ProducerWorker(
        0, lay, [int(b.ctypes.data) for b in p_mem], make_transport(args.transport, "P0")
    )
    producer = Producer("P", spec, Parallel(1), SECRET, lease_s=30)
    producer.add_rank(worker.info)
    consumer = Consumer(
        "D", spec, Parallel(1), 0, lay, [int(b.ctypes.data) for b in d_mem],
        make_transport(args.transport, "D0"), SECRET,
    )  # fmt: skip
    with_prompt = "prompt" in inspect.signature(producer.prefill_done).parameters
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
        end, out = time.monotonic() + 10, []
        while not out and time.monotonic() < end:
            out = consumer.poll()
            time.sleep(0.0002)
        assert out and out[0].ok, out
        seconds.append(out[0].seconds)
        for k, v in out[0].stages.items():
            stages.setdefault(k, []).append(v)
        producer.freed(wait_for=1, timeout_s=5.0)
    warm = slice(args.requests // 10, None)  # the first handshake and warm-up left out

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs[warm]) * 1e3:.3f}"

    first = {k: round(v[0] * 1e3, 3) for k, v in stages.items()}
    print(f"first request on the new pair: {seconds[0] * 1e3:.3f} ms; stages {first}")
    print(
        f"{args.requests} requests × {args.tokens} tokens over {args.transport}"
        f"{' (with prompt digests)' if with_prompt else ''}: load median {ms(seconds)} ms; "
        f"P prefill_done {ms(p_host)} ms; stages "
        + " ".join(f"{k}={ms(v)}" for k, v in stages.items())
    )
    consumer.close()
    worker.close()
    producer.close()


if __name__ == "__main__":
    main()
