"""The fused copy kernel's two forms side by side: the length at run time (generic) and
the length compiled in (fixed, :mod:`kvbridge.connector.movers.triton_copy`), on the shapes of
:mod:`benchmarks.bench_device_copies`, with a contiguous copy of the same bytes.

Usage::

    python -m benchmarks.bench_triton_forms [--device cuda] [--repeat 20] [--scale N]

On CUDA: GPU time per copy from CUDA events (median of ``--repeat`` after a warm-up),
the fixed form's compile time per length (Triton's on-disk cache makes later processes
faster), every copy's bytes checked. Without CUDA the kernels run in Triton's interpreter
on CPU tensors (run counts / 1024 by default): the bytes are checked, the times mean
nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.bench_copies import _ms as _host_ms
from benchmarks.bench_device_copies import SHAPES, Shape, _rows


def _gpu_ms(f: Callable[[], object], repeat: int) -> float:
    f()  # warm-up
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def line(shape: Shape, runs: int, dev: torch.device, repeat: int) -> str:
    from kvbridge.connector.movers import triton_copy, triton_kernels

    runs = -(-runs // shape.group) * shape.group  # whole groups: every row in the buffers
    gen = torch.Generator().manual_seed(shape.size + runs)
    row, nwords = shape.size // 8, 2 * runs * shape.size // 8
    s_w = (_rows(runs, shape.group, gen) * row).to(dev)
    d_w = (_rows(runs, shape.group, gen) * row).to(dev)
    src = torch.randint(-(2**62), 2**62, (nwords,), dtype=torch.int64, device=dev)
    dst = torch.zeros(nwords, dtype=torch.int64, device=dev)
    want = torch.zeros_like(dst)
    want.view(-1, row)[d_w // row] = src.view(-1, row)[s_w // row]
    grid, tile_runs, block = triton_copy.tiles(row, runs)
    t0 = time.perf_counter()
    triton_kernels.fixed.warmup(
        torch.int64, torch.int64, torch.int64, torch.int64, runs,
        ROW=row, RUNS=tile_runs, BLOCK=block, grid=grid,
    )  # fmt: skip
    compile_ms = (time.perf_counter() - t0) * 1e3
    forms = {
        "generic": lambda: triton_kernels.generic[grid](
            dst, d_w, src, s_w, runs, row, RUNS=tile_runs, BLOCK=block
        ),
        "fixed": lambda: triton_kernels.fixed[grid](
            dst, d_w, src, s_w, runs, ROW=row, RUNS=tile_runs, BLOCK=block
        ),
    }
    half = nwords // 2
    timer = _gpu_ms if dev.type == "cuda" else _host_ms
    ms, ok = {}, []
    for name, f in forms.items():
        dst.zero_()
        ms[name] = timer(f, repeat)
        ok.append(name if torch.equal(dst, want) else f"BAD {name}")
    contig = timer(lambda: dst[:half].copy_(src[:half]), repeat)
    verdict = "ok" if not any(o.startswith("BAD") for o in ok) else " ".join(ok)
    return (
        f"{shape.name:<21} {runs:>7d} {shape.size:>7d} {ms['generic']:>9.4f} "
        f"{ms['fixed']:>9.4f} {contig:>9.4f} {ms['fixed'] / ms['generic']:>7.2f} "
        f"{compile_ms:>9.1f}  {verdict}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--scale", type=int, default=0, help="divide run counts (0: 1024 on CPU)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":  # before the kernels are first imported
        os.environ["TRITON_INTERPRET"] = "1"
    scale = args.scale or (1024 if dev.type == "cpu" else 1)
    clock = "GPU ms (CUDA events)" if dev.type == "cuda" else "host ms (interpreter: no meaning)"
    print(f"device {dev}, run counts / {scale}, median of {args.repeat}, {clock}")
    print(
        "shape                    runs   run B   generic     fixed    contig  fix/gen"
        "  compile ms  bytes"
    )
    repeat = args.repeat if dev.type == "cuda" else min(args.repeat, 2)
    for shape in SHAPES:
        print(line(shape, max(1, shape.runs // scale), dev, repeat), flush=True)


if __name__ == "__main__":
    main()
