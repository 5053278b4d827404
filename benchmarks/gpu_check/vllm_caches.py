"""gpu-check's vLLM-caches phase: P and D caches allocated as vLLM 0.32 allocates them
(``vllm_alloc``: its strides, offsets, padded pages, kernel blocks, aliased groups) on the
GPU (``--cpu``: CPU tensors standing in for device memory, ``KVBRIDGE_DEVICE_ON_CPU=1``),
one request moved P → D through the vLLM connector's worker-side code, every byte of D's
allocation compared with an expectation made through vLLM's views (``vllm_expect``); each
case twice: from vLLM's blocks, and parked (P's ``park_blocks``: the request copied into
P's park, vLLM's blocks then reused, D loading from the park).

vLLM is not imported (the GPU machine has none; here it is blocked in this process). What
runs of ``kvbridge.integrations.vllm`` is what imports without it: ``read_cache`` (the spec
from the cache groups), ``placement.place`` (on CUDA tensors; on CPU tensors it would ask
vLLM for the attention backend, so its GPU branch, ``gpu_rank_layout``, is called with the
arguments ``place`` gives it), ``VllmCache.tables``, ``table_splits`` and
``kernel_tables``. ``worker.WorkerSide`` and ``scheduler.SchedulerSide`` import vLLM's
connector base classes (``metadata.py``), so their bodies are driven by hand: the
:class:`ProducerWorker` and :class:`Consumer` ``WorkerSide.register`` makes, P's
``written()`` (``wait_for_save``), the :class:`Producer` and handle ``SchedulerSide`` makes,
D's ``kernel_tables`` (``WorkerSide._load``). Transport: loopback, in this process.

    python -m benchmarks.gpu_check.vllm_caches [--cpu] [--only TEXT]

Exit status: 0 every case byte-exact, 1 a mismatch or a failed load, 2 no GPU without --cpu.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import msgspec
import numpy as np
import torch

from benchmarks.gpu_check.vllm_alloc import allocate
from benchmarks.gpu_check.vllm_cases import ATTENTION, CASES, Case, SideCfg
from benchmarks.gpu_check.vllm_expect import expect, mirror, storage

NB = 8
"""vLLM blocks per engine (block 0 is vLLM's null block: never a request's)."""
TOKENS = 45
"""Tokens P prefilled: two blocks of 32, the last one partial."""
SECRET = b"vllm-caches"


def block_vllm() -> None:
    """Make ``import vllm`` fail in this process, as on the GPU machine."""
    if "vllm" not in sys.modules:
        sys.modules["vllm"] = None  # type: ignore[assignment]


@dataclass
class Engine:
    """One engine's ranks: vLLM's views per rank, their vLLM specs, the connector's
    ``VllmCache`` and each rank's :class:`Placement`."""

    side: SideCfg
    caches: list[dict[str, torch.Tensor]]
    specs: dict[str, Any]
    cache: Any
    placed: list[Any]


def vllm_config(case: Case, side: SideCfg) -> Any:
    """What ``read_cache`` and ``place`` read of a ``VllmConfig`` (without PP)."""
    heads = 2 if case.hybrid else ATTENTION[case.kind][0]
    name = SimpleNamespace(name=side.layout)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=side.tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads, served_model_name="m"),
        cache_config=SimpleNamespace(
            mamba_cache_mode="none", get_resolved_kv_cache_layout=lambda: name
        ),
    )


def placement(vc: Any, cache: Any, rank: int, caches: dict[str, torch.Tensor]) -> Any:
    """``place`` on CUDA tensors; on CPU tensors its GPU branch, as ``place`` calls it."""
    from kvbridge.api import MemKind
    from kvbridge.integrations.vllm.gpu_layout import gpu_rank_layout
    from kvbridge.integrations.vllm.placement import layout_name, place

    if next(iter(caches.values())).is_cuda:
        return place(vc, cache, rank, caches)
    return gpu_rank_layout(cache, rank, caches, layout_name(vc), MemKind.DEVICE)


def engine(case: Case, side: SideCfg, device: torch.device, seed: int) -> Engine:
    """An engine's ranks, every byte of each allocation random."""
    from kvbridge.integrations.vllm import cache as cache_module

    groups = case.groups(side)
    made = [allocate(groups, side.layout, NB, device, side.kernel) for _ in range(side.tp)]
    gen = torch.Generator().manual_seed(seed)
    ranks = [c for c, _ in made]
    for views in ranks:
        raw = storage(next(iter(views.values())))
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    vc = vllm_config(case, side)
    # read_cache asks vLLM's is_conv_state_dim_first() (VLLM_SSM_CONV_STATE_LAYOUT): the
    # side's conv orientation answers instead
    with mock.patch.object(cache_module, "conv_dim_first", lambda: side.conv == "DS"):
        cache = cache_module.read_cache(vc, made[0][1])
    placed = [placement(vc, cache, r, c) for r, c in enumerate(ranks)]
    specs = {n: g.kv_cache_spec for g in groups for n in g.layer_names}
    return Engine(side, ranks, specs, cache, placed)


def request_blocks(case: Case, rng: np.random.Generator) -> tuple[int, list[int]]:
    """A request's state slot (hybrids; else -1) and vLLM blocks, from one pool."""
    ids = [int(x) for x in rng.permutation(np.arange(1, NB))[: 1 + -(-TOKENS // case.block)]]
    return (ids[0], ids[1:]) if case.hybrid else (-1, ids[1:])


def block_ids(case: Case, slot: int, ids: list[int]) -> tuple[list[int], ...]:
    """vLLM's per-group block ids of the request (hybrids: the Mamba group's first)."""
    return ([slot], ids) if case.hybrid else (ids,)


@dataclass
class Result:
    """One case's verdict: ``checked`` bytes of D compared, ``mismatched`` of them wrong."""

    label: str
    ok: bool
    checked: int
    mismatched: int
    movers: list[str]
    seconds: float
    error: str = ""
    memory: str = ""
    """How P's and D's ranks registered their caches (``device``: as on a GPU)."""


def run_case(
    case: Case,
    device: torch.device,
    tamper: Callable[[Engine, list[int]], None] | None = None,
    park: bool = False,
) -> Result:
    """One request P → D; ``tamper`` (a control) changes D after the load (given D's
    engine and the request's vLLM blocks there); ``park``: P parks the request first
    (:func:`parked`) and D loads from the park."""
    t0, rng = time.perf_counter(), np.random.default_rng(7)
    label = f"{case.label}, parked" if park else case.label
    p, d = engine(case, case.p, device, 1), engine(case, case.d, device, 2)
    (sp, pids), (sd, dids) = request_blocks(case, rng), request_blocks(case, rng)
    if case.kind == "mla":  # a replicated latent: every P rank computed the same bytes
        for r in range(1, case.p.tp):
            storage(next(iter(p.caches[r].values()))).copy_(
                storage(next(iter(p.caches[0].values())))
            )
    tail = range(TOKENS, len(pids) * case.block)  # the last block's tail: P's on D too
    ds = (case.p.conv == "DS", case.d.conv == "DS")
    expect(p.caches, d.caches, (p.specs, d.specs), (pids, dids), (sp, sd), ds, case.block, tail)
    wants = [storage(next(iter(c.values()))).clone() for c in d.caches]
    views = [mirror(c, w) for c, w in zip(d.caches, wants, strict=True)]
    expect(
        p.caches, views, (p.specs, d.specs), (pids, dids), (sp, sd), ds, case.block, range(TOKENS)
    )
    try:
        movers = move(p, d, (block_ids(case, sp, pids), block_ids(case, sd, dids)), park)
    except Exception as e:  # a failed load fails the case, with why
        return Result(label, False, 0, 0, [], time.perf_counter() - t0, repr(e))
    if tamper is not None:
        tamper(d, dids)
    got = [storage(next(iter(c.values()))) for c in d.caches]
    bad = sum(int((g != w).sum()) for g, w in zip(got, wants, strict=True))
    checked = sum(w.numel() for w in wants)
    kinds = {pl.memory.value for e in (p, d) for pl in e.placed}
    dt = time.perf_counter() - t0
    return Result(label, bad == 0, checked, bad, movers, dt, memory=",".join(sorted(kinds)))


def parked(p: Engine, blocks: tuple[list[int], ...]) -> tuple[list[Any], list[list[int]]]:
    """P's ranks park the request's ``blocks`` (vLLM's, per group) as the worker does in
    ``wait_for_save`` (:class:`~kvbridge.integrations.vllm.park.Park`, slots from the
    top of a park of ``NB`` blocks), then vLLM reuses the blocks (scrambled here); the
    parks and the request's park slots."""
    from kvbridge.integrations.vllm.park import Order, Park

    slots, free = [], list(range(NB - 1, 0, -1))
    for tab in blocks:
        slots.append([free.pop(0) if b else 0 for b in tab])
    parks = []
    for pl in p.placed:
        parks.append(Park(pl, NB))
        parks[-1].copy([Order("r", list(blocks), slots)])
        for raw in parks[-1].src:  # the blocks vLLM freed, written by other requests
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8).to(raw.device))
    return parks, slots


def move(
    p: Engine, d: Engine, tables: tuple[tuple[list[int], ...], ...], park: bool = False
) -> list[str]:
    """P's ranks registered and its writes waited for (``wait_for_save``), P's handle of
    the request (``park``: of its parked copy), each D rank's load; the movers D's ranks
    took."""
    from kvbridge.api import Consumer, Producer, ProducerWorker, RankInfo, make_transport
    from kvbridge.integrations.vllm.gpu_layout import kernel_tables, table_splits

    producers, consumers, transports = [], [], []
    producer = Producer("P", p.cache.spec, p.cache.par, SECRET, model_id="m")
    try:
        parks, p_ids = parked(p, tables[0]) if park else ([], list(tables[0]))
        for r, pl in enumerate(p.placed):
            transports.append(make_transport("loopback", f"vc-p{r}-{os.getpid()}"))
            lay, bases = (parks[r].layout, parks[r].bases) if park else (pl.layout, pl.bases)
            w = ProducerWorker(r, lay, bases, transports[-1], memory=pl.memory, device=pl.device)
            producers.append(w)
            w.written()  # wait_for_save: the step's KV writes (here: the random fill)
            info = msgspec.msgpack.decode(msgspec.msgpack.encode(w.info), type=RankInfo)
            producer.add_rank(info)
        splits = table_splits(p.cache.spec, producer.ranks[0].block_sizes)
        p_tabs = kernel_tables(p.cache.tables(p_ids, TOKENS, NB), splits)
        handle = producer.prefill_done("req", p_tabs, TOKENS)
        for r, pl in enumerate(d.placed):
            transports.append(make_transport("loopback", f"vc-d{r}-{os.getpid()}"))
            args = (pl.spec, d.cache.par, r, pl.layout, pl.bases, transports[-1], SECRET)
            c = Consumer(
                "D", *args, model_id="m", pad_blocks=True, memory=pl.memory, device=pl.device
            )
            consumers.append(c)
            c.load(handle, kernel_tables(d.cache.tables(tables[1], TOKENS), pl.splits), 0)
        return [_outcome(c) for c in consumers]
    finally:
        closing: list[Any] = [*consumers, *producers, producer, *transports]
        for x in closing:
            x.close()


def _outcome(c: Any, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in c.poll():
            if not out.ok:
                raise RuntimeError(f"load failed: {out.error}")
            return str(out.mover)
        time.sleep(0.002)
    raise TimeoutError(f"no outcome after {timeout_s} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.vllm_caches")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors standing in for the GPU")
    ap.add_argument("--only", default="", help="cases whose label contains this")
    args = ap.parse_args(argv)
    block_vllm()
    if args.cpu:
        os.environ["KVBRIDGE_DEVICE_ON_CPU"] = "1"
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        print("vllm-caches: no GPU (use --cpu)", file=sys.stderr)
        return 2
    t0, failed = time.perf_counter(), 0
    print(f"vllm-caches on {device}: vLLM importable: {_importable()}")
    for case, park in ((c, k) for c in CASES for k in (False, True) if args.only in c.label):
        out = run_case(case, device, park=park)
        failed += not out.ok
        verdict = (
            "byte-exact" if out.ok else f"FAILED {out.error or f'{out.mismatched} bytes differ'}"
        )
        print(
            f"  {out.label:<44} {verdict}: {out.checked} bytes of D checked, "
            f"{out.memory or '-'} memory, movers {','.join(out.movers) or '-'}, "
            f"{out.seconds * 1e3:.0f} ms"
        )
    print(f"vllm-caches: {failed} failed, {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


def _importable() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "no"
    return "yes"


if __name__ == "__main__":
    sys.exit(main())
