"""Throw N forged handles (distinct engine ids, P's real endpoint) and N handles naming a
dead endpoint at one D rank; print its cached peers and open file descriptors.

    .venv/bin/python tools/hostile_handles.py [N]
"""

from __future__ import annotations

import os
import socket
import sys
import time

import msgspec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.unit.test_connector_loopback import World


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main(n: int) -> None:
    w = World(timeout_s=0.2)
    try:
        c = w.consumers[0]
        handle, d_tabs = w.request("ok", 30)
        c.load(handle, d_tabs)
        assert w.wait()[0].ok
        print(f"before: peers {len(c.peers)}, fds {fds()}")
        t0 = time.monotonic()
        for i in range(n):
            c.load(msgspec.structs.replace(handle, request_id=f"x{i}", engine_id=f"e{i}"), d_tabs)
        outs = w.wait(n, timeout=600)
        print(
            f"{n} forged engine ids: {sum(o.ok for o in outs)} ok, peers {len(c.peers)}, "
            f"fds {fds()}, {time.monotonic() - t0:.1f} s"
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        m = min(n, 200)
        t0 = time.monotonic()
        for i in range(m):
            bad = msgspec.structs.replace(
                handle, request_id=f"d{i}", engine_id=f"d{i}", endpoint=dead
            )
            c.load(bad, d_tabs)
        outs = w.wait(m, timeout=600)
        print(
            f"{m} handles to a dead endpoint: {sum(o.ok for o in outs)} ok, peers {len(c.peers)}, "
            f"fds {fds()}, {time.monotonic() - t0:.1f} s"
        )
        handle, d_tabs = w.request("after", 30)
        c.load(handle, d_tabs)
        print("legitimate request after:", "ok" if w.wait()[0].ok else "FAILED")
    finally:
        w.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
