"""The per-request choice's arithmetic (:mod:`kvbridge.connector.movers.choice`): the probe's
three transfers give a link back exactly, a request is priced both ways with each source
rank direct or staged, a direction whose bytes are far slower is never taken, learning
moves one direction only, and the stager's exact choice takes the pair's costs."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from kvbridge.connector.load import Mode
from kvbridge.connector.movers.choice import (
    MARGIN,
    PROBE_RUN,
    SLOW,
    SLOW_NET_S,
    PairCosts,
    choose,
    price,
    slow,
    solve,
)
from kvbridge.connector.movers.staging import MIN_BYTE_S, MIN_DESC_S, CostModel, Link
from kvbridge.plan.runs import Runs


@dataclass(frozen=True)
class FakeStaging:  # what price() reads of a stager: its slot and local copy costs
    slot_bytes: int = 16 << 20
    per_run: float = 50e-9
    per_byte: float = 0.05e-9


def runs_of(n: int, size: int, ranks: int = 1) -> dict[int, Runs]:
    off = np.arange(n, dtype=np.int64) * size * 2
    return {r: Runs(off, off[::-1].copy(), np.full(n, size, np.int64)) for r in range(ranks)}


def times(link: Link, descs: int, big: int) -> tuple[float, float, float]:
    """What the probe's transfers take over ``link``."""
    one = link.round_s + link.desc_s + PROBE_RUN * link.byte_s
    many = link.round_s + descs * (link.desc_s + PROBE_RUN * link.byte_s)
    return one, many, link.round_s + link.desc_s + big * link.byte_s


@pytest.mark.parametrize(
    "link",
    [Link(50e-6, 1.5e-6, 0.2e-9), Link(400e-6, 4e-6, 0.02e-9), Link(5e-3, 0.1e-6, 2e-9)],
)
def test_the_probe_gives_the_link_back(link: Link) -> None:
    got = solve(*times(link, 256, 8 << 20), 256, 8 << 20)
    assert got.round_s == pytest.approx(link.round_s, rel=1e-6)
    assert got.desc_s == pytest.approx(link.desc_s, rel=1e-6)
    assert got.byte_s == pytest.approx(link.byte_s, rel=1e-6)


def test_a_probe_of_noise_stays_in_bounds() -> None:
    got = solve(1e-3, 0.5e-3, 0.9e-3, 256, 1 << 20)  # later transfers faster: noise
    assert (got.desc_s, got.byte_s) == (MIN_DESC_S, MIN_BYTE_S)
    assert got.round_s == pytest.approx(1e-3 - MIN_DESC_S - PROBE_RUN * MIN_BYTE_S)


def test_price_is_each_rank_direct_or_staged_whichever_is_cheaper() -> None:
    link = Link(100e-6, 2e-6, 0.25e-9)
    few = runs_of(10, 4096)
    assert price(link, few, False, FakeStaging()) == (
        pytest.approx(100e-6 + 10 * 2e-6 + 40960 * 0.25e-9),
        0,
    )
    many = runs_of(20_000, 256, ranks=2)  # 40,000 descriptors direct: 80 ms
    pulled, staged = price(link, many, False, FakeStaging())
    assert staged == 2 and pulled < 0.01
    pushed, staged = price(link, many, True, FakeStaging())
    assert staged == 2 and pushed > pulled  # two local copies per byte
    assert price(link, many, False, None)[1] == 0  # no stager: direct only


def pair(read: Link, write: Link, nbytes: int = 8 << 20) -> PairCosts:
    return PairCosts(read, write, never=slow(read, write, nbytes))


def test_the_same_pair_chooses_per_request() -> None:
    costs = pair(Link(50e-6, 5e-6, 0.2e-9), Link(400e-6, 1e-6, 0.2e-9))
    mode, why = choose(costs, runs_of(10, 4096), None)
    assert mode is Mode.PULL and "priced pull 0.10" in why
    mode, why = choose(costs, runs_of(10_000, 256), None)
    assert mode is Mode.PUSH and "auto: push, priced pull 50." in why, why


def test_push_needs_a_margin() -> None:
    read = Link(100e-6, 1e-6, 0.2e-9)
    just = Link(100e-6 / MARGIN * 1.1, 1e-6, 0.2e-9)  # a few µs cheaper, under MARGIN
    assert choose(pair(read, just), runs_of(1, 64), None)[0] is Mode.PULL


def test_a_direction_far_slower_per_byte_is_never_chosen() -> None:
    fast, tcp = Link(400e-6, 1e-6, 0.02e-9), Link(20e-6, 1e-6, 1e-9)  # 50 vs 1 GB/s
    mode, why = choose(pair(tcp, fast), runs_of(1, 64), None)  # priced, pull would win
    assert price(tcp, runs_of(1, 64), False, None)[0] < price(fast, runs_of(1, 64), True, None)[0]
    assert mode is Mode.PUSH and "never READ" in why
    assert choose(pair(fast, tcp), runs_of(1, 64), None)[0] is Mode.PULL  # and WRITE
    tiny = pair(tcp, fast, nbytes=int(SLOW_NET_S / tcp.byte_s) - 1)  # too few bytes to tell
    assert tiny.never == "" and choose(tiny, runs_of(1, 64), None)[0] is Mode.PULL


def test_nothing_measured_pulls_and_says_why() -> None:
    mode, why = choose(PairCosts(note="no free staging slot"), runs_of(1, 64), None)
    assert mode is Mode.PULL and "no free staging slot" in why


def test_learning_moves_one_direction() -> None:
    costs = pair(Link(50e-6, 2e-6, 0.25e-9), Link(50e-6, 2e-6, 0.25e-9))
    later = costs
    for _ in range(40):  # 16,384 runs of 1 KiB at 5 µs each, WRITE
        later = later.learned(True, 16_384, 16_384 * 1024, 50e-6 + 16_384 * (5e-6 + 1024 * 0.25e-9))
    assert later.write is not None and later.write.desc_s == pytest.approx(5e-6, rel=0.02)
    assert later.read == costs.read


def test_the_stager_weighs_the_pairs_link() -> None:
    """The same staged round: worth it where a descriptor costs 20 µs, not at 20 ns."""
    m = CostModel()
    args = dict(runs=2000, spans=4, nbytes=2000 * 512, rounds=1)
    assert m.staged_wins(**args, link=Link(100e-6, 20e-6, 0.25e-9))  # type: ignore[arg-type]
    assert not m.staged_wins(**args, link=Link(100e-6, 20e-9, 0.25e-9))  # type: ignore[arg-type]
    m.link = replace(m.link, desc_s=20e-9)  # the stager's own, where the pair was never measured
    assert not m.staged_wins(**args)  # type: ignore[arg-type]
    assert m.max_gap(Link(0, 2e-6, 1e-10)) == 20_000


def test_a_stalled_transfer_learned_never_bans_a_direction() -> None:
    """One direct 8 MiB READ that took a whole second moves READ's byte cost; whether a
    direction is never chosen stays what the probe found."""
    same = Link(50e-6, 2e-6, 0.25e-9)
    costs = pair(same, same)
    stalled = costs.learned(False, 128, 8 << 20, 1.0)
    assert stalled.read is not None and stalled.read.byte_s > SLOW * same.byte_s
    assert stalled.never == "" and "never" not in choose(stalled, runs_of(1, 64), None)[1]


def test_a_staged_push_is_priced_in_rounds_of_half_a_slot() -> None:
    from kvbridge.connector.movers.spans import chunks

    runs, st = runs_of(1024, 768), FakeStaging(slot_bytes=1 << 20)  # 768 KiB
    assert len(chunks(runs[0], st.slot_bytes // 2)) == 2  # what a staged push makes
    link = Link(1e-3, 10e-6, 1e-10)
    got, staged = price(link, runs, True, st)
    n, b = 1024, 1024 * 768
    copies = 2 * (n * st.per_run + b * st.per_byte)
    rounds = 2 * (link.round_s + link.desc_s)
    assert staged == 1 and got == pytest.approx(rounds + b * link.byte_s + copies)


def test_a_push_to_several_ranks_is_priced_and_learned_at_one_round() -> None:
    link = Link(400e-6, 2e-6, 0.25e-9)
    costs = pair(link, link)
    priced, _ = price(link, runs_of(256, 1024, ranks=4), True, None)
    assert priced == pytest.approx(400e-6 + 4 * 256 * (2e-6 + 1024 * 0.25e-9))  # asked at once
    for _ in range(30):  # a direct push of 4 ranks that took exactly its price
        costs = costs.learned(True, 4 * 256, 4 * 256 * 1024, priced)
    assert costs.write is not None and costs.write.desc_s == pytest.approx(2e-6, rel=1e-6)


@pytest.mark.parametrize("spare", [0.9, 1.1])
def test_a_staged_push_is_charged_the_rounds_it_runs_beyond_direct(
    spare: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct push of a rank is one round (the rank asked, its notification); staged,
    it is one round per chunk of half a slot: here 2, one more. With local copies free
    and bytes free, staging spares 1022 descriptors and costs 1 round: the stager stages
    where the round costs less than those descriptors and not where it costs more, as
    :func:`price` does."""
    from kvbridge.connector.movers import staging
    from kvbridge.connector.movers.push import choose_push
    from kvbridge.connector.movers.staging import Stager
    from kvbridge.transport.base import Region

    buf = np.zeros(4 << 20, np.uint8)
    stager = Stager([Region(int(buf.ctypes.data), buf.nbytes)], 2, 1 << 20)
    costs = stager.costs
    costs.per_run = costs.per_byte = costs.whole_run = costs.whole_byte = 0.0
    costs.per_byte_strided = 0.0
    monkeypatch.setattr(staging, "VIEW_S", 0.0)
    runs, desc_s = runs_of(1024, 768), 1e-6  # 768 KiB in slots of 1 MiB
    link = Link((1024 - 2) * desc_s * spare, desc_s, 0.0)
    plan = choose_push(stager, runs, link)
    assert (plan is not None) == (spare < 1)
    if plan is not None:
        assert len(plan.rounds) == 2 and plan.ranks == {0}  # the rounds that run
    zero = FakeStaging(slot_bytes=1 << 20, per_run=0.0, per_byte=0.0)
    assert price(link, runs, True, zero)[1] == (spare < 1)
