"""Time the prompt digest a handle carries (:func:`kvbridge.connector.handle.prompt_digest`)
and the candidates it was chosen from, on one prompt of ``--tokens`` token ids.

Usage::

    .venv/bin/python -m benchmarks.bench_prompt_digest [--tokens 32768] [--repeat 7] [--inner 20]

Inputs: a Python list of ints (what vLLM's ``Request.prompt_token_ids`` is) and numpy
arrays of int32 and int64. Per row: the best, over ``--repeat`` rounds, of the median
of ``--inner`` calls, in microseconds. The ``to ...`` rows time the conversion alone
(reading a list costs more than hashing it).
"""

from __future__ import annotations

import argparse
import array
import hashlib
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvbridge.connector.handle import prompt_digest


def _us(f: Callable[[], object], repeat: int, inner: int) -> float:
    f()
    best = float("inf")
    for _ in range(repeat):
        times = []
        for _ in range(inner):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best * 1e6


def cases(n: int) -> dict[str, Callable[[], object]]:
    rng = np.random.default_rng(0)
    as64 = rng.integers(0, 151_936, n, dtype=np.int64)
    as32 = as64.astype(np.int32)
    ids = as64.tolist()
    d_ids = [*ids, 5]  # D's prompt: one token more than P prefilled
    return {
        "to int32 array.array (list)": lambda: array.array("i", ids),
        "to int32 numpy (list)": lambda: np.asarray(ids, dtype=np.int32),
        "to int64 numpy (list)": lambda: np.asarray(ids, dtype=np.int64),
        "sha256 of int32 bytes (ready)": lambda: hashlib.sha256(as32).digest(),
        "sha256 of int64 bytes (ready)": lambda: hashlib.sha256(as64).digest(),
        "blake2b-128 of int32 bytes (ready)": lambda: hashlib.blake2b(as32, digest_size=16),
        "blake2b-128 of int64 bytes (ready)": lambda: hashlib.blake2b(as64, digest_size=16),
        "blake2b-128 int64 (list)": lambda: hashlib.blake2b(
            np.asarray(ids, np.int64), digest_size=16
        ).digest(),
        "prompt_digest (list)": lambda: prompt_digest(ids, n),
        "prompt_digest (list of n+1, as D)": lambda: prompt_digest(d_ids, n),
        "prompt_digest (int32 array)": lambda: prompt_digest(as32, n),
        "prompt_digest (int64 array)": lambda: prompt_digest(as64, n),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20)
    args = ap.parse_args()
    print(f"{args.tokens} tokens; best of {args.repeat} medians of {args.inner} calls")
    for name, f in cases(args.tokens).items():
        print(f"  {name:38s} {_us(f, args.repeat, args.inner):8.1f} us")


if __name__ == "__main__":
    main()
