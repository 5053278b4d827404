"""Time :func:`kvbridge.connector.movers.device_copies.rows_copy` against one torch
``index_select`` + ``index_copy_`` of whole rows and a contiguous copy of the same bytes.

Usage::

    .venv/bin/python -m benchmarks.bench_device_copies [--device cuda] [--scale N] [--repeat 5]
        [--threads N]

Four shapes (runs × run bytes), each run read from and written to a buffer twice the
runs' bytes, in groups of consecutive runs at shuffled group positions (the two sides
shuffled independently). ``--scale`` divides the run counts: 16 by default on CPU (a
2-core VM runs the table in about 20 s), 1 on CUDA. Median milliseconds of ``--repeat``
copies after one warm-up, CUDA synchronised around each; every way's bytes are checked
against the expected buffer (all of it: bytes outside the runs must stay zero).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbridge.connector.movers import device_copies, triton_copy
from kvbridge.connector.movers.device_copies import rows_copy


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    runs: int
    size: int  # bytes per run
    group: int  # consecutive runs per group


SHAPES = (
    Shape("1 KiB, groups of 16", 65536, 1024, 16),
    Shape("32 KiB, shuffled", 32768, 32 << 10, 1),
    Shape("32 KiB, shuffled", 4096, 32 << 10, 1),
    Shape("256 B, groups of 16", 16384, 256, 16),
)


def _ms(f: Callable[[], object], dev: torch.device, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        _sync(dev)
        t0 = time.perf_counter()
        f()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rows(runs: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """Row indices (int64, CPU) of ``runs`` runs: groups of ``group`` consecutive rows at
    shuffled group positions among ``2 · runs`` rows."""
    groups = -(-runs // group)
    first = torch.randperm(2 * groups, generator=gen)[:groups] * group
    return (first[:, None] + torch.arange(group)).reshape(-1)[:runs]


def bench(shape: Shape, runs: int, dev: torch.device, repeat: int) -> str:
    """One table line: the three ways' times for ``runs`` runs of ``shape``."""
    gen = torch.Generator().manual_seed(shape.size + runs)
    size, nbytes = shape.size, 2 * runs * shape.size
    si = _rows(runs, shape.group, gen).to(dev)
    di = _rows(runs, shape.group, gen).to(dev)
    s_off, d_off = si * size, di * size
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    srows, drows = (
        src.view(torch.int64).view(-1, size // 8),
        dst.view(torch.int64).view(-1, size // 8),
    )
    want = torch.zeros_like(dst)
    want.view(torch.int64).view(-1, size // 8)[di] = srows[si]

    def index() -> None:
        drows.index_copy_(0, di, srows.index_select(0, si))

    def checked(f: Callable[[], None]) -> tuple[float, bool]:
        dst.zero_()
        t = _ms(f, dev, repeat)
        return t, bool(torch.equal(dst, want))

    t_rows, ok_rows = checked(lambda: rows_copy(dst, d_off, src, s_off, size))
    t_index, ok_index = checked(index)
    half = nbytes // 2
    t_flat = _ms(lambda: dst[:half].copy_(src[:half]), dev, repeat)
    ok = "ok" if ok_rows and ok_index else f"BAD rows_copy={ok_rows} index={ok_index}"
    return (
        f"{shape.name:<21} {runs:>7d} {size:>7d} {half >> 20:>6d} {t_rows:>10.3f} "
        f"{t_index:>9.3f} {t_flat:>9.3f} {t_rows / t_flat:>8.2f} {t_index / t_flat:>8.2f}  {ok}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", type=int, default=0, help="divide run counts (0: 16 on CPU)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    scale = args.scale or (16 if dev.type == "cpu" else 1)
    print(
        f"device {dev}, run counts / {scale}, median of {args.repeat} (ms), "
        f"{torch.get_num_threads()} CPU threads"
    )
    print(
        "shape                    runs   run B    MiB  rows_copy     index     contig"
        "  rows/ctg  idx/ctg  bytes"
    )
    for shape in SHAPES:
        print(bench(shape, max(1, shape.runs // scale), dev, args.repeat), flush=True)
    triton = dev.type == "cuda" and device_copies.triton_enabled()
    way = "fused Triton" if triton and not triton_copy.STATE.failed else "torch index"
    print(f"rows_copy moved words with: {way}")


if __name__ == "__main__":
    main()
