"""Planning without moving a byte: what D rank 0 of a TP-2 decode instance would read from
a TP-1 prefill instance of Qwen3-Next (attention + gated-delta state), per layout pair.

    python examples/plan_only.py

``Geometry`` is built once per (P instance, D rank) at handshake; ``plan()`` is the cheap
per-request step. Addresses here are made up: a plan is arithmetic on them.
"""

from __future__ import annotations

import numpy as np

from kvbridge.api import Bound, Geometry, Parallel, Side, build_layout, load_model


def bound(spec, par, rank, layout, blocks, base):  # type: ignore[no-untyped-def]
    lay = build_layout(spec, par, rank, layout, blocks)
    starts = base + np.cumsum([0, *lay.regions[:-1]])  # regions back to back from ``base``
    return Bound(lay, tuple(int(a) for a in starts))


def tables(spec, n_tokens, rng, blocks):  # type: ignore[no-untyped-def]
    """One list of block ids per group, in token order (a state group: one slot)."""
    ids = [int(x) for x in rng.permutation(blocks)]
    return [ids[:need] for need in spec.blocks_needed(n_tokens)]


def main() -> None:
    spec = load_model("qwen3-next-80b-a3b").spec
    p_par, d_par, n_tokens, blocks = Parallel(tp=1), Parallel(tp=2), 4096, 512
    rng = np.random.default_rng(0)
    print(f"{spec.name}: {len(spec.layers)} layers, groups {[g.name for g in spec.groups]}")
    for p_layout, d_layout in [("nhd", "nhd"), ("hnd", "hnd"), ("block-major", "hnd")]:
        p_spec, d_spec = spec.with_block_sizes(16), spec.with_block_sizes(32)
        p = bound(p_spec, p_par, 0, p_layout, blocks, 1 << 40)
        d = bound(d_spec, d_par, 0, d_layout, blocks, 1 << 44)
        geometry = Geometry(Side(p_spec, p_par, [p]), Side(d_spec, d_par, [d]), d_rank=0)
        p_tables, d_tables = (
            tables(p_spec, n_tokens, rng, blocks),
            tables(d_spec, n_tokens, rng, blocks),
        )
        plan = geometry.plan(n_tokens, p_tables, d_tables)
        kib = plan.nbytes / plan.descriptors / 1024
        print(
            f"P {p_layout:>11} → D {d_layout:>4}: {plan.nbytes / 2**20:8.1f} MiB in "
            f"{plan.descriptors:6d} descriptors ({kib:.1f} KiB each)"
        )


if __name__ == "__main__":
    main()
