"""Time D's handshake-time build of a :class:`~kvbridge.plan.geometry.Geometry` (who serves
what, bucket runs, links) for catalog models, TP pairs and layouts: median of
``--repeats`` builds per case, D rank 0, blocks of 16 on both sides.

    .venv/bin/python -m benchmarks.bench_geometry [--repeats 3]

To time another checkout (e.g. before a change), run this file with
``PYTHONPATH=<checkout>/src``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import ClassVar

from kvbridge.layout.side import SideConfig
from kvbridge.plan import dry_run
from kvbridge.plan.geometry import Geometry
from kvbridge.spec.load import load_model

CASES = [
    ("llama-3.1-8b", 1, 2, "nhd", "nhd"),
    ("jamba-1.5-mini", 1, 1, "nhd", "nhd"),
    ("jamba-1.5-mini", 2, 1, "nhd", "nhd"),
    ("jamba-1.5-mini", 1, 1, "hnd", "nhd"),
    ("jamba-1.5-mini", 2, 1, "hnd", "nhd"),
    ("qwen3-next-80b-a3b", 2, 1, "hnd", "nhd"),
    ("nemotron-3-nano-30b", 1, 2, "nhd", "hnd"),
    ("gemma-3-4b-it", 1, 1, "hnd", "nhd"),
]


class _Timed(Geometry):
    seconds: ClassVar[list[float]] = []

    def __init__(self, *args: object, **kw: object) -> None:
        t0 = time.perf_counter()
        super().__init__(*args, **kw)
        _Timed.seconds.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dry_run.Geometry = _Timed
    for name, p_tp, d_tp, p_lay, d_lay in CASES:
        info = load_model(name)
        p = SideConfig(tp=p_tp, block_size=16, layout=p_lay)
        d = SideConfig(tp=d_tp, block_size=16, layout=d_lay)
        ms = []
        for _ in range(args.repeats):
            _Timed.seconds.clear()
            dry_run.dry_run(info, p, d, 300, d_ranks=[0])
            ms.append(_Timed.seconds[0] * 1e3)
        lays = f"{p_lay.upper()}/{d_lay.upper()}"
        print(f"{name} {p_tp}->{d_tp} {lays}: {statistics.median(ms):.0f} ms", flush=True)


if __name__ == "__main__":
    main()
