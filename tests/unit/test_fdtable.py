"""The descriptor table is grown at engine start, so no request waits for it to grow.

Each check runs in a fresh interpreter (with a second thread, as an engine has): the
table of the test process has long grown."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, os, threading
from kvbridge.fdtable import reserve_fds
def table_size():
    # descriptor slots the kernel holds for this process
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("FDSize:"))
threading.Thread(target=threading.Event().wait, daemon=True).start()
def _open():
    out = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            out[int(n)] = os.fstat(int(n)).st_ino
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out
"""


def _run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reserve_grows_the_table_and_leaves_every_open_descriptor_alone():
    r = _run(
        """
        keep = [os.open(os.devnull, os.O_RDONLY) for _ in range(40)]
        before, size0 = _open(), table_size()
        reached = reserve_fds(1024)
        print(json.dumps({"before": before, "after": _open(), "size0": size0,
                          "size1": table_size(), "reached": reached}))
        """
    )
    highest = max(int(k) for k in r["before"])
    assert r["size0"] < highest + 1024  # there was growing to do
    assert highest + 1024 <= r["reached"] <= highest + 1025  # (+1: the listing's own)
    assert r["size1"] > r["reached"]
    assert r["after"] == r["before"]  # same descriptors, same files


def test_reserve_stays_within_the_soft_descriptor_limit():
    r = _run(
        """
        import resource
        highest = max(_open())
        soft = highest + 100
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        reached = reserve_fds(1024)
        fd = os.open(os.devnull, os.O_RDONLY)  # the process can still open files
        print(json.dumps({"soft": soft, "reached": reached, "fd": fd}))
        """
    )
    assert r["reached"] == r["soft"] - 1
    assert r["fd"] < r["soft"]


def test_a_consumer_and_a_producer_leave_room_for_a_request():
    r = _run(
        """
        from tests.unit.test_connector_loopback import World
        highest = max(_open())
        w = World()
        size = table_size()
        w.close()
        print(json.dumps({"highest": highest, "size": size}))
        """
    )
    assert r["size"] > r["highest"] + 1024
