"""``kvbridge bench vllm``: the kvbridge connector and vLLM's own ``NixlConnector`` side
by side, in the same vLLM, on the same tiny models (random real weights), same prompts,
same machine.

Per case (model, P and D block sizes and TP) four engines run at once: a P and a D with
each connector, P pinned to CPU 0 and D to CPU 1 for both. Then:

* **first**: one request through each pair first, timed on its own: it pays the
  connector's handshake with P. Reported whole (``first_ms``), as P's and D's calls
  (``first_p_ms``, ``first_d_ms``) and, for kvbridge, as the load's mover and stages
  (``first_stages_ms``: queue, handshake, lease, plan, post, transfer, verify).
* **output**: a batch of prompts goes P → D through each connector; D's greedy tokens are
  compared with a colocated run (the kvbridge D engine without a handle, its prefix cache
  reset after). ``match``, ``WRONG`` (tokens differ, no error), or ``refused`` (the
  request ended with an error or no tokens).
* **timing**: fresh prompts, one request at a time, the connectors alternating (A B A B)
  so load on the machine hits both alike. TTFT is P's prefill call plus D's call for the
  first token, as the caller sees them. Transfer figures come from each connector's own
  per-load stats on D (kvbridge: post + transfer stages; NixlConnector: NIXL's transfer
  telemetry), descriptors per request likewise.

NixlConnector's NIXL agent polls with no delay (the wrapper hard-codes it); its engines
get a ``sitecustomize`` that sets the same progress-thread delay kvbridge's agents use,
so an idle agent does not take a core from the other engines.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.nixl_delay import ENV as DELAY_ENV
from kvbridge import envs
from refengine.ranks import free_port
from tests.support.tiny_models import make_tiny_model
from tests.support.vllm_harness import (
    Engine,
    EngineConfig,
    EngineError,
    close_all,
    start_all,
)

SECRET = {"secret": "kvbridge-bench", "timeout_s": 10.0, "lease_s": 60.0}
NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
CONNECTORS = ("kvbridge", "nixl")
SIDE_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"

SITECUSTOMIZE = f"""import sys

sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})  # this checkout's benchmarks/

from benchmarks.nixl_delay import patch_from_env

patch_from_env()
"""


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    p_block: int
    d_block: int
    p_tp: int = 1
    d_tp: int = 1
    dtype: str = "float32"
    lengths: tuple[int, ...] = (200, 333, 512, 700)
    """Prompt lengths of the output check; timed prompts are ``timed_len`` tokens."""
    timed_len: int = 768
    engine_kw: dict[str, Any] = field(default_factory=dict)
    d_kw: dict[str, Any] = field(default_factory=dict)
    """Extra engine settings of D only (both connectors)."""
    one_by_one: bool = False
    """Reference run one prompt at a time (bf16 GDN: output depends on the prefill cut)."""


CASES = [
    Case("llama 128->128", "llama", 128, 128),
    Case("llama 32->32", "llama", 32, 32),
    Case("llama 32->128", "llama", 32, 128),
    Case("llama 128->32", "llama", 128, 32),
    Case("llama tp2->tp1", "llama", 64, 64, p_tp=2),
    Case("qwen3 128->128", "qwen3", 128, 128),
    Case("gemma3 128->128", "gemma3", 128, 128),
    Case("granite 128->128", "granite", 128, 128, engine_kw={"prefix_caching": False}),
    Case(
        "qwen3next 256->256",
        "qwen3next",
        256,
        256,
        dtype="bfloat16",
        lengths=(257,) * 4,
        engine_kw={"prefix_caching": False},
        d_kw={"max_num_batched_tokens": 256},
        one_by_one=True,
    ),
]
QUICK = ("llama 128->128", "llama 32->128", "llama 128->32")


def make_prompts(rng: random.Random, lengths: tuple[int, ...]) -> list[list[int]]:
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def engine_configs(
    case: Case, model: str, site: str
) -> dict[str, tuple[EngineConfig, EngineConfig]]:
    out = {}
    for conn in CONNECTORS:
        sides = []
        for role, block, tp, cpus in (
            ("p", case.p_block, case.p_tp, "0|1" if case.p_tp == 2 else "0"),
            ("d", case.d_block, case.d_tp, "1|0" if case.d_tp == 2 else "1"),
        ):
            kw: dict[str, Any] = dict(case.engine_kw, **(case.d_kw if role == "d" else {}))
            kw.update(model=model, tp=tp, block_size=block, dtype=case.dtype, cpus=cpus)
            if conn == "kvbridge":
                cfg = EngineConfig(engine_id=f"kvb-{role}", extra=dict(SECRET), **kw)
            else:
                env = {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    SIDE_PORT: str(free_port()),
                    "PYTHONPATH": os.pathsep.join(
                        filter(None, [site, os.environ.get("PYTHONPATH")])
                    ),
                    DELAY_ENV: str(envs.progress_delay_us()),
                }
                role_name = "kv_producer" if role == "p" else "kv_consumer"
                cfg = EngineConfig(
                    engine_id=f"nixl-{role}", connector=dict(NIXL), kv_role=role_name, env=env, **kw
                )
            sides.append(cfg)
        out[conn] = (sides[0], sides[1])
    return out


Pairs = dict[str, tuple[Engine, Engine]]
"""Connector name → its (P, D) engines."""


@contextmanager
def engines(
    cfgs: dict[str, tuple[EngineConfig, EngineConfig]], blocks: int | None = None
) -> Iterator[Pairs]:
    """Every engine of ``cfgs`` (with a pool of ``blocks`` if given), started two at a
    time; all closed (at once) on the way out, also when a start fails. A NixlConnector
    engine's side-channel port is chosen as it starts (:func:`refengine.ranks.free_port`)."""

    def start(cfg: EngineConfig) -> Engine:
        if SIDE_PORT in cfg.env:
            cfg = replace(cfg, env={**cfg.env, SIDE_PORT: str(free_port())})
        return Engine(replace(cfg, num_blocks=blocks) if blocks else cfg)

    started = start_all([cfg for pair in cfgs.values() for cfg in pair], start)
    try:
        yield {c: (started[2 * k], started[2 * k + 1]) for k, c in enumerate(cfgs)}
    finally:  # an engine takes seconds to shut down: all at once
        close_all(started)


# --- run in D's worker process (vLLM's collective_rpc) ----------------------------------
def install_recorder(worker: Any) -> bool:
    """Keep a copy of every stats object the connector hands to vLLM (vLLM drops them
    when stats logging is off, as in offline ``LLM``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    if hasattr(conn, "_bench_records"):
        return True
    records: list[dict[str, Any]] = []
    real = conn.get_kv_connector_stats

    def recorded() -> Any:
        stats = real()
        if stats is not None:
            records.append(
                {k: list(v) if isinstance(v, list) else v for k, v in stats.data.items()}
            )
        return stats

    conn.get_kv_connector_stats = recorded
    conn._bench_records = records
    return True


def take_records(worker: Any) -> list[dict[str, Any]]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    records = list(conn._bench_records)
    conn._bench_records.clear()
    return records


# --- reading the records ----------------------------------------------------------------
def transfers(connector: str, records: list[dict[str, Any]]) -> dict[str, float]:
    """Successful loads (NixlConnector: transfers, one per P rank), descriptors, bytes and
    transfer seconds in ``records`` (kvbridge: the loads are observations,
    :func:`kvbridge.adapter.observation`)."""
    if connector == "kvbridge":
        loads = [x for r in records for x in r.get("loads", []) if ("ok", 1) in x["loads"]]
        return {
            "loads": len(loads),
            "descriptors": sum(n for x in loads for (n,) in x["descriptors"]),
            "bytes": sum(n for x in loads for (n,) in x["transferred_bytes"]),
            "transfer_s": max((_post_transfer(x) for x in loads), default=0.0),
        }
    durations = [d for r in records for d in r.get("transfer_duration", [])]
    return {
        "loads": len(durations),
        "descriptors": sum(d for r in records for d in r.get("num_descriptors", [])),
        "bytes": sum(d for r in records for d in r.get("bytes_transferred", [])),
        "transfer_s": max(durations, default=0.0),
    }


def _post_transfer(load: dict[str, Any]) -> float:
    return sum(s for k, s in load["load_stage_seconds"] if k in ("post", "transfer"))


def first_load(records: list[dict[str, Any]]) -> dict[str, Any]:
    """kvbridge's first successful load in ``records``: its mover and stages in ms
    (empty if none)."""
    for x in (x for r in records for x in r.get("loads", []) if ("ok", 1) in x["loads"]):
        stages = {k: round(s * 1e3, 1) for k, s in x["load_stage_seconds"]}
        (mover,) = [m for m, _ in x["loads_by_mover"]] or ["?"]
        return {"first_mover": mover, "first_stages_ms": stages}
    return {}


def verdict_of(got: list[Any], ref: list[list[int]], loads: float) -> str:
    """``match``; ``WRONG`` (other tokens, no error); ``refused`` (no tokens or an error);
    ``recomputed`` (right tokens, but nothing was loaded: D prefilled the prompt itself
    after the connector failed, by vLLM's ``kv_load_failure_policy``)."""
    if any(o.finish_reason == "error" or not o.tokens for o in got):
        return "refused"
    if [o.tokens for o in got] != ref:
        return "WRONG"
    return "match" if loads else "recomputed"


def records(d: Engine) -> list[dict[str, Any]]:
    """The connector stats D's workers recorded since the last call (then forgotten)."""
    return [r for w in d.rpc(take_records) for r in w]


def verdicts(eng: Pairs, batch: list[list[int]], ref: list[list[int]]) -> dict[str, str]:
    """``batch`` P → D through each connector against ``ref``: :func:`verdict_of`'s words,
    or ``refused (...)`` when the engine call failed."""
    verdict = {}
    for conn in CONNECTORS:
        p, d = eng[conn]
        try:
            out, _, _ = run_pd(p, d, batch, 16)
            verdict[conn] = verdict_of(out, ref, transfers(conn, records(d))["loads"])
        except EngineError as e:
            verdict[conn] = f"refused ({e})"[:60]
    return verdict


def run_pd(
    p: Engine, d: Engine, batch: list[list[int]], new: int
) -> tuple[list[Any], float, float]:
    t0 = time.perf_counter()
    pre = p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    t1 = time.perf_counter()
    out = d.generate(batch, new, [o.kv_transfer_params for o in pre])
    return out, t1 - t0, time.perf_counter() - t1


def run_case(
    case: Case, models: Path, site: str, calls: int, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    model = str(make_tiny_model(case.model, models / case.model))
    rng = random.Random(zlib.crc32(case.name.encode()))
    t_start = time.perf_counter()
    with engines(engine_configs(case, model, site)) as eng:
        progress(f"{case.name}: 4 engines up in {time.perf_counter() - t_start:.0f} s")
        first: dict[str, dict[str, Any]] = {}
        for conn in CONNECTORS:  # the first request pays the handshake: timed apart
            p, d = eng[conn]
            d.rpc(install_recorder)
            (x,) = make_prompts(rng, (case.timed_len,))
            _, t_p, t_d = run_pd(p, d, [x], 1)
            first[conn] = {
                "first_ms": round((t_p + t_d) * 1e3),
                "first_p_ms": round(t_p * 1e3),
                "first_d_ms": round(t_d * 1e3),
            }
            if conn == "kvbridge":
                first[conn].update(first_load(records(d)))
            records(d)
        ref_engine = eng["kvbridge"][1]
        batch = make_prompts(rng, case.lengths)
        if case.one_by_one:
            ref = [ref_engine.generate([x], 16)[0].tokens for x in batch]
        else:
            ref = [o.tokens for o in ref_engine.generate(batch, 16)]
        ref_engine.reset_prefix_cache()
        verdict = verdicts(eng, batch, ref)
        timed: dict[str, list[dict[str, float]]] = {c: [] for c in CONNECTORS}
        for i in range(calls):
            (x,) = make_prompts(rng, (case.timed_len,))
            order = CONNECTORS if i % 2 == 0 else CONNECTORS[::-1]
            for conn in order:
                p, d = eng[conn]
                try:
                    out, t_p, t_d = run_pd(p, d, [x], 1)
                except EngineError:
                    continue
                row = transfers(conn, records(d))
                if out[0].tokens:
                    timed[conn].append(dict(row, ttft_s=t_p + t_d, d_s=t_d))
    rows = [summary_row(case.name, c, verdict[c], timed[c]) | first[c] for c in CONNECTORS]
    progress(
        f"{case.name}: "
        + "; ".join(f"{r['connector']} {r['output']} ttft {r['ttft_ms']} ms" for r in rows)
        + f" ({time.perf_counter() - t_start:.0f} s)"
    )
    return rows


def summary_row(
    case: str, conn: str, verdict: str, timed: list[dict[str, float]]
) -> dict[str, Any]:
    """Medians over the timed requests; transfer figures over those that loaded."""
    loaded = [r for r in timed if r["loads"]]

    def med(key: str, rows: list[dict[str, float]]) -> float:
        return statistics.median(r[key] for r in rows) if rows else float("nan")

    return {
        "case": case,
        "connector": conn,
        "output": verdict,
        "timed": len(timed),
        "loaded": len(loaded),
        "ttft_ms": round(med("ttft_s", timed) * 1e3, 1),
        "d_call_ms": round(med("d_s", timed) * 1e3, 1),
        "transfer_ms": round(med("transfer_s", loaded) * 1e3, 2),
        "descriptors": int(med("descriptors", loaded)) if loaded else 0,
        "KiB": round(med("bytes", loaded) / 1024) if loaded else 0,
    }


def run_all(
    quick: bool = False,
    calls: int | None = None,
    only: list[str] | None = None,
    progress: Callable[[str], None] = lambda s: None,
) -> list[dict[str, Any]]:
    os.environ.setdefault("UCX_MODULES", "^ib")
    names = only or ([c.name for c in CASES if c.name in QUICK] if quick else None)
    cases = [c for c in CASES if names is None or c.name in names]
    calls = calls or (4 if quick else 8)
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-vllm-") as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        models = Path(os.environ.get("KVBRIDGE_TINY_MODELS") or Path(tmp) / "models")
        rows = []
        for case in cases:
            rows += run_case(case, models, str(site), calls, progress)
    return rows
