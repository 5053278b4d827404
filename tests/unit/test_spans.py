"""Staged spans that read over short gaps: the bytes each run gets are still its own, a
span never leaves its source region, a round never overflows the slot, and an NHD head
split turns one descriptor per token row into one per block."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.movers.spans import chunks
from kvbridge.errors import TransportError
from kvbridge.plan.runs import Runs
from tests.unit.test_staging import naive, run_sets

REGIONS = (np.array([0, 1000, 2500], np.int64), np.array([1000, 2500, 4096], np.int64))


@settings(max_examples=200, deadline=None)
@given(
    runs=run_sets(),
    slot=st.sampled_from([100, 256, 1000, 5000]),
    gap=st.sampled_from([0, 1, 16, 200, 5000]),
)
def test_gap_spans_then_scatter_equal_a_naive_copy(runs: Runs, slot: int, gap: int) -> None:
    inside = np.searchsorted(REGIONS[0], runs.src, side="right") == np.searchsorted(
        REGIONS[0], runs.src + runs.length - 1, side="right"
    )
    runs = Runs(runs.src[inside], runs.dst[inside], runs.length[inside])  # runs in one region
    if len(runs) == 0:
        return
    src_mem = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    want, got = naive(src_mem, runs, 4800), np.zeros(4800, np.uint8)
    try:
        parts = chunks(runs, slot, gap, REGIONS)
    except TransportError:  # a run longer than the slot: the consumer sends it direct
        return
    for c in parts:
        stage = np.zeros(slot, np.uint8)
        assert c.staged_bytes <= slot
        for s, o, n in zip(
            c.span_src.tolist(), c.span_stage.tolist(), c.span_len.tolist(), strict=True
        ):
            region = int(np.searchsorted(REGIONS[0], s, side="right")) - 1
            assert s + n <= REGIONS[1][region], "a span left its source region"
            stage[o : o + n] = src_mem[s : s + n]
        for d, o, n in zip(
            c.run_dst.tolist(), c.run_stage.tolist(), c.run_len.tolist(), strict=True
        ):
            got[d : d + n] = stage[o : o + n]
    assert np.array_equal(got, want)


def test_runs_touching_across_back_to_back_regions_stay_two_spans() -> None:
    """Regions [0, 1000) and [1000, 2500) adjoin: a run ending at 1000 and one starting
    there are two descriptors, one per region (hypothesis found this case)."""
    runs = Runs(np.array([984, 1000]), np.array([0, 16]), np.array([16, 1]))
    for gap in (0, 16):
        (c,) = chunks(runs, 100, gap, REGIONS)
        assert c.span_src.tolist() == [984, 1000] and c.span_len.tolist() == [16, 1]
    (c,) = chunks(runs, 100, 0, None)  # no regions known: touching runs join
    assert c.span_src.tolist() == [984] and c.span_len.tolist() == [17]


def test_a_head_split_reads_whole_blocks_over_the_other_halves() -> None:
    """NHD, 16 tokens a block, rows of 2 KiB of which this D rank needs 1 KiB."""
    blocks = np.array([5, 2, 9, 7], np.int64)  # P block ids, 32 KiB each
    tok = np.arange(16, dtype=np.int64)
    src = (blocks[:, None] * 32768 + tok * 2048).ravel()
    runs = Runs(src, np.arange(src.shape[0], dtype=np.int64) * 1024, np.full(src.shape[0], 1024))
    regions = (np.array([0], np.int64), np.array([10 * 32768], np.int64))
    assert sum(c.span_len.shape[0] for c in chunks(runs, 1 << 20)) == 64  # no gap: a run each
    (c,) = chunks(runs, 1 << 20, 1024, regions)
    # one span per block (2 and 5 are not adjacent; the last row's other half is not read)
    assert sorted(c.span_len.tolist()) == [31 * 1024] * 4
    assert chunks(runs, 1 << 20, 1024, None)[0].span_len.shape[0] == 64  # regions unknown


def test_gaps_never_join_across_regions() -> None:
    runs = Runs(np.array([900, 1010], np.int64), np.array([0, 100], np.int64), np.full(2, 50))
    (c,) = chunks(runs, 4096, 500, REGIONS)
    assert c.span_len.tolist() == [50, 50]  # 950 → 1010 is near, but 1000 starts a region
    (c,) = chunks(runs, 4096, 500, (np.array([0], np.int64), np.array([4096], np.int64)))
    assert c.span_len.tolist() == [160]


def test_stager_pulls_only_chunks_of_half_a_slot() -> None:
    """The next chunk's READ lands in the other half while one is scattered: a chunk
    longer than half a slot would overwrite bytes not yet scattered, so it is refused
    before anything is posted, and the slot is given back."""
    from kvbridge.connector.movers.staging import Stager
    from kvbridge.transport.base import Region
    from kvbridge.transport.loopback import Fabric, LoopbackTransport

    mem = np.zeros(1 << 16, np.uint8)
    stager = Stager([Region(int(mem.ctypes.data), mem.nbytes)], 1, 4096)
    runs = Runs(
        np.arange(64, dtype=np.int64) * 64, np.arange(64, dtype=np.int64) * 64, np.full(64, 64)
    )
    assert all(c.staged_bytes <= 2048 for c in stager.chunks(runs))
    too_big = chunks(runs, 4096)
    slot = stager.pool.take(0.0)
    assert slot is not None
    agent = LoopbackTransport("half-slot", Fabric())
    with pytest.raises(TransportError, match="exceeds half"):
        stager.pull(agent, {0: "nobody"}, {0: too_big}, slot, 0.0, [])
    assert stager.pool.take(0.0) == slot


def _trace(n: int, wait_first: bool, fail_at: str = "") -> tuple[list[str], list[int]]:
    from kvbridge.connector.movers.spans import rounds

    events: list[str] = []
    inflight: list[int] = []

    def start(i: int, at: int) -> int:
        events.append(f"start{i}@{at}")
        return i

    def wait(i: int) -> None:
        events.append(f"wait{i}")
        if fail_at == f"wait{i}":
            raise TransportError("stalled")

    def scatter(i: int, at: int) -> None:
        events.append(f"scatter{i}@{at}")
        if fail_at == f"scatter{i}":
            raise TransportError("bad copy")

    with contextlib.suppress(TransportError):
        rounds(list(range(n)), 100, start, wait, scatter, inflight, wait_first)
    return events, inflight


def test_pulled_rounds_keep_two_reads_in_flight_in_alternate_halves() -> None:
    events, inflight = _trace(3, wait_first=False)
    assert events == [
        "start0@0", "start1@100", "wait0", "scatter0@0",
        "start2@0", "wait1", "scatter1@100", "wait2", "scatter2@0",
    ]  # fmt: skip
    assert inflight == []


def test_pushed_rounds_start_the_next_once_the_last_landed_and_scatter_meanwhile() -> None:
    events, _ = _trace(3, wait_first=True)
    assert events == [
        "start0@0", "wait0", "start1@100", "scatter0@0",
        "wait1", "start2@0", "scatter1@100", "wait2", "scatter2@0",
    ]  # fmt: skip
    assert _trace(1, wait_first=True)[0] == ["start0@0", "wait0", "scatter0@0"]


@pytest.mark.parametrize("wait_first", [False, True])
def test_what_is_in_flight_when_a_round_fails_is_left_to_the_caller(wait_first: bool) -> None:
    _, inflight = _trace(4, wait_first, fail_at="wait1")
    assert inflight == ([1] if wait_first else [1, 2])  # the stalled one stays listed
    _, inflight = _trace(4, wait_first, fail_at="scatter0")
    assert inflight == [1]  # started before round 0 was copied out
