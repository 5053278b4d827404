"""An idle P with leases held, with and without a park, in real vLLM (llama 128 → 128,
engine cores in processes of their own as served): per P, its prefill calls, D's loads
from it, and the CPU its processes use while leases of handles no D loads are held.

    UCX_MODULES=^ib PYTHONPATH=.:src python -m benchmarks.vllm_idle

Parking: :mod:`kvbridge.integrations.vllm.park`; docs/vllm.md, "An idle P"."""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import vllm_bench as vb
from tests.support.tiny_models import make_tiny_model
from tests.support.vllm_harness import Engine, EngineConfig, close_all, cpu_seconds, start_all

PARK = 128
"""vLLM blocks of the parked P's park."""
ROUNDS = 8
IDLE_S = 4.0


def _load_ms(d: Engine) -> list[float]:
    """D's successful loads since the last call: each one's stages summed, in ms."""
    loads = [x for r in vb.records(d) for x in r.get("loads", []) if ("ok", 1) in x["loads"]]
    return [sum(s for _, s in x["load_stage_seconds"]) * 1e3 for x in loads]


def _idle(p: Engine, rng: random.Random) -> float:
    """Cores P's processes use over ``IDLE_S`` while 3 handles no D loads are held."""
    batch = vb.make_prompts(rng, (700, 500, 300))
    p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    time.sleep(2.0)  # vLLM's queue readers spin for 1 s after their last message
    assert p.proc.pid is not None
    t0, c0 = time.monotonic(), cpu_seconds(p.proc.pid)
    time.sleep(IDLE_S)
    return (cpu_seconds(p.proc.pid) - c0) / (time.monotonic() - t0)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model("llama", Path(tmp) / "llama"))
        kw: dict[str, Any] = {"model": model, "block_size": 128, "core_process": True}
        cfgs = [
            EngineConfig(
                engine_id="p-park", cpus="0", extra={**vb.SECRET, "park_blocks": PARK}, **kw
            ),
            EngineConfig(engine_id="p-held", cpus="0", extra=dict(vb.SECRET), **kw),
            EngineConfig(engine_id="d", cpus="1", extra=dict(vb.SECRET), **kw),
        ]
        engines = start_all(cfgs)
        try:
            run(*engines)
        finally:
            close_all(engines)


def run(parked: Engine, held: Engine, d: Engine) -> None:
    rng = random.Random(3)
    d.rpc(vb.install_recorder)
    for p in (parked, held):  # first request on each pair: the handshake
        vb.run_pd(p, d, vb.make_prompts(rng, (768,)), 1)
    _load_ms(d)
    p_ms: dict[str, list[float]] = {"p-park": [], "p-held": []}
    d_ms: dict[str, list[float]] = {"p-park": [], "p-held": []}
    for _ in range(ROUNDS):
        for p in (parked, held):
            _, t_p, _ = vb.run_pd(p, d, vb.make_prompts(rng, (768,)), 1)
            p_ms[p.cfg.engine_id].append(t_p * 1e3)
            d_ms[p.cfg.engine_id] += _load_ms(d)
    idle = {p.cfg.engine_id: _idle(p, rng) for p in (parked, held)}
    print(f"llama 128 -> 128, 768-token prompts, {ROUNDS} requests per P, alternating")
    print(f"{'P':<8} {'P call ms':>10} {'D load ms':>10} {'idle cores':>11}")
    for eid in ("p-park", "p-held"):
        med_p, med_d = statistics.median(p_ms[eid]), statistics.median(d_ms[eid])
        print(f"{eid:<8} {med_p:>10.1f} {med_d:>10.2f} {idle[eid]:>11.2f}")


if __name__ == "__main__":
    main()
