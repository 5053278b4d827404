"""``make test``'s pytest: ``tests/unit`` and the rest of ``tests`` as two pytest processes
at once. Alone, the unit tests keep about two thirds of one core busy and the rest mostly
waits on engines, processes and deadlines: side by side the suite took 690 s on the
2-core VM where one after the other took 942 s (the same commit, one run each).

The rest's output streams as it runs; the unit tests' comes whole when both have ended
(the two never interleave). Exits 0 only if both exited 0: a failure, an error or no test
collected (pytest's exit 5) in either fails the run: options given here go to both, so
a ``-k`` that selects nothing in one of them fails it.

Usage: python tools/run_tests.py [pytest options given to both]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as unit_log:
        unit = subprocess.Popen(
            [*PYTEST, *argv, "tests/unit"], stdout=unit_log, stderr=subprocess.STDOUT
        )
        try:
            print("tests/unit runs beside the rest; its output follows the rest's", flush=True)
            rest = subprocess.call([*PYTEST, *argv, "tests", "--ignore=tests/unit"])
        finally:  # an interrupt too: what the unit tests said is shown
            unit_rc = unit.wait()
            unit_log.seek(0)
            print(f"\n--- tests/unit ---\n{unit_log.read()}", flush=True)
    took = time.monotonic() - t0
    print(f"tests/unit: exit {unit_rc}; the rest: exit {rest}; {took:.0f} s in all")
    return 0 if unit_rc == rest == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
