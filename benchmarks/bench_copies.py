"""Time the staged copies' two ways of moving many equal runs: strided views (one per
progression) against one gather-scatter, and what :func:`copy_equal` chooses.

Usage::

    .venv/bin/python -m benchmarks.bench_copies [--mib 8] [--repeat 15]

Per run size and progression length: ``--mib`` MiB of runs read from every other run of
a source buffer (a D rank's half of NHD token rows, as a staged 1→2 pull reads them) and
written as progressions of that many rows into shuffled blocks of a larger destination.
Median milliseconds of ``--repeat`` copies after one warm-up; the memcpy of the same
bytes for scale. The constants of :mod:`kvbridge.connector.movers.copies` come from this table.

Then one staged round of a per-layer NHD layout (64 regions, 9 blocks of 16 rows of
1 KiB in each, at random block ids): :meth:`LocalMemory.scatter` (one copy call for all
regions) against one :func:`copy_equal` call per region.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from unittest import mock

import numpy as np

from kvbridge.connector.movers import copies
from kvbridge.connector.movers.memory import LocalMemory
from kvbridge.transport.base import Region


def _ms(f: Callable[[], object], repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    nbytes = args.mib << 20
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 2 * nbytes + 4096, dtype=np.uint8)
    dst = np.zeros(10 * nbytes, np.uint8)
    memcpy = _ms(lambda: np.copyto(dst[:nbytes], src[:nbytes]), args.repeat)
    print(f"memcpy of {args.mib} MiB: {memcpy:.2f} ms")
    print("run B   rows/prog  runs     strided ms  gather ms  copy_equal ms  chooses")
    for size in (256, 1024, 4096):
        n = nbytes // size
        s_off = np.arange(n, dtype=np.int64) * 2 * size
        for rows in (16, 32, 64, 256):
            blocks = rng.permutation(dst.shape[0] // (rows * size))[: -(-n // rows)]
            idx = np.arange(n)
            d_off = (blocks[idx // rows] * rows * size + (idx % rows) * size).astype(np.int64)

            def copy(d_off: np.ndarray = d_off, s_off: np.ndarray = s_off, k: int = size) -> None:
                copies.copy_equal(dst, d_off, src, s_off, k)

            with mock.patch.object(copies, "VIEW_S", 1e-12):
                strided = _ms(copy, args.repeat)
            with mock.patch.object(copies, "VIEW_S", 1.0):
                gather = _ms(copy, args.repeat)
            chosen = _ms(copy, args.repeat)
            views = copies.progressions(d_off, s_off, size)
            way = "gather" if views is None else f"{views} views"
            print(
                f"{size:<7d} {rows:<10d} {n:<8d} {strided:<11.2f} {gather:<10.2f} "
                f"{chosen:<14.2f} {way}"
            )
    regions(args.repeat)


def regions(repeat: int) -> None:
    """One staged round over 64 per-layer regions: one call, or one per region."""
    rng = np.random.default_rng(1)
    count, blocks, block = 64, 640, 16 << 10
    page = 4096
    buf = np.zeros(count * blocks * block + page, np.uint8)
    buf.fill(1)
    base = -(-int(buf.ctypes.data) // page) * page
    mem = LocalMemory([Region(base + i * blocks * block, blocks * block) for i in range(count)])
    ids = rng.permutation(blocks)[:9]
    r, b, row = np.meshgrid(np.arange(count), np.arange(9), np.arange(16), indexing="ij")
    dst = (base + r * blocks * block + ids[b] * block + row * 1024).ravel().astype(np.int64)
    off = np.arange(dst.shape[0], dtype=np.int64) * 2048
    stage = rng.integers(0, 256, int(off[-1]) + 2048, dtype=np.uint8)
    length = np.full(dst.shape[0], 1024, np.int64)
    per = r.ravel()
    view = mem.span.tensor.numpy()  # the regions' bytes from ``base`` on

    def by_region() -> None:
        for i in range(count):
            k = per == i
            copies.copy_equal(view, dst[k] - base, stage, off[k], 1024)

    one = _ms(lambda: mem.scatter(dst, stage, off, length), repeat)
    each = _ms(by_region, repeat)
    print(f"staged round, 64 regions, {dst.shape[0]} runs of 1 KiB: one call {one:.2f} ms, "
          f"a call per region {each:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
