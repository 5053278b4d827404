"""rows_copy byte-exact against a plain loop over runs of numpy slices: run sizes, offset
patterns, shared and misaligned tensors, bounds; on CUDA too where there is one."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.movers import device_copies, triton_copy
from kvbridge.connector.movers.device_copies import checked_copy, copy_cost_probe, rows_copy
from kvbridge.errors import TransportError

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.fixture(autouse=True)
def triton_must_not_fall_back(request: pytest.FixtureRequest):
    """On CUDA with Triton on, a test passing through torch's copies (the kernel failed
    to build or launch and torch took over) proves nothing of the kernel: fail it."""
    was = triton_copy.STATE.failed
    yield
    cuda = getattr(request.node, "callspec", None) and request.node.callspec.params.get("device")
    if cuda == "cuda" and device_copies.triton_enabled() and not was:
        assert not triton_copy.STATE.failed, "the Triton kernel failed; torch copied"


def reference(
    dst: np.ndarray, d_off: np.ndarray, src: np.ndarray, s_off: np.ndarray, size: int
) -> np.ndarray:
    """``dst`` after the copies, one numpy slice per run (``src`` read as it was)."""
    out = dst.copy()
    for a, b in zip(d_off.tolist(), s_off.tolist(), strict=True):
        out[a : a + size] = src[b : b + size]
    return out


def placed(data: np.ndarray, lead: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(whole buffer, the view of data in it)``: ``lead`` junk bytes before ``data``, so
    the view starts ``lead`` bytes past the buffer's (aligned) address."""
    junk = np.full(lead, 0xA5, np.uint8)
    whole = torch.from_numpy(np.concatenate([junk, data])).to(device)
    return whole, whole[lead:]


def run_and_check(
    device: str,
    dst: np.ndarray,
    d_off: np.ndarray,
    src: np.ndarray,
    s_off: np.ndarray,
    size: int,
    *,
    leads: tuple[int, int] = (0, 0),
    as_numpy: bool = True,
    divisor: int = 0,
) -> None:
    """Copy with rows_copy (``divisor``: with checked_copy, told that it divides every
    offset) (views ``leads`` bytes into their buffers) and compare every byte of both
    buffers with the reference: bytes outside the runs stay as they were."""
    d_whole, dst_t = placed(dst, leads[0], device)
    s_whole, src_t = placed(src, leads[1], device)
    before = s_whole.cpu().numpy().copy()
    offs = (d_off, s_off) if as_numpy else (torch.as_tensor(d_off), torch.as_tensor(s_off))
    if divisor:
        checked_copy(dst_t, d_off, src_t, s_off, size, divisor)
    else:
        rows_copy(dst_t, offs[0], src_t, offs[1], size)
    got = d_whole.cpu().numpy()
    assert (got[: leads[0]] == 0xA5).all()
    np.testing.assert_array_equal(got[leads[0] :], reference(dst, d_off, src, s_off, size))
    np.testing.assert_array_equal(s_whole.cpu().numpy(), before)


def layout(n: int, size: int, pattern: str, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(d_off, s_off, buffer bytes)`` of ``n`` runs, shuffled, destinations disjoint:
    "whole" offsets are multiples of ``size``, "word" multiples of 8 only, "odd" of 1."""
    rng = np.random.default_rng(seed)
    word = -(-size // 8) * 8 + 8  # a multiple of 8 whatever the size
    pitch, lead = {"whole": (size, 0), "word": (word, 8), "odd": (size + 3, 1)}[pattern]
    slots = 2 * n
    d_off = lead + rng.permutation(slots)[:n].astype(np.int64) * pitch
    s_off = lead + rng.permutation(slots)[:n].astype(np.int64) * pitch
    return d_off, s_off, lead + slots * pitch + 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [1024, 256, 32768, 24, 3])
@pytest.mark.parametrize("pattern", ["whole", "word", "odd"])
@pytest.mark.parametrize("as_numpy", [True, False])
def test_matches_reference(device: str, size: int, pattern: str, as_numpy: bool) -> None:
    n = 48 if size <= 1024 else 12
    d_off, s_off, nbytes = layout(n, size, pattern, seed=size)
    rng = np.random.default_rng(size + 1)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = rng.integers(0, 256, nbytes + 40, dtype=np.uint8)
    run_and_check(device, dst, d_off, src, s_off, size, as_numpy=as_numpy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [1024, 256, 24, 3])
@pytest.mark.parametrize("pattern", ["whole", "word", "odd"])
@pytest.mark.parametrize("leads", [(0, 0), (1, 3), (4, 0)])
@pytest.mark.parametrize("told", ["gcd", "1"])
def test_checked_copy_matches_reference(
    device: str, size: int, pattern: str, leads: tuple[int, int], told: str, monkeypatch
) -> None:
    """checked_copy with the offsets' gcd (or just 1) as the divisor: byte-exact, at any
    address, and without scanning the runs again (``_inspect*`` must not run)."""
    d_off, s_off, nbytes = layout(40, size, pattern, seed=size + 5)
    rng = np.random.default_rng(size + 6)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = rng.integers(0, 256, nbytes, dtype=np.uint8)
    divisor = int(np.gcd.reduce(np.concatenate((d_off, s_off)))) if told == "gcd" else 1

    def scanned(*_):
        raise AssertionError("checked_copy scanned the runs")

    monkeypatch.setattr(device_copies, "_inspect", scanned)
    monkeypatch.setattr(device_copies, "_inspect_host", scanned)
    run_and_check(device, dst, d_off, src, s_off, size, leads=leads, divisor=divisor)


def test_checked_copy_refuses_bad_arguments() -> None:
    u8 = torch.zeros(64, dtype=torch.uint8)
    off = np.array([0, 8])
    with pytest.raises(TransportError, match="a divisor of 0 B"):
        checked_copy(u8, off, u8, off, 8, 0)
    with pytest.raises(TransportError, match=r"shape \(2,\), sources \(1,\)"):
        checked_copy(u8, off, u8, off[:1], 8, 8)
    with pytest.raises(TransportError, match="uint8"):
        checked_copy(u8.view(torch.int32), off, u8, off, 8, 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [1024, 24, 3])
@pytest.mark.parametrize("leads", [(1, 3), (4, 0), (2, 6), (0, 5)])
def test_views_at_unaligned_addresses(device: str, size: int, leads: tuple[int, int]) -> None:
    d_off, s_off, nbytes = layout(32, size, "whole", seed=7)
    rng = np.random.default_rng(8)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = rng.integers(0, 256, nbytes, dtype=np.uint8)
    run_and_check(device, dst, d_off, src, s_off, size, leads=leads)


@pytest.mark.parametrize("size", [1024, 24, 3])
@pytest.mark.parametrize(("lead", "cut"), [(1, 7), (4, 4), (3, 0), (0, 8)])
def test_memory_at_an_unaligned_address(size: int, lead: int, cut: int) -> None:
    """Tensors over numpy memory ``lead`` bytes past an aligned address, sliced ``cut``
    bytes further: the words must suit both the address and the storage offset."""
    d_off, s_off, nbytes = layout(32, size, "word", seed=10)
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, nbytes + 16, dtype=np.uint8)
    dst = rng.integers(0, 256, nbytes + 16, dtype=np.uint8)
    want = reference(dst[lead + cut :], d_off, src[lead + cut :], s_off, size)
    dst_t, src_t = (torch.from_numpy(a[lead:])[cut:] for a in (dst, src))
    rows_copy(dst_t, d_off, src_t, s_off, size)
    np.testing.assert_array_equal(dst[lead + cut :], want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [1024, 256, 24, 3])
@pytest.mark.parametrize("pattern", ["whole", "word", "odd"])
def test_source_and_destination_one_tensor(device: str, size: int, pattern: str) -> None:
    n = 40
    d_off, _, nbytes = layout(2 * n, size, pattern, seed=3)
    d_off, s_off = d_off[:n], d_off[n:]  # 2n disjoint runs: n read, n written
    data = np.random.default_rng(4).integers(0, 256, nbytes, dtype=np.uint8)
    want = reference(data, d_off, data, s_off, size)
    buf = torch.from_numpy(data.copy()).to(device)
    rows_copy(buf, d_off, buf, s_off, size)
    np.testing.assert_array_equal(buf.cpu().numpy(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("pattern", "size"), [("whole", 1024), ("word", 256), ("odd", 24)])
def test_chunked_gather(device: str, pattern: str, size: int, monkeypatch) -> None:
    monkeypatch.setattr(device_copies, "CHUNK_WORDS", 100)  # several runs a chunk, or one
    d_off, s_off, nbytes = layout(64, size, pattern, seed=5)
    rng = np.random.default_rng(6)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = rng.integers(0, 256, nbytes, dtype=np.uint8)
    run_and_check(device, dst, d_off, src, s_off, size)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int, int, tuple[int, int]]:
    """Random runs: ``(d_off, s_off, size, dst bytes, src bytes, leads)``; destinations
    disjoint, sources anywhere (they may overlap each other)."""
    unit = draw(st.sampled_from([1, 2, 4, 8]))  # offsets are multiples of it
    size = draw(st.integers(1, 80))
    n = draw(st.integers(0, 24))
    whole = draw(st.booleans())
    pitch = size if whole else -(-size // unit) * unit + unit * draw(st.integers(0, 3))
    lead = 0 if whole else unit * draw(st.integers(0, 3))
    slots = draw(st.lists(st.integers(0, 2 * n + 2), min_size=n, max_size=n, unique=True))
    d_off = lead + np.array(slots, dtype=np.int64) * pitch
    s_step = size if whole else unit
    s_slots = draw(st.lists(st.integers(0, 3 * n + 3), min_size=n, max_size=n))
    s_off = np.array(s_slots, dtype=np.int64) * s_step
    d_len = lead + (2 * n + 3) * pitch + draw(st.integers(0, 9))
    s_len = (3 * n + 4) * s_step + size + draw(st.integers(0, 9))
    leads = (draw(st.integers(0, 8)), draw(st.integers(0, 8)))
    return d_off, s_off, size, d_len, s_len, leads


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=150, deadline=None)
@given(case=layouts(), seed=st.integers(0, 2**32 - 1), as_numpy=st.booleans())
def test_random_layouts(device: str, case: tuple, seed: int, as_numpy: bool) -> None:
    d_off, s_off, size, d_len, s_len, leads = case
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, s_len, dtype=np.uint8)
    dst = rng.integers(0, 256, d_len, dtype=np.uint8)
    run_and_check(device, dst, d_off, src, s_off, size, leads=leads, as_numpy=as_numpy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("d_off", "s_off", "numbers"),
    [
        ([0, 984, 985], [0, 16, 32], ["destination", "985", "1000", "1001"]),
        ([0, -1], [0, 16], ["destination", "-1", "1000"]),
        ([0, 16], [0, 2000], ["source", "2000", "2016", "2000 B"]),
        ([0, 16], [-3, 16], ["source", "-3"]),
    ],
)
def test_runs_outside_raise_and_move_nothing(
    device: str, d_off: list[int], s_off: list[int], numbers: list[str]
) -> None:
    rng = np.random.default_rng(9)
    dst = torch.from_numpy(rng.integers(0, 256, 1000, dtype=np.uint8)).to(device)
    src = torch.from_numpy(rng.integers(0, 256, 2000, dtype=np.uint8)).to(device)
    before = dst.cpu().numpy().copy()
    with pytest.raises(TransportError) as err:
        rows_copy(dst, torch.tensor(d_off), src, np.array(s_off), 16)
    for number in numbers:
        assert number in str(err.value)
    np.testing.assert_array_equal(dst.cpu().numpy(), before)


@pytest.mark.parametrize("device", DEVICES)
def test_no_runs_is_a_no_op(device: str) -> None:
    dst = torch.arange(64, dtype=torch.uint8, device=device)
    src = torch.zeros(8, dtype=torch.uint8, device=device)
    rows_copy(dst, np.zeros(0, np.int64), src, torch.zeros(0, dtype=torch.int64), 1 << 20)
    assert torch.equal(dst.cpu(), torch.arange(64, dtype=torch.uint8))


def test_bad_arguments_raise() -> None:
    u8 = torch.zeros(64, dtype=torch.uint8)
    off = np.array([0, 8])
    with pytest.raises(TransportError, match="2 destination offsets for 1 sources"):
        rows_copy(u8, off, u8, off[:1], 8)
    with pytest.raises(TransportError, match="float"):
        rows_copy(u8, off.astype(np.float64), u8, off, 8)
    with pytest.raises(TransportError, match="uint8"):
        rows_copy(u8.view(torch.int32), off, u8, off, 8)
    with pytest.raises(TransportError, match="contiguous"):
        rows_copy(u8[::2], off, u8, off, 8)
    with pytest.raises(TransportError, match="a run of 0 B"):
        rows_copy(u8, off, u8, off, 0)


def test_stream_is_ignored_on_cpu() -> None:
    src = torch.arange(32, dtype=torch.uint8)
    dst = torch.zeros(32, dtype=torch.uint8)
    rows_copy(dst, np.array([16]), src, np.array([0]), 16, stream=object())
    assert dst[16:].tolist() == list(range(16)) and dst[:16].sum() == 0


def test_triton_failure_falls_back_once(monkeypatch, caplog) -> None:
    class Broken:
        def __getitem__(self, _grid: object):
            def run(*_: object, **__: object) -> None:
                raise RuntimeError("no compiler here")

            return run

    state = triton_copy.Kernels(forms={"runs": (Broken(), Broken())})
    monkeypatch.setattr(triton_copy, "STATE", state)
    words = torch.zeros(4, dtype=torch.int64)
    idx = torch.zeros(1, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger=triton_copy.__name__):
        assert not triton_copy.copy(words, idx, words, idx, 1)
        assert not triton_copy.copy(words, idx, words, idx, 1)
    assert [r.getMessage().count("no compiler here") for r in caplog.records] == [1]
    assert state.failed


def test_triton_switch(monkeypatch) -> None:
    monkeypatch.setenv("KVBRIDGE_TRITON", "0")
    assert not device_copies.triton_enabled()
    monkeypatch.delenv("KVBRIDGE_TRITON")
    assert device_copies.triton_enabled()


@pytest.mark.parametrize("device", DEVICES)
def test_cost_probe(device: str) -> None:
    per_run, per_byte = copy_cost_probe(device)
    assert math.isfinite(per_run) and math.isfinite(per_byte)
    assert per_run >= 0 and per_byte >= 0 and per_run + per_byte > 0
    assert per_run < 1e-3 and per_byte < 1e-6  # a µs-scale run, a ≥ 1 MB/s copy


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 1 << 40), min_size=1, max_size=40),
    st.lists(st.integers(0, 1 << 40), min_size=1, max_size=40),
    st.sampled_from([1, 2, 8, 24, 96, 256, 4096]),
    st.sampled_from([1, 2, 4, 8, 24, 96, 256, 4096]),
)
def test_copy_divisor_divides_every_offset_and_tells_whole_rows(d, s, size, scale) -> None:
    """The staging copies' divisor (one OR-reduction per side, no scan of the runs): it
    divides every offset, and where it is a multiple of ``size`` every offset is one."""
    from kvbridge.connector.movers.device_copies import copy_divisor

    d_off, s_off = np.array(d, np.int64) * scale, np.array(s, np.int64) * scale
    whole = not (d_off % size).any() and not (s_off % size).any()
    for rows in (True, False):
        k = copy_divisor(d_off, s_off, size, rows)
        assert k > 0 and not (d_off % k).any() and not (s_off % k).any()
        if k % size == 0:
            assert whole
        if whole and (rows or size & (size - 1) == 0):
            assert k % size == 0  # told where torch copies, and always for powers of two
