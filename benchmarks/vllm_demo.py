"""``make demo-vllm``: two real vLLM OpenAI servers (P, block 32; D, block 128) with the
kvbridge connector, ``kvbridge proxy`` in front, a few requests through the official
``openai`` client, each compared with the colocated answer of the same model; then D's
``vllm:kvbridge_*`` metrics. Exits 1 on any mismatch.

    python -m benchmarks.vllm_demo [--workdir DIR] [--keep]

Without ``--workdir`` the model and logs go to a temporary folder, removed after a
successful run (or Ctrl-C) unless ``--keep`` is given, and kept, with its logs, when the
run fails. A ``--workdir`` is never removed.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.support.tiny_models import make_tiny_model
from tests.support.vllm_server import Server, ServerConfig

PROMPTS = [
    "the kv cache moves from prefill to decode " * 12,
    "disaggregated serving splits prefill and decode",
    "ab cd ef gh ij kl mn op qr st uv wx yz " * 20,
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"demo: {url} did not answer in {timeout_s} s")


def run_in(given: Path | None, keep: bool, run: Callable[[Path], int]) -> int:
    """``run(folder)``'s exit code, in ``given`` (left in place) or a new temporary
    folder, removed when ``run`` returns 0 (or on Ctrl-C) unless ``keep``; kept, and
    said so, when ``run`` raises or returns non-zero, so its logs can be read."""
    if given is not None:
        return run(given)
    work = Path(tempfile.mkdtemp(prefix="kvbridge-demo-"))
    failed = True
    try:
        rc = run(work)
        failed = rc != 0
        return rc
    except KeyboardInterrupt:
        failed = False
        raise
    finally:
        if keep or failed:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None, help="model and logs (default: temp)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder at the end")
    args = ap.parse_args(argv)
    return run_in(args.workdir, args.keep, _run)


def _run(work: Path) -> int:
    import openai

    model = str(make_tiny_model("llama", work / "llama"))
    print(f"model {model} (tiny llama, random real weights); logs in {work}", flush=True)
    servers: list[Server] = []
    proxy = None
    try:
        t0 = time.monotonic()
        servers.append(
            Server(ServerConfig(model, _port(), "demo-p", "demo", 32, cpus="0"), work / "p.log")
        )
        servers.append(
            Server(ServerConfig(model, _port(), "demo-d", "demo", 128, cpus="1"), work / "d.log")
        )
        p, d = servers
        print(f"P {p.url} (block 32) and D {d.url} (block 128) up in {time.monotonic() - t0:.0f} s")
        port = _port()
        cmd = [sys.executable, "-m", "kvbridge.cli.main", "proxy", "--prefill", p.url,
               "--decode", d.url, "--port", str(port)]  # fmt: skip
        with open(work / "proxy.log", "wb") as log:
            proxy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"
        _wait(url + "/metrics")
        print(f"proxy {url}: {' '.join(cmd[2:])}\n")
        direct = openai.OpenAI(base_url=p.url + "/v1", api_key="none")
        via = openai.OpenAI(base_url=url + "/v1", api_key="none")
        bad = 0
        for prompt in PROMPTS:
            kw = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            want = direct.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
            t = time.perf_counter()
            got = via.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
            ms = (time.perf_counter() - t) * 1e3
            same = got == want
            bad += not same
            print(
                f"{len(prompt):5d} chars  P/D {ms:7.1f} ms  "
                f"equal to colocated: {same}  {got[:40]!r}"
            )
        with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
            lines = [ln for ln in r.read().decode().splitlines() if ln.startswith("vllm:kvbridge_")]
        print("\nD's kvbridge metrics:")
        for ln in lines:
            if any(k in ln for k in ("_total{", "load_seconds_sum", "load_seconds_count")):
                print("  " + ln)
        print("\nall outputs equal" if not bad else f"\n{bad} outputs differ")
        return 1 if bad else 0
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for s in reversed(servers):
            s.close()


if __name__ == "__main__":
    sys.exit(main())
