"""The fused Triton copy kernel, both forms (length at run time, length a constant),
byte-exact against numpy slices, and the fixed form's policy: compiled after
SPECIALISE_AFTER calls on a thread of its own, at most SPECIAL_KEYS lengths, taken only
for 16-byte aligned pointers, a failing compile or launch leaving the generic form on.

Where there is no GPU the kernels run in Triton's interpreter on CPU tensors (the same
kernel source; no compile); on a GPU they are compiled and run on CUDA."""

from __future__ import annotations

import importlib.util
import logging
import sys

import numpy as np
import pytest
import torch

from benchmarks.triton_state import kernel_facts, wait_compiled
from kvbridge.connector.movers import triton_copy

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton does not import"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8]


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch):
    """A fresh kernel state (built anew); without CUDA, Triton's interpreter."""
    if DEVICE == "cpu":  # the kernels decorated anew, for the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.delitem(sys.modules, "kvbridge.connector.movers.triton_kernels", raising=False)
    monkeypatch.delenv("KVBRIDGE_TRITON_SPECIALISE", raising=False)
    monkeypatch.setattr(triton_copy, "SPECIALISE_MIN_WORDS", 0)  # the tests' copies are small
    st = triton_copy.Kernels()
    monkeypatch.setattr(triton_copy, "STATE", st)
    yield st
    assert wait_compiled(120), "a fixed-form compile still running"


class Case:
    """``n`` disjoint runs of ``row`` words in shuffled order, source and destination
    tensors, and the numpy reference of the destination after the copy."""

    def __init__(self, row: int, dtype: torch.dtype, n: int = 23, seed: int = 0):
        rng = np.random.default_rng(seed)
        slots = 2 * n + 3
        self.row = row
        self.src = torch.from_numpy(rng.integers(0, 100, slots * row, dtype=np.int64))
        self.src = self.src.to(dtype).to(DEVICE)
        self.dst = torch.zeros(slots * row + 5, dtype=dtype, device=DEVICE)
        self.s = rng.permutation(slots)[:n] * row
        self.d = rng.permutation(slots)[:n] * row + rng.integers(0, 2)  # maybe off a row

    def run(self, dst: torch.Tensor | None = None) -> bool:
        d_w = torch.as_tensor(self.d, dtype=torch.int64, device=DEVICE)
        s_w = torch.as_tensor(self.s, dtype=torch.int64, device=DEVICE)
        return triton_copy.copy(self.dst if dst is None else dst, d_w, self.src, s_w, self.row)

    def check(self, dst: torch.Tensor | None = None) -> None:
        want = np.zeros(self.dst.numel(), dtype=np.int64)
        src = self.src.cpu().to(torch.int64).numpy()
        for d, s in zip(self.d, self.s, strict=True):
            want[d : d + self.row] = src[s : s + self.row]
        got = (self.dst if dst is None else dst).cpu().to(torch.int64).numpy()
        assert np.array_equal(got[: want.size], want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row", [1, 3, 64, 1000, 1500])
def test_both_forms_copy_exactly(kernels: triton_copy.Kernels, row: int, dtype) -> None:
    cases = [Case(row, dtype, seed=i) for i in range(3)]
    for c in cases[:2]:  # generic twice: the second queues the fixed form
        assert c.run()
        c.check()
    assert kernels.launches == {"generic": 2}
    assert wait_compiled(120)
    assert list(kernels.ready) == [("runs", row, dtype, DEVICE if DEVICE == "cpu" else "cuda:0")]
    assert cases[2].run()
    cases[2].check()
    assert kernels.launches == {"generic": 2, "fixed": 1}
    assert not kernels.failed and not kernels.fixed_failed


def test_one_off_lengths_compile_nothing(kernels: triton_copy.Kernels) -> None:
    for row in (5, 6, 7):
        assert Case(row, torch.int64).run()
    assert wait_compiled(5)
    assert not kernels.queued and not kernels.ready
    assert kernels.launches == {"generic": 3}


def test_the_fixed_forms_are_bounded(kernels: triton_copy.Kernels) -> None:
    rows = range(2, 2 + triton_copy.SPECIAL_KEYS + 3)
    for _ in range(triton_copy.SPECIALISE_AFTER):
        for row in rows:
            Case(row, torch.int32).run()
    assert wait_compiled(120)
    assert len(kernels.ready) == triton_copy.SPECIAL_KEYS
    assert sorted(k[1] for k in kernels.ready) == list(rows)[: triton_copy.SPECIAL_KEYS]
    for row in rows:  # the first SPECIAL_KEYS lengths fixed, the rest generic, all exact
        c = Case(row, torch.int32, seed=9)
        c.run()
        c.check()
    assert kernels.launches["fixed"] == triton_copy.SPECIAL_KEYS
    assert not kernels.seen.keys() & kernels.ready.keys()


def test_unaligned_pointers_take_the_generic_form(kernels: triton_copy.Kernels) -> None:
    c = Case(48, torch.int64)
    for _ in range(triton_copy.SPECIALISE_AFTER):
        c.run()
    assert wait_compiled(120) and kernels.ready
    wide = torch.zeros(c.dst.numel() + 1, dtype=torch.int64, device=DEVICE)
    off = wide[1:]  # 8 B past a 16-aligned start
    assert off.data_ptr() % 16 == 8
    before = kernels.launches["generic"]
    c.run(off)
    c.check(off)
    assert kernels.launches["generic"] == before + 1 and "fixed" not in kernels.launches


class _Raising:
    """A kernel whose compile and launch raise (no compiler, a driver refusing)."""

    def warmup(self, *_: object, **__: object) -> None:
        raise RuntimeError("no ptxas here")

    def __getitem__(self, _grid: object):
        def run(*_: object, **__: object) -> None:
            raise RuntimeError("launch refused")

        return run


def _break_fixed(kernels: triton_copy.Kernels) -> None:
    assert kernels.forms is not None
    kernels.forms = {kind: (g, _Raising()) for kind, (g, _) in kernels.forms.items()}


def test_a_failing_compile_leaves_the_generic_form(kernels, caplog) -> None:
    c = Case(32, torch.int64)
    c.run()  # builds both forms
    _break_fixed(kernels)
    with caplog.at_level(logging.WARNING, logger=triton_copy.__name__):
        c.run()  # queues the compile, which fails
        assert wait_compiled(60)
        for seed in range(3):
            other = Case(32, torch.int64, seed=seed + 1)
            assert other.run()
            other.check()
    assert kernels.fixed_failed and not kernels.failed and not kernels.ready
    assert [r.getMessage().count("no ptxas here") for r in caplog.records] == [1]
    assert kernels.launches == {"generic": 5}


def test_a_failing_fixed_launch_copies_with_the_generic_form(kernels, caplog) -> None:
    c = Case(40, torch.int16)
    for _ in range(triton_copy.SPECIALISE_AFTER):
        c.run()
    assert wait_compiled(120) and kernels.ready
    _break_fixed(kernels)
    again = Case(40, torch.int16, seed=4)
    with caplog.at_level(logging.WARNING, logger=triton_copy.__name__):
        assert again.run()
        assert again.run()
    again.check()
    assert kernels.fixed_failed and not kernels.failed
    assert [r.getMessage().count("launch refused") for r in caplog.records] == [1]
    assert kernels.launches == {"generic": 2 + triton_copy.SPECIALISE_AFTER}


def test_the_switch_keeps_the_generic_form(kernels, monkeypatch) -> None:
    monkeypatch.setenv("KVBRIDGE_TRITON_SPECIALISE", "0")
    for _ in range(4):
        Case(16, torch.int64).run()
    assert not kernels.queued and kernels.launches == {"generic": 4}


def test_facts_say_what_ran(kernels: triton_copy.Kernels) -> None:
    assert kernel_facts()["built"] is False
    for _ in range(triton_copy.SPECIALISE_AFTER + 1):
        Case(24, torch.int32).run()
        wait_compiled(120)
    f = kernel_facts()
    assert f["built"] and not f["failed"] and not f["fixed_failed"]
    assert f["launches"] == {"generic": triton_copy.SPECIALISE_AFTER, "fixed": 1}
    assert [(r["row"], r["dtype"]) for r in f["fixed_ready"]] == [(24, "int32")]
    assert f["fixed_ready"][0]["compile_s"] >= 0 and f["fixed_queued"] == 1


def test_the_forms_benchmark_checks_its_bytes(kernels: triton_copy.Kernels) -> None:
    from benchmarks.bench_device_copies import SHAPES
    from benchmarks.bench_triton_forms import line

    for shape in SHAPES:
        out = line(shape, 8, torch.device(DEVICE), 1)
        assert out.endswith("  ok"), out


class GridCase:
    """A grid of ``T`` pattern runs × ``B`` tiles of ``row`` words (disjoint: pattern runs
    at distinct slots of a block, distinct block ids), and its per-run reference."""

    def __init__(self, row: int, dtype: torch.dtype, t: int = 5, b: int = 13, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.row, self.stride = row, row * (t + 2)
        self.s_t = rng.permutation(t + 2)[:t] * row
        self.d_t = rng.permutation(t + 2)[:t] * row + 1  # words need not align to rows
        self.s_id, self.d_id = rng.permutation(2 * b)[:b], rng.permutation(2 * b)[:b]
        size = 2 * b * self.stride + 2
        self.src = torch.from_numpy(rng.integers(0, 100, size, dtype=np.int64)).to(dtype)
        self.src = self.src.to(DEVICE)
        self.dst = torch.zeros(size, dtype=dtype, device=DEVICE)

    def run(self) -> bool:
        def on(a: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(a, dtype=torch.int64, device=DEVICE)

        return triton_copy.grid(
            self.dst, on(self.d_t), on(self.d_id), self.stride,
            self.src, on(self.s_t), on(self.s_id), self.stride, self.row,
        )  # fmt: skip

    def check(self) -> None:
        want = np.zeros(self.dst.numel(), dtype=np.int64)
        src = self.src.cpu().to(torch.int64).numpy()
        for t in range(self.s_t.shape[0]):
            for b in range(self.s_id.shape[0]):
                s = self.s_t[t] + self.s_id[b] * self.stride
                d = self.d_t[t] + self.d_id[b] * self.stride
                want[d : d + self.row] = src[s : s + self.row]
        assert np.array_equal(self.dst.cpu().to(torch.int64).numpy(), want)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8], ids=str)
@pytest.mark.parametrize("row", [1, 5, 64, 1500])
def test_the_grid_kernel_copies_exactly_in_both_forms(kernels, row: int, dtype) -> None:
    cases = [GridCase(row, dtype, seed=i) for i in range(3)]
    for c in cases[:2]:
        assert c.run()
        c.check()
    assert wait_compiled(120)
    assert [k[:2] for k in kernels.ready] == [("grid", row)]
    assert cases[2].run()
    cases[2].check()
    assert kernels.launches == {"generic": 2, "fixed": 1}


@pytest.mark.skipif(DEVICE != "cuda", reason="the fused kernel copies CUDA memory only")
def test_grid_copy_takes_the_grid_kernel_on_cuda(kernels) -> None:
    from kvbridge.connector.movers.device_copies import GridCopy, grid_copy

    rng = np.random.default_rng(5)
    stride, t, b = 4096, 6, 40
    g = GridCopy(
        rng.permutation(8)[:t] * 512, rng.permutation(2 * b)[:b], stride,
        rng.permutation(8)[:t] * 512, rng.permutation(2 * b)[:b], stride, 512,
    )  # fmt: skip
    src = torch.randint(0, 256, (2 * b * stride,), dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros_like(src)
    grid_copy(dst, src, g, 512)
    want = torch.zeros_like(src).cpu().numpy()
    host = src.cpu().numpy()
    for i in range(t):
        for j in range(b):
            s, d = g.s_t[i] + g.s_ids[j] * stride, g.d_t[i] + g.d_ids[j] * stride
            want[d : d + 512] = host[s : s + 512]
    assert np.array_equal(dst.cpu().numpy(), want)
    assert kernels.launches["generic"] == 1


def test_small_or_unaligned_copies_count_for_no_fixed_form(kernels, monkeypatch) -> None:
    """A copy under SPECIALISE_MIN_WORDS words (a partial last block), or one whose
    pointers the fixed form could not take, never queues a compile."""
    monkeypatch.setattr(triton_copy, "SPECIALISE_MIN_WORDS", 23 * 48 + 1)
    for _ in range(3):
        Case(48, torch.int64).run()  # 23 runs × 48 words: one word short
    c = Case(48, torch.int64)
    monkeypatch.setattr(triton_copy, "SPECIALISE_MIN_WORDS", 0)
    wide = torch.zeros(c.dst.numel() + 1, dtype=torch.int64, device=DEVICE)
    for _ in range(3):
        c.run(wide[1:])  # 8 B past an aligned start
    c.check(wide[1:])
    assert wait_compiled(5)
    assert not kernels.queued and not kernels.seen and kernels.launches == {"generic": 6}


def test_a_thread_that_will_not_start_leaves_the_copy_done(kernels, monkeypatch) -> None:
    """Queuing the compile fails after the generic copy ran: the copy stands (no second
    copy by torch), the fixed form goes off, the generic kernel stays on."""

    def refuse(self, *_: object) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(triton_copy.threading.Thread, "start", refuse)
    results = [Case(32, torch.int64, seed=i).run() for i in range(4)]
    assert results == [True] * 4
    assert kernels.fixed_failed and not kernels.failed
    assert kernels.launches == {"generic": 4}


def test_gpu_check_sees_the_kernel_built(kernels) -> None:
    from types import SimpleNamespace

    from benchmarks.gpu_check import facts

    rank = SimpleNamespace(role="D", rank=0, setup=SimpleNamespace(gpu=DEVICE == "cuda"))
    assert not facts.triton_facts(rank, None)["built"]  # type: ignore[arg-type]
    Case(8, torch.int64).run()
    f = facts.triton_facts(rank, None)  # type: ignore[arg-type]
    assert f["built"] and (f["ran"] or not f["enabled"]), f
    assert f["kernels"]["launches"] == {"generic": 1}


@pytest.mark.skipif(DEVICE != "cuda", reason="compiles only where Triton compiles (CUDA)")
def test_the_first_fixed_copy_compiles_nothing_on_the_copy_path(kernels) -> None:
    """The background warm-up compiled exactly what the copy then launches: the fixed
    form's kernel cache does not grow at its first launch (a key mismatch would compile
    again there, on the copy's path)."""
    c = Case(640, torch.int64)
    for _ in range(triton_copy.SPECIALISE_AFTER):
        c.run()
    assert wait_compiled(120) and kernels.ready and kernels.forms is not None
    caches = getattr(kernels.forms["runs"][1], "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its kernel cache elsewhere")
    dev = torch.cuda.current_device()
    before = len(caches[dev][0])
    assert before >= 1
    c.run()
    torch.cuda.synchronize()
    c.check()
    assert kernels.launches["fixed"] == 1 and len(caches[dev][0]) == before
