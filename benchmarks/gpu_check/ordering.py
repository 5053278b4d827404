"""The ordering case: P hands out a request's handle only after its engine's KV writes
completed (``ProducerWorker.written(event)``, ``kvbridge/connector/producer.py``).

P's ranks write a request's pattern late, as an engine whose KV kernels are still queued:
on the GPU a sleep kernel of :data:`DELAY_S` on a side stream, then the pattern's stores,
then an event; on the CPU a thread that writes once told (as ``tests/unit/test_ordering.py``
does). Then, in the connector phase of one case whose loads took the kernel mover:

    no wait          the handle goes out at once, D's consumer loads it (kernel mover):
                     D should hold P's old bytes (the hazard; none differing: a note)
    written(event)   each P rank calls ``worker.written(event)`` first: every byte must
                     match (a failure of the case otherwise)

then P waits for its late write and D compares every byte with the new pattern.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.gpu_check import messages as m
from benchmarks.gpu_check import pattern
from benchmarks.gpu_check.cases import Request

if TYPE_CHECKING:
    from benchmarks.gpu_check.driver import CaseRun
    from benchmarks.gpu_check.rank import RankState

DELAY_S = 0.3
"""GPU: how long the side stream sleeps before the KV stores (D's load takes ~10 ms)."""
TIMEOUT_S = 10.0
SLEEP_CHUNK = 1 << 30
"""Cycles per ``torch.cuda._sleep`` call."""
_RATE: list[float] = []
"""Sleep cycles per second on this process's GPU, measured once."""


# --- P's rank ----------------------------------------------------------------------------


class _Done:
    """``query()`` as ``torch.cuda.Event`` has it: whether the CPU thread's write ended."""

    def __init__(self) -> None:
        self.flag = threading.Event()

    def query(self) -> bool:
        return self.flag.is_set()


@dataclass
class Late:
    """A late KV write in flight; ``jobs`` keeps its tensors alive until it ended."""

    event: Any
    jobs: list[pattern.Job]
    start: threading.Event | None = None
    thread: threading.Thread | None = None
    stream: Any = None


def _cycles_per_s() -> float:
    if not _RATE:
        n = 20_000_000
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b)
        _RATE.append(n / (ms / 1e3) if ms > 0 else 2e9)
    return _RATE[0]


def _on_side_stream(jobs: list[pattern.Job], delay_s: float) -> tuple[Late, int]:
    """Queue: sleep ``delay_s``, the stores, an event, on a new stream that first waits
    for the current one (where the patterns were computed); the host does not wait."""
    cycles = int(delay_s * _cycles_per_s())
    side, event = torch.cuda.Stream(), torch.cuda.Event()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for lo in range(0, cycles, SLEEP_CHUNK):
            torch.cuda._sleep(min(SLEEP_CHUNK, cycles - lo))
        for target, ids, want in jobs:
            target[ids] = want
        event.record(side)
    return Late(event, jobs, stream=side), cycles


def _on_thread(jobs: list[pattern.Job]) -> Late:
    start, done = threading.Event(), _Done()

    def write() -> None:
        start.wait(TIMEOUT_S)
        for target, ids, want in jobs:
            target[ids] = want
        done.flag.set()

    thread = threading.Thread(target=write, name="late-kv-write", daemon=True)
    thread.start()
    return Late(done, jobs, start, thread)


def late_fill(st: RankState, cmd: m.LateFill) -> dict[str, object]:
    finish(st)
    req = cmd.request
    args = (st.spec, st.layout, st.pools.regions, req.p_tables, cmd.seed, st.words)
    jobs = list(pattern.fill_jobs(*args))
    t0 = time.monotonic()
    cycles = 0
    if st.setup.gpu:
        st.late, cycles = _on_side_stream(jobs, cmd.delay_s)
    else:
        st.late = _on_thread(jobs)
    queued = time.monotonic() - t0
    return {"queued_s": queued, "pending": not st.late.event.query(), "cycles": cycles}


def _late(st: RankState) -> Late:
    if st.late is None:
        raise RuntimeError("no late KV write in flight")
    return st.late


def written(st: RankState, cmd: m.Written) -> float:
    """The library's rule: ``worker.written(event)``; the seconds it waited."""
    late = _late(st)
    if late.start is not None:
        late.start.set()
    if st.worker is None:
        raise RuntimeError("P's producer worker is closed")
    t0 = time.monotonic()
    st.worker.written(late.event, timeout_s=cmd.timeout_s)
    return time.monotonic() - t0


def _end(late: Late, timeout_s: float) -> None:
    if late.start is not None:
        late.start.set()
    deadline = time.monotonic() + timeout_s
    while not late.event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the late KV write did not end within {timeout_s} s")
        time.sleep(0.001)
    if late.thread is not None:
        late.thread.join(timeout_s)


def late_join(st: RankState, cmd: m.LateJoin) -> bool:
    """Whether the late write was still running when this arrived; returns once it ended."""
    late = _late(st)
    pending = not late.event.query()
    _end(late, cmd.timeout_s)  # its tensors stay referenced (st.late) until it ended
    st.late = None
    return pending


def finish(st: RankState) -> None:
    """End a late write left in flight (a failed case, teardown)."""
    late, st.late = st.late, None
    if late is not None:
        _end(late, TIMEOUT_S)


# --- the driver ----------------------------------------------------------------------------


def _variant(cr: CaseRun, req: Request, wait: bool) -> dict[str, Any]:
    cr.check_budget()
    cr.seed += 1
    seed = cr.seed
    queued = cr.every("P", m.LateFill(req, seed, DELAY_S))
    waited = max(cr.every("P", m.Written(TIMEOUT_S))) if wait else 0.0
    try:
        load_s, ts = cr.go_load(req, seed)
    finally:
        pending = cr.every("P", m.LateJoin(TIMEOUT_S))
    bad, checked = cr.verify(req, seed, False)
    return {
        "variant": "written(event)" if wait else "no wait",
        "mismatches": bad,
        "checked": checked,
        "mover": ",".join(sorted({str(t.detail.get("mover")) for t in ts})),
        "load_ms": load_s * 1e3,
        "written_ms": waited * 1e3,
        "queued_ms": max(q["queued_s"] for q in queued) * 1e3,
        "pending_at_handle": all(q["pending"] for q in queued),
        "pending_after_load": any(pending),
        "sleep_cycles": max(q["cycles"] for q in queued),
    }


def run(cr: CaseRun) -> None:
    """Both variants on the case's first request; the result in ``cr.res.ordering``, a
    mismatch after ``written`` in ``cr.res.errors``."""
    res = cr.res
    movers = sorted({str(s.detail.get("mover")) for s in res.samples if s.method == "kvbridge"})
    where = "GPU: sleep kernel on a side stream" if cr.opts.gpu else "CPU: a thread"
    variants: list[dict[str, Any]] = []
    res.ordering = {"where": where, "delay_s": DELAY_S if cr.opts.gpu else None}
    res.ordering["variants"] = variants
    if movers != ["kernel"]:
        res.ordering["note"] = f"n/a: kvbridge's loads took {'/'.join(movers) or 'nothing'}"
        return
    req = cr.reqs[0]
    res.ordering["request"] = req.index
    for wait in (False, True):
        variants.append(_variant(cr, req, wait))
    late, rule = variants
    if late["mismatches"]:
        notes = [f"hazard reproduced: without written() D copied {late['mismatches']} stale words"]
    else:
        still = "still" if late["pending_after_load"] else "no longer"
        notes = [f"hazard not reproduced (the late write was {still} running after the load)"]
    if rule["mismatches"]:
        res.errors["ordering"] = (
            f"{rule['mismatches']} words differ although P called written(event) before the "
            f"handle went out (mover {rule['mover']})"
        )
    notes += [f"{v['variant']}: mover {v['mover']}" for v in variants if v["mover"] != "kernel"]
    res.ordering["note"] = "; ".join(notes)
