"""What growing the descriptor table costs a process with two threads, and what
:func:`kvbridge.fdtable.reserve_fds` at start leaves of it.

    PYTHONPATH=src python -m benchmarks.bench_fd_growth [--files 2100]

Opens ``--files`` descriptors one by one in a fresh process per variant and prints the
opens that took over 2 ms (the table grows at 256, 512, 1024, 2048 descriptors; each
growth waits for an RCU grace period while another thread shares the table)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time


def _opens(files: int, reserve: bool) -> None:
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # files shared
    if reserve:
        from kvbridge.fdtable import reserve_fds

        reserve_fds(files)
    slow, fds = [], []
    for _ in range(files):
        t = time.perf_counter()
        fds.append(os.open(os.devnull, os.O_RDONLY))
        if (dt := time.perf_counter() - t) > 0.002:
            slow.append(f"fd {fds[-1]}: {dt * 1e3:.1f} ms")
    label = "after reserve_fds" if reserve else "no reserve      "
    print(f"{label}  opens over 2 ms: {', '.join(slow) or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2100)
    ap.add_argument("--child", choices=["plain", "reserve"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _opens(args.files, args.child == "reserve")
        return
    for variant in ("plain", "reserve", "plain", "reserve"):
        cmd = [sys.executable, "-m", "benchmarks.bench_fd_growth", "--files", str(args.files)]
        subprocess.run([*cmd, "--child", variant], check=True)


if __name__ == "__main__":
    main()
