"""Copies of many equal-length runs where the memory is (CPU or CUDA tensors): the
device-side counterpart of :func:`kvbridge.connector.movers.copies.copy_equal`.

Both tensors are viewed as words as wide as every address allows (a run at ``d_off = 8``
of 16 B is int64 words 1 and 2), moved by the first way that fits: a fused Triton kernel
(CUDA, ``triton`` importable, ``KVBRIDGE_TRITON`` not "0"); whole rows (every offset a
multiple of ``size``: one ``index_select`` + ``index_copy_``); or flat word indices. The
torch ways go in chunks of at most :data:`CHUNK_WORDS` words. Measured: ``docs/gpu.md``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbridge import envs
from kvbridge.connector.movers import triton_copy
from kvbridge.connector.movers.copies import inside
from kvbridge.errors import TransportError

CHUNK_WORDS = 1 << 22
"""Most words one torch gather-scatter moves at once: its temporaries (the gathered
words, and for the flat way two int64 index tensors) stay under 32 + 64 MiB."""
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
PROBE_RUNS = 1024
PROBE_SIZES = (64, 1024)
""":func:`copy_cost_probe`'s runs: this many of each size (bytes), 1 MiB at most."""

Offsets = torch.Tensor | np.ndarray


def rows_copy(
    dst: torch.Tensor,
    d_off: Offsets,
    src: torch.Tensor,
    s_off: Offsets,
    size: int,
    *,
    stream: Any = None,
) -> None:
    """``dst[d_off[i] : d_off[i] + size] = src[s_off[i] : s_off[i] + size]`` for all i.

    ``dst``, ``src``: contiguous 1-D uint8 tensors on one device, possibly the same
    tensor. ``d_off``, ``s_off``: byte offsets, 1-D integer tensors or numpy arrays
    (checked on the host, then moved once); ``size``: bytes per run. A destination run
    overlapping another run is the caller's bug (undefined bytes). Every run is checked
    to lie inside its tensor before any byte moves (TransportError naming the numbers).
    ``stream``: the CUDA stream the transfer, checks and copies run on (CPU: ignored).
    Returns when the copies are queued on CUDA, done on CPU."""
    _check_tensors(dst, src, size)
    host = isinstance(d_off, np.ndarray) and isinstance(s_off, np.ndarray)
    if host:  # checked on the host: no read back from the device
        divisor = _inspect_host(dst, np.asarray(d_off), src, np.asarray(s_off), size)
    with _on(stream, dst):
        d, s = _offsets(d_off, dst.device), _offsets(s_off, src.device)
        if d.shape != s.shape:
            raise TransportError(f"{d.numel()} destination offsets for {s.numel()} sources")
        if d.numel() == 0:
            return
        _copy(dst, d, src, s, size, divisor if host else _inspect(dst, d, src, s, size))


def checked_copy(
    dst: torch.Tensor,
    d_off: np.ndarray,
    src: torch.Tensor,
    s_off: np.ndarray,
    size: int,
    divisor: int,
    *,
    stream: Any = None,
) -> None:
    """:func:`rows_copy` of runs the caller checked (inside their tensors, no overlap:
    :func:`~kvbridge.connector.movers.kernel.copy_groups`), without scanning them again:
    ``divisor`` (bytes, > 0; :meth:`~kvbridge.plan.geometry.Geometry.divisor`) divides
    every offset and tells the word width and whether runs are whole rows. An offset it
    does not divide is the caller's bug (undefined bytes)."""
    _check_tensors(dst, src, size, divisor)
    if d_off.ndim != 1 or d_off.shape != s_off.shape:
        raise TransportError(f"destination offsets of shape {d_off.shape}, sources {s_off.shape}")
    if d_off.shape[0]:
        with _on(stream, dst):
            d, s = _offsets(d_off, dst.device), _offsets(s_off, src.device)
            _copy(dst, d, src, s, size, divisor)


@dataclass(frozen=True, slots=True)
class GridCopy:
    """``T × B`` runs of ``size`` bytes given as a grid: run ``(t, b)`` from ``s_t[t] +
    s_ids[b] · s_stride`` to ``d_t[t] + d_ids[b] · d_stride`` (byte offsets, block ids,
    block strides in bytes; :class:`kvbridge.plan.runs.Grid` of one length)."""

    d_t: np.ndarray
    d_ids: np.ndarray
    d_stride: int
    s_t: np.ndarray
    s_ids: np.ndarray
    s_stride: int
    size: int


def grid_copy(
    dst: torch.Tensor, src: torch.Tensor, g: GridCopy, divisor: int, *, stream: Any = None
) -> None:
    """:func:`checked_copy` of the runs of grid ``g`` (``divisor`` also divides both
    strides). Only ``T + B`` offsets and ids go to the device, in one transfer; the fused
    kernel makes each run's offsets itself, torch's copies get them made on the device."""
    _check_tensors(dst, src, g.size, divisor)
    arrays = (g.d_t, g.d_ids, g.s_t, g.s_ids)
    if any(a.ndim != 1 or a.dtype.kind not in "iu" for a in arrays):
        raise TransportError("a grid's offsets and ids must be 1-D integer arrays")
    if g.d_t.shape != g.s_t.shape or g.d_ids.shape != g.s_ids.shape:
        raise TransportError(f"a grid of {g.d_t.shape}/{g.s_t.shape} runs per tile and "
                             f"{g.d_ids.shape}/{g.s_ids.shape} tiles")  # fmt: skip
    if not g.d_t.shape[0] or not g.d_ids.shape[0]:
        return
    w = _word(g.size, divisor, dst, src)
    row, d_str, s_str = g.size // w, g.d_stride // w, g.s_stride // w
    with _on(stream, dst):
        d_t, d_ids, s_t, s_ids = _together((g.d_t // w, g.d_ids, g.s_t // w, g.s_ids), dst.device)
        dw, sw = _words(dst, w), _words(src, w)
        fused = dst.is_cuda and triton_enabled()
        if fused and triton_copy.grid(dw, d_t, d_ids, d_str, sw, s_t, s_ids, s_str, row):
            return
        d = (d_t[:, None] + d_ids * d_str).reshape(-1)
        s = (s_t[:, None] + s_ids * s_str).reshape(-1)
        whole = divisor % g.size == 0
        _torch_copy(dw, d, sw, s, units_per_word=1, row=row, whole=whole)  # d, s: in words


def _together(arrays: tuple[np.ndarray, ...], device: torch.device) -> list[torch.Tensor]:
    """Small int64 arrays on ``device`` in one transfer (CUDA: from a new pinned block,
    not waiting for the stream), each starting 16-B aligned."""
    sizes = [int(a.shape[0]) for a in arrays]
    starts = np.cumsum([0] + [n + n % 2 for n in sizes])  # an even count: 16-B starts
    flat = np.zeros(int(starts[-1]), dtype=np.int64)
    for a, lo, n in zip(arrays, starts, sizes, strict=False):
        flat[lo : lo + n] = a
    out = _offsets(flat, device)
    return [out[lo : lo + n] for lo, n in zip(starts, sizes, strict=False)]


def _on(stream: Any, dst: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """``stream`` as torch's current CUDA stream for copies into ``dst`` (CPU: none)."""
    if stream is not None and dst.is_cuda:
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


def triton_enabled() -> bool:
    """Whether CUDA copies may use the fused Triton kernel: ``KVBRIDGE_TRITON`` (default
    "1"; "0" keeps them on torch's index kernels), read on every call."""
    return envs.triton_copies()


def copy_cost_probe(device: torch.device | str) -> tuple[float, float]:
    """``(seconds per run, seconds per byte)`` of :func:`rows_copy` on ``device``, fitted
    as ``t = runs · a + bytes · b`` (both ≥ 0) to :data:`PROBE_RUNS` shuffled runs of each
    of :data:`PROBE_SIZES` bytes, best of three copies each after one warm-up; CUDA is
    synchronised before every clock reading. A call's fixed cost (the checks' read back)
    is in ``a``, spread over PROBE_RUNS runs. Takes a few ms on a 2-core CPU."""
    dev = torch.device(device)
    (s1, s2), n = PROBE_SIZES, PROBE_RUNS
    t1, t2 = _probe_time(dev, s1), _probe_time(dev, s2)
    per_byte = max((t2 - t1) / (n * (s2 - s1)), 0.0)
    return max(t1 / n - s1 * per_byte, 0.0), per_byte


def _probe_time(dev: torch.device, size: int) -> float:
    """Best seconds of three :func:`rows_copy` calls of PROBE_RUNS shuffled ``size``-byte
    runs (after a warm-up)."""
    gen = torch.Generator().manual_seed(size)
    src = torch.zeros(PROBE_RUNS * size, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    d_off = (torch.randperm(PROBE_RUNS, generator=gen) * size).to(dev)
    s_off = (torch.randperm(PROBE_RUNS, generator=gen) * size).to(dev)
    times = []
    for _ in range(4):
        _sync(dev)
        t0 = time.perf_counter()
        rows_copy(dst, d_off, src, s_off, size)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _sync(dev: torch.device) -> None:
    """Wait for every copy queued on CUDA device ``dev`` (CPU: nothing to wait for)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _check_tensors(dst: torch.Tensor, src: torch.Tensor, size: int, divisor: int = 1) -> None:
    """TransportError unless both are contiguous 1-D uint8 tensors on one device, a run
    has at least one byte and ``divisor`` is positive."""
    for name, t in (("destination", dst), ("source", src)):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise TransportError(
                f"{name} must be a contiguous 1-D uint8 tensor, not {t.dtype} "
                f"of shape {tuple(t.shape)} and strides {t.stride()}"
            )
    if dst.device != src.device:
        raise TransportError(f"destination on {dst.device}, source on {src.device}")
    if size <= 0:
        raise TransportError(f"a run of {size} B")
    if divisor <= 0:
        raise TransportError(f"a divisor of {divisor} B")


def _offsets(off: Offsets, device: torch.device) -> torch.Tensor:
    """Byte offsets as a 1-D int64 tensor on ``device`` (one transfer at most)."""
    if isinstance(off, np.ndarray):
        if off.dtype.kind not in "iu":
            raise TransportError(f"offsets must be integers, not {off.dtype}")
        off = torch.from_numpy(np.ascontiguousarray(off, dtype=np.int64))
    t = off
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TransportError(f"offsets must be 1-D integers, not {t.dtype} {tuple(t.shape)}")
    if device.type == "cuda" and t.device.type == "cpu":
        # copied into a new pinned block, then queued on the current stream without
        # waiting for it: a blocking copy from pageable memory would wait for every copy
        # queued before it (the caching host allocator keeps the block until it ran)
        pinned = torch.empty(t.shape, dtype=torch.int64, pin_memory=True)
        pinned.copy_(t)
        return pinned.to(device=device, non_blocking=True)
    return t.to(device=device, dtype=torch.int64)


def _inspect(
    dst: torch.Tensor, d: torch.Tensor, src: torch.Tensor, s: torch.Tensor, size: int
) -> int:
    """Check every run lies inside its tensor (TransportError with the numbers) → a
    divisor of every offset for :func:`_copy`, in one read back to the host: the widest
    power of two up to 8 dividing every offset, times ``size``'s rest where every offset
    is a multiple of ``size`` (whole rows)."""
    both = torch.stack((d, s))
    lo, hi = torch.aminmax(both, dim=1)
    rest = (both % size).amax()  # 0: every offset starts a whole row
    capped = both | 8  # lowest set bit of (off | 8): the widest word ≤ 8 dividing off
    low = (capped & -capped).amin()
    d_lo, s_lo, d_hi, s_hi, rest_b, low_b = torch.cat((lo, hi, rest[None], low[None])).tolist()
    inside("destination", dst.numel(), d_lo, d_hi, size)
    inside("source", src.numel(), s_lo, s_hi, size)
    return math.lcm(low_b, size) if rest_b == 0 else low_b


def _inspect_host(
    dst: torch.Tensor, d: np.ndarray, src: torch.Tensor, s: np.ndarray, size: int
) -> int:
    """:func:`_inspect` for offsets still in host memory (numpy), before any transfer:
    each side's extremes, and :func:`copy_divisor`."""
    if d.shape != s.shape or d.ndim != 1 or d.shape[0] == 0 or d.dtype.kind not in "iu":
        return 1  # refused or a no-op below, by the tensor path
    d, s = d.astype(np.int64, copy=False), s.astype(np.int64, copy=False)
    inside("destination", dst.numel(), int(d.min()), int(d.max()), size)
    inside("source", src.numel(), int(s.min()), int(s.max()), size)
    return copy_divisor(d, s, size, rows=not (dst.is_cuda and triton_enabled()))


def copy_divisor(d_off: np.ndarray, s_off: np.ndarray, size: int, rows: bool = True) -> int:
    """A divisor of every offset for :func:`checked_copy`, from one OR-reduction per side:
    the offsets' lowest common set bit. Where that is no multiple of ``size`` (a ``size``
    that is no power of two) and ``rows`` (torch will copy: whole rows are its faster
    way), a scan tells whether every offset is a multiple of ``size`` (then ``size``)."""
    bits = int(np.bitwise_or.reduce(d_off)) | int(np.bitwise_or.reduce(s_off))
    low = bits & -bits if bits else 1 << 62  # all offsets 0: any divisor
    if rows and low % size and not (d_off % size).any() and not (s_off % size).any():
        return size
    return low


def _word(size: int, divisor: int, *tensors: torch.Tensor) -> int:
    """Bytes per word: the widest of 8, 4, 2, 1 that divides ``size``, ``divisor`` (so
    every offset) and each tensor's address and storage offset (a dtype view needs both)."""
    must_divide: list[int | torch.SymInt] = [size, divisor]
    for t in tensors:
        must_divide += [t.data_ptr(), t.storage_offset()]
    for w in (8, 4, 2):
        if all(x % w == 0 for x in must_divide):
            return w
    return 1


def _words(t: torch.Tensor, w: int) -> torch.Tensor:
    """``t`` (uint8, aligned to ``w``) as ``w``-byte words; a tail shorter than a word is
    left out (the runs were checked to lie inside ``t`` and end on a word boundary)."""
    return t[: t.numel() - t.numel() % w].view(WORD_DTYPES[w])


def _copy(
    dst: torch.Tensor, d: torch.Tensor, src: torch.Tensor, s: torch.Tensor, size: int, divisor: int
) -> None:
    """Move checked runs as words as wide as ``divisor`` (dividing every offset) allows:
    Triton if it may, else whole rows (``divisor`` a multiple of ``size``) or flat words."""
    w = _word(size, divisor, dst, src)
    dw, sw, row = _words(dst, w), _words(src, w), size // w
    if dst.is_cuda and triton_enabled() and triton_copy.copy(dw, _div(d, w), sw, _div(s, w), row):
        return
    _torch_copy(dw, d, sw, s, units_per_word=w, row=row, whole=divisor % size == 0)  # in bytes


def _torch_copy(
    dw: torch.Tensor,
    d: torch.Tensor,
    sw: torch.Tensor,
    s: torch.Tensor,
    *,
    units_per_word: int,
    row: int,
    whole: bool,
) -> None:
    """Runs of ``row`` words each from offset ``s[i]`` of words ``sw`` to ``d[i]`` of
    ``dw``, in chunks of at most :data:`CHUNK_WORDS` words: as whole rows (``whole``:
    every offset a multiple of a row; one ``index_select`` + ``index_copy_``), else one
    word index each. ``units_per_word``: how many of the offsets' units make one word —
    the word's width in bytes where ``d`` and ``s`` are byte offsets (:func:`_copy`), 1
    where they already count words (:func:`grid_copy`)."""
    step = max(1, CHUNK_WORDS // row)
    if whole:
        per_row = units_per_word * row
        d_row, s_row = _div(d, per_row), _div(s, per_row)
        dr = dw[: dw.numel() // row * row].view(-1, row)
        sr = sw[: sw.numel() // row * row].view(-1, row)
        for lo in range(0, d_row.numel(), step):
            dr.index_copy_(0, d_row[lo : lo + step], sr.index_select(0, s_row[lo : lo + step]))
        return
    d_w, s_w = _div(d, units_per_word), _div(s, units_per_word)
    cols = torch.arange(row, dtype=torch.int64, device=dw.device)
    for lo in range(0, d_w.numel(), step):
        di = (d_w[lo : lo + step, None] + cols).reshape(-1)
        si = (s_w[lo : lo + step, None] + cols).reshape(-1)
        dw.index_copy_(0, di, sw.index_select(0, si))


def _div(off: torch.Tensor, k: int) -> torch.Tensor:
    """``off // k`` for checked (non-negative) offsets: a shift when ``k`` is a power of
    two (torch's int64 division is several times slower on CPU), none when it is 1."""
    if k & (k - 1):
        return off // k
    return off >> (k.bit_length() - 1) if k > 1 else off
