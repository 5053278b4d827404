"""``make test``'s pytest, in two processes at once: the real-vLLM tier
(``tests/vllm_engines``: ~6.5 min alone here, most of it engines starting and timeouts
running out) in a second pytest while this one runs the rest of ``tests``; its report
follows the first one's. Measured on the 2-core VM, 2026-11-27: both together 12 min,
one after the other 14 min.

Arguments go to both pytest runs. Exit status: the first non-zero of the two (pytest's 5,
"no tests collected", is a failure too).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
VLLM = "tests/vllm_engines"


def main(argv: list[str]) -> int:
    with tempfile.TemporaryFile("w+") as log:
        print(f"{VLLM} runs meanwhile in a second pytest; its report follows this one's")
        sys.stdout.flush()
        vllm = subprocess.Popen([*PYTEST, VLLM, *argv], stdout=log, stderr=subprocess.STDOUT)
        try:
            rest = subprocess.call([*PYTEST, "tests", f"--ignore={VLLM}", *argv])
            tier = vllm.wait()
        finally:
            if vllm.poll() is None:  # interrupted: let pytest close its engines
                vllm.send_signal(signal.SIGINT)
                try:
                    vllm.wait(60)
                except subprocess.TimeoutExpired:
                    vllm.kill()
        log.seek(0)
        print(f"\n==== {VLLM} ====")
        print(log.read(), end="")
    for name, code in (("tests", rest), (VLLM, tier)):
        if code != 0:
            print(f"pytest {name}: exit status {code}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
