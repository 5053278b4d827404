"""The fused Triton kernels behind :mod:`kvbridge.connector.movers.device_copies`: runs of
``row`` words, a program per tile of runs; ``runs`` (an offset per run and side,
:func:`copy`) and ``grid`` (a plan's :class:`~kvbridge.plan.runs.Grid`, the kernel making
each run's offsets, :func:`grid`).

Each kind has two compiled forms of one body (``docs/gpu.md``, "The copy kernel in two
forms"): the generic form takes ``row`` at run time; the fixed form has it as a constant,
compiled on a thread of its own for a (kind, length, word type, device) seen in
:data:`SPECIALISE_AFTER` copies of at least :data:`SPECIALISE_MIN_WORDS` words with 16-B
aligned pointers, at most :data:`SPECIAL_KEYS` per process, and taken once compiled where
every pointer is 16-B aligned. A failing fixed form is off for the process (logged once;
``KVBRIDGE_TRITON_SPECIALISE=0``: generic only); a failing generic form (no Triton, no
compiler) makes :func:`copy` and :func:`grid` return False for good: torch's copies take
over.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbridge import envs

log = logging.getLogger(__name__)

SPECIALISE_AFTER = 2
"""Calls with one length before its fixed form is compiled (a one-off costs nothing)."""
SPECIALISE_MIN_WORDS = 1 << 16
"""Words one copy moves (runs × length) for its length to count towards a fixed form:
512 KiB of int64 words. A smaller copy is bound by its launch, not its loads and stores
(a request's partial last block is one such), and would only take a slot."""
SEEN_KEYS = 1024
"""Lengths counted at once (beyond: the counts start afresh)."""
SPECIAL_KEYS = 8
"""Most fixed forms one process compiles: (kind, length, word type, device) each."""
TILE_WORDS = 1024
"""Words a program moves per step: ``BLOCK`` of each of ``RUNS`` runs."""

Key = tuple[str, int, torch.dtype, str]
"""``(kind, row, word type, device)``: what a fixed form is compiled for."""


@dataclass(slots=True)
class Kernels:
    """The kernels' state in this process: ``forms`` (per kind, generic and fixed) built
    on first use; ``seen``: calls per key not yet fixed; ``ready``: keys whose fixed form
    compiled (with the compile's seconds); ``launches``: copies per form."""

    forms: dict[str, tuple[Any, Any]] | None = None
    failed: bool = False
    fixed_failed: bool = False
    seen: Counter[Key] = field(default_factory=Counter)
    queued: set[Key] = field(default_factory=set)
    ready: dict[Key, float] = field(default_factory=dict)
    launches: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    compiling: threading.Lock = field(default_factory=threading.Lock)


STATE = Kernels(failed=importlib.util.find_spec("triton") is None)


def copy(
    dw: torch.Tensor, d_w: torch.Tensor, sw: torch.Tensor, s_w: torch.Tensor, row: int
) -> bool:
    """``dw[d_w[i] : d_w[i] + row] = sw[s_w[i] : s_w[i] + row]`` for every run ``i`` (word
    offsets, int64, on the words' device), queued on the current stream; False, nothing
    copied, if Triton is missing or the kernel fails to build or launch."""
    n = d_w.numel()
    return _run("runs", (dw, d_w, sw, s_w, n), row, n, (dw, d_w, sw, s_w))


def grid(
    dw: torch.Tensor,
    d_t: torch.Tensor,
    d_id: torch.Tensor,
    d_str: int,
    sw: torch.Tensor,
    s_t: torch.Tensor,
    s_id: torch.Tensor,
    s_str: int,
    row: int,
) -> bool:
    """:func:`copy` of the ``T × B`` runs of a grid (:class:`kvbridge.plan.runs.Grid`, in
    words): run ``(t, b)`` from ``s_t[t] + s_id[b] · s_str`` to ``d_t[t] + d_id[b] ·
    d_str``; the kernel makes each run's offsets, none are written out."""
    nb = d_id.numel()
    n = d_t.numel() * nb
    args = (dw, d_t, d_id, d_str, sw, s_t, s_id, s_str, nb, n)
    return _run("grid", args, row, n, (dw, d_t, d_id, sw, s_t, s_id))


def _run(
    kind: str, args: tuple[Any, ...], row: int, n: int, ptrs: tuple[torch.Tensor, ...]
) -> bool:
    st = STATE
    if st.failed:
        return False
    try:
        if st.forms is None:  # imported on first use: a host-only process never pays it
            from kvbridge.connector.movers import triton_kernels

            st.forms = dict(triton_kernels.FORMS)
        _launch(st, kind, args, row, n, ptrs)
    except Exception as exc:  # any Triton failure: no kernel ran, torch copies instead
        st.failed = True
        log.warning("Triton row copy unavailable (%s: %s); using torch", type(exc).__name__, exc)
        return False
    return True


def _launch(
    st: Kernels, kind: str, args: tuple[Any, ...], row: int, n: int, ptrs: tuple[torch.Tensor, ...]
) -> None:
    assert st.forms is not None
    generic, fixed = st.forms[kind]
    dw = ptrs[0]
    grid_, runs, block = tiles(row, n)
    key: Key = (kind, row, dw.dtype, str(dw.device))
    # every pointer 16-B aligned: what a fixed form is compiled for (else it would compile
    # again, on the copy's path)
    aligned = all(t.data_ptr() % 16 == 0 for t in ptrs)
    on = torch.cuda.device(dw.device) if dw.is_cuda else contextlib.nullcontext()
    with on:  # launch in the memory's context
        if key in st.ready and not st.fixed_failed and aligned:
            try:
                fixed[grid_](*args, ROW=row, RUNS=runs, BLOCK=block)
            except Exception as exc:  # nothing launched: the generic form copies
                _fixed_off(st, exc)
            else:
                st.launches["fixed"] += 1
                return
        generic[grid_](*args, row, RUNS=runs, BLOCK=block)
        st.launches["generic"] += 1
    if n * row >= SPECIALISE_MIN_WORDS and aligned:  # worth a compile, usable
        try:
            _saw(st, key, runs, block)
        except Exception as exc:  # e.g. no thread at interpreter exit: the copy stands
            _fixed_off(st, exc)


def tiles(row: int, n: int) -> tuple[tuple[int], int, int]:
    """``(grid, RUNS, BLOCK)`` for ``n`` runs of ``row`` words: a program per tile of
    about :data:`TILE_WORDS` words."""
    block = min(TILE_WORDS, 1 << (row - 1).bit_length())
    runs = max(1, TILE_WORDS // block)
    return ((n + runs - 1) // runs,), runs, block


def _saw(st: Kernels, key: Key, runs: int, block: int) -> None:
    """Count a generic copy of ``key``; queue its fixed form's compile at the
    :data:`SPECIALISE_AFTER`-th, within :data:`SPECIAL_KEYS`."""
    if st.fixed_failed or not envs.triton_specialise():
        return
    with st.lock:
        if key in st.queued or len(st.queued) >= SPECIAL_KEYS:
            return
        if len(st.seen) >= SEEN_KEYS:  # many one-off lengths: start counting afresh
            st.seen.clear()
        st.seen[key] += 1
        if st.seen[key] < SPECIALISE_AFTER:
            return
        st.queued.add(key)
        del st.seen[key]
    threading.Thread(
        target=_compile, args=(st, key, runs, block), name="kvbridge-triton", daemon=True
    ).start()


def _compile(st: Kernels, key: Key, runs: int, block: int) -> None:
    """Compile ``key``'s fixed form (no launch), then mark it ready; one at a time."""
    kind, row, dtype, device = key
    with st.compiling:
        t0 = time.perf_counter()
        try:
            assert st.forms is not None
            dev = torch.device(device)
            on = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
            with on:
                kernel = st.forms[kind][1].warmup(
                    *_like(kind, dtype), ROW=row, RUNS=runs, BLOCK=block, grid=(1,)
                )
                load = getattr(kernel, "_init_handles", None)
                if callable(load):  # the module into the context now, not at the copy
                    load()
        except Exception as exc:  # the fixed form is an optimisation: generic goes on
            _fixed_off(st, exc)
            return
        with st.lock:
            st.ready[key] = time.perf_counter() - t0


def _like(kind: str, dtype: torch.dtype) -> tuple[Any, ...]:
    """Arguments standing for a copy's (Triton's warm-up takes a dtype for a 16-B aligned
    tensor; integers not specialised on their value, below 2³¹ as a copy's are)."""
    if kind == "runs":
        return (dtype, torch.int64, dtype, torch.int64, TILE_WORDS)
    return (dtype, torch.int64, torch.int64, 3, dtype, torch.int64, torch.int64, 3, 3, TILE_WORDS)


def _fixed_off(st: Kernels, exc: Exception) -> None:
    """The fixed form failed to compile or launch: off for the process, logged once."""
    with st.lock:
        was, st.fixed_failed = st.fixed_failed, True
    if not was:
        log.warning(
            "Triton fixed-length copy unavailable (%s: %s); the generic kernel copies",
            type(exc).__name__,
            exc,
        )
