"""A vLLM OpenAI-compatible server with the kvbridge connector, as a child process group.

Used by the tests and ``make demo-vllm``; the same command line is what a user runs::

    python -m vllm.entrypoints.openai.api_server --model DIR --port 8100 \\
        --block-size 32 --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"secret": "..."}}'
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.vllm_harness import CONNECTOR, EngineError


@dataclass(frozen=True)
class ServerConfig:
    model: str
    port: int
    engine_id: str
    secret: str
    block_size: int = 128
    dtype: str = "float32"
    cpus: str = "0"
    tp: int = 1
    max_model_len: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)

    def argv(self) -> list[str]:
        kv = {
            **CONNECTOR,
            "kv_role": "kv_both",
            "engine_id": self.engine_id,
            "kv_connector_extra_config": {"secret": self.secret, **self.extra},
        }
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(self.block_size), "--dtype", self.dtype,
            "--tensor-parallel-size", str(self.tp), "--max-model-len", str(self.max_model_len),
            "--enforce-eager", "--seed", "0", "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "UCX_MODULES": "^ib",
            "VLLM_CPU_OMP_THREADS_BIND": self.cpus,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }


class Server:
    def __init__(self, cfg: ServerConfig, log: Path | None = None, timeout_s: float = 240.0):
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{cfg.port}"
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - kept for the child
        self.proc = subprocess.Popen(
            cfg.argv(), env=cfg.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(
                    f"vLLM server {self.cfg.engine_id} exited ({self.proc.returncode})"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(1.0)
        self.close()
        raise EngineError(f"vLLM server {self.cfg.engine_id} not healthy after {timeout_s} s")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
