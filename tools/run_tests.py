"""``make test``'s pytest, in two processes at once: the real-vLLM tier
(``tests/vllm_engines``: ~6.5 min alone here, most of it engines starting and timeouts
running out) in a second pytest while the first runs the rest of ``tests``; its report
follows the first one's. Measured on the 2-core VM, 2026-11-27: both together 12 min,
one after the other 14 min. ``KVBRIDGE_TESTS_SERIAL=1``: one pytest over ``tests``.

Takes no arguments (run pytest itself for a subset). Exit status: the first non-zero of
the two (pytest's 5, "no tests collected", is a failure too; killed by signal n: 128+n).
Each pytest runs in a session of its own, so an interrupt (Ctrl-C, SIGTERM) reaches each
exactly once, from here, and both close their engines and processes before the exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, NoReturn

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
VLLM = "tests/vllm_engines"
STOP_S = 120.0
"""How long an interrupted pytest may take to tear its fixtures down before it is killed."""


def _interrupted(*_: Any) -> NoReturn:
    raise KeyboardInterrupt


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(STOP_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):  # stuck, or a second interrupt
        proc.kill()
        proc.wait()


def main(argv: list[str]) -> int:
    if argv:
        print("tools/run_tests.py takes no arguments (run pytest for a subset)", file=sys.stderr)
        return 2
    if os.environ.get("KVBRIDGE_TESTS_SERIAL") == "1":
        return _status(subprocess.call([*PYTEST, "tests"]))
    signal.signal(signal.SIGTERM, _interrupted)
    with tempfile.TemporaryFile() as log:
        print(f"{VLLM} runs meanwhile in a second pytest; its report follows this one's")
        sys.stdout.flush()
        tier = subprocess.Popen(
            [*PYTEST, VLLM], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        rest = subprocess.Popen([*PYTEST, "tests", f"--ignore={VLLM}"], start_new_session=True)
        try:
            rest.wait()
            if tier.poll() is None:
                print(f"waiting for {VLLM} …", flush=True)
            tier.wait()
        finally:
            for proc in (rest, tier):
                _stop(proc)
            log.seek(0)
            print(f"\n==== {VLLM} ====", flush=True)
            sys.stdout.buffer.write(log.read())
            sys.stdout.flush()
    for name, proc in (("tests", rest), (VLLM, tier)):
        if proc.returncode != 0:
            print(f"pytest {name}: exit status {_status(proc.returncode)}", file=sys.stderr)
            return _status(proc.returncode)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
