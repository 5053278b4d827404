"""P (TP 2, block 16, HND) → D (TP 1, block 32, NHD) for Llama-3.1-8B's KV shapes, in one
process, through kvbridge's public API only; every moved byte is checked at the end.

    python examples/p_to_d.py [--transport nixl|loopback] [--tokens N]

Over NIXL, set UCX_MODULES=^ib first (``make`` does). The README's "Using it from an
engine" shows the middle of this file; a test runs it and checks the README against it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvbridge.api import (
    Consumer,
    Outcome,
    Parallel,
    Producer,
    ProducerWorker,
    RankLayout,
    TransferHandle,
    View,
    build_layout,
    load_model,
    make_transport,
)

SECRET = b"shared by P and D"


def allocate(layout: RankLayout, rng: np.random.Generator) -> list[np.ndarray]:
    """The engine's KV memory: one buffer per region the layout asks for."""
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in layout.regions]


def token_bytes(v: View, buf: np.ndarray, table: list[int], bs: int, t: int, u: int) -> bytes:
    """The bytes of token ``t``, unit (KV head) ``u`` in view ``v`` (one segment)."""
    off = v.offset + table[t // bs] * v.block_stride + v.seg_offsets[0]
    off += (t % bs) * v.row_strides[0] + (u - v.seg_units[0][0]) * v.unit_strides[0]
    return bytes(buf[off : off + v.unit_bytes[0]])


def wait(consumer: Consumer, timeout_s: float = 30.0) -> Outcome:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for outcome in consumer.poll():
            return outcome
        time.sleep(0.001)
    raise TimeoutError("no outcome")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--tokens", type=int, default=100)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n_tokens, p_blocks, d_blocks = args.tokens, 16, 8

    spec = load_model("llama-3.1-8b").spec  # a name from the catalog, or a config.json path
    p_spec, d_spec = spec.with_block_sizes(16), spec.with_block_sizes(32)
    p_par, d_par = Parallel(tp=2), Parallel(tp=1)

    # P, per rank: describe and register the KV memory
    p_layouts = [build_layout(p_spec, p_par, rank, "hnd", p_blocks) for rank in range(2)]
    p_memory = [allocate(layout, rng) for layout in p_layouts]
    workers = [
        ProducerWorker(
            rank,
            p_layouts[rank],
            [int(b.ctypes.data) for b in p_memory[rank]],  # region addresses
            make_transport(args.transport, f"P{rank}"),
        )
        for rank in range(2)
    ]
    # P, scheduler: serve handshakes and leases; one handle per prefilled request
    producer = Producer("prefill-0", p_spec, p_par, SECRET, lease_s=30)
    for worker in workers:
        producer.add_rank(worker.info)
    p_tables = [[int(b) for b in rng.permutation(p_blocks)[: -(-n_tokens // 16)]]]  # per group
    handle = producer.prefill_done("req-1", p_tables, n_tokens)
    wire = handle.to_bytes()  # → router → D

    # D, per rank
    d_layout = build_layout(d_spec, d_par, 0, "nhd", d_blocks)
    d_memory = allocate(d_layout, rng)
    consumer = Consumer(
        "decode-0",
        d_spec,
        d_par,
        0,
        d_layout,
        [int(b.ctypes.data) for b in d_memory],
        make_transport(args.transport, "D0"),
        SECRET,
    )
    d_tables = [[int(b) for b in rng.permutation(d_blocks)[: -(-n_tokens // 32)]]]
    consumer.load(TransferHandle.from_bytes(wire), d_tables, 0)  # 0 tokens cached on D
    outcome = wait(consumer)  # ok, or failed (then: recompute those blocks)
    freed = producer.freed(wait_for=1)  # P may reuse these blocks (D confirms after its outcome)

    checked = check(p_layouts, p_memory, d_layout, d_memory, p_tables[0], d_tables[0], n_tokens)
    print(
        f"ok={outcome.ok} {outcome.bytes} bytes in {outcome.descriptors} descriptors, "
        f"{outcome.seconds * 1e3:.1f} ms; {checked} token-heads equal on P and D; "
        f"P freed {[f.request_id for f in freed]}"
    )
    consumer.close()
    for worker in workers:
        worker.close()
    producer.close()
    if not outcome.ok or checked == 0:
        raise SystemExit(1)


def check(
    p_layouts: list[RankLayout],
    p_memory: list[list[np.ndarray]],
    d_layout: RankLayout,
    d_memory: list[np.ndarray],
    p_table: list[int],
    d_table: list[int],
    n_tokens: int,
) -> int:
    """Every (layer, K/V, token, KV head) on D equals the P rank holding that head."""
    holders = {}
    for rank, layout in enumerate(p_layouts):
        for v in layout.views:
            a, b = v.seg_units[0]
            holders.update({(v.layer, v.stream, u): (rank, v) for u in range(a, b)})
    count = 0
    for dv in d_layout.views:
        d_buf = d_memory[dv.region]
        for u in range(*dv.seg_units[0]):
            rank, pv = holders[(dv.layer, dv.stream, u)]
            p_buf = p_memory[rank][pv.region]
            for t in range(n_tokens):
                got = token_bytes(dv, d_buf, d_table, 32, t, u)
                if got != token_bytes(pv, p_buf, p_table, 16, t, u):
                    raise AssertionError(f"layer {dv.layer} {dv.stream} token {t} head {u}")
                count += 1
    return count


if __name__ == "__main__":
    main()
