"""The scheduler side of parking (integrations/vllm/park_book.py): the vLLM blocks of each
request prefilled for remote decode, followed through the scheduler's outputs (whole and
chunked prompts, preemption), copied to park slots in the step completing the prompt;
the handle's tables at the end, and the slots given back."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from kvbridge.integrations.vllm.park_book import ParkBook


def orders(book: ParkBook, scheduled: Any) -> list[tuple[str, list, list]]:
    """:meth:`ParkBook.orders` as lists (the book keeps numpy arrays)."""
    return [
        (r, [a.tolist() for a in b], [a.tolist() for a in s]) for r, b, s in book.orders(scheduled)
    ]


def settle(book: ParkBook, rid: str, final: list[list[int]], ok: bool) -> list | None:
    got = book.settle(rid, final, ok)
    return None if got is None else [a.tolist() for a in got]


def new(rid: str, blocks: list[list[int]], computed: int = 0) -> Any:
    return NS(req_id=rid, block_ids=tuple(blocks), num_computed_tokens=computed)


def step(
    sched: dict[str, int],
    news: tuple[Any, ...] = (),
    cached: dict[str, tuple[list[list[int]] | None, int]] | None = None,
    resumed: tuple[str, ...] = (),
) -> Any:
    c = cached or {}
    return NS(
        num_scheduled_tokens=sched,
        scheduled_new_reqs=list(news),
        scheduled_cached_reqs=NS(
            req_ids=list(c),
            new_block_ids=[v[0] for v in c.values()],
            num_computed_tokens=[v[1] for v in c.values()],
            resumed_req_ids=set(resumed),
        ),
    )


def test_a_whole_prompt_is_parked_and_its_slots_come_back() -> None:
    book = ParkBook(8, 2)
    book.watch("a", 40)
    assert orders(book, step({"x": 3})) == []  # not scheduled yet
    (order,) = orders(book, step({"a": 40}, (new("a", [[7, 9, 11], [0, 12]]),)))
    rid, blocks, slots = order
    assert (rid, blocks) == ("a", [[7, 9, 11], [0, 12]])
    assert slots[1][0] == 0 and sorted(s for t in slots for s in t if s) == [1, 2, 3, 4]
    mapped = settle(book, "a", [[7, 9, 11], [0, 12]], True)
    assert mapped == slots
    assert len(book.free) == 3  # 7 slots, one per non-null block held
    book.ended("a")
    assert sorted(book.free) == list(range(1, 8))


def test_a_chunked_prompt_is_parked_in_its_last_chunk_with_every_block() -> None:
    book = ParkBook(16, 1)
    book.watch("a", 100)
    assert orders(book, step({"a": 64}, (new("a", [[3, 4]]),))) == []
    (order,) = orders(book, step({"a": 36}, cached={"a": ([[5, 6]], 64)}))
    assert order[1] == [[3, 4, 5, 6]]
    assert settle(book, "a", [[3, 4, 5, 6]], True) == order[2]


def test_a_resumed_request_replaces_its_blocks() -> None:
    book = ParkBook(16, 1)
    book.watch("a", 100)
    orders(book, step({"a": 64}, (new("a", [[3, 4]]),)))
    (order,) = orders(book, step({"a": 100}, cached={"a": ([[8, 9, 10, 11]], 0)}, resumed=("a",)))
    assert order[1] == [[8, 9, 10, 11]]


def test_without_free_slots_the_request_is_not_parked() -> None:
    book = ParkBook(3, 1)  # slots 1, 2
    book.watch("a", 10)
    assert orders(book, step({"a": 10}, (new("a", [[1, 2, 3]]),))) == []
    assert settle(book, "a", [[1, 2, 3]], True) is None
    assert sorted(book.free) == [1, 2]


def test_blocks_not_those_copied_are_not_served_from_the_park() -> None:
    book = ParkBook(10, 1)
    for rid in "abcd":
        book.watch(rid, 10)
    got = orders(book, step({r: 10 for r in "abcd"}, tuple(new(r, [[1, 2]]) for r in "abcd")))
    assert len(got) == 4
    assert settle(book, "a", [[1, 5]], True) is None  # another block at place 1
    assert settle(book, "b", [[1, 2, 3]], True) is None  # more blocks than copied
    assert settle(book, "c", [[0, 2]], True) == [[0, book.held["c"][0]]]  # dropped: null
    # fewer (a lookahead block of speculative decoding not counted): the prefix
    assert settle(book, "d", [[1]], True) == [[book.held["d"][0]]]
    assert len(book.free) == 9 - 2  # c's dropped block's and d's tail's slots back


def test_a_request_that_did_not_end_prefilled_gives_its_slots_back() -> None:
    book = ParkBook(8, 1)
    book.watch("a", 10)
    orders(book, step({"a": 10}, (new("a", [[1, 2]]),)))
    assert settle(book, "a", [[1, 2]], False) is None
    assert len(book.free) == 7 and not book.held


def test_an_id_still_parked_is_not_parked_again() -> None:
    book = ParkBook(8, 1)
    book.watch("a", 10)
    orders(book, step({"a": 10}, (new("a", [[1]]),)))
    settle(book, "a", [[1]], True)
    book.watch("a", 10)  # the same request id again, its first park lease held
    assert orders(book, step({"a": 10}, (new("a", [[2]]),))) == []
    assert settle(book, "a", [[2]], True) is None
    book.ended("a")
    assert len(book.free) == 7


def test_only_blocks_d_reads_take_slots_and_are_copied() -> None:
    """A sliding window over the last 2 of 4 blocks (group 0), all blocks (group 1): the
    window's earlier blocks get no slot, are not copied, and are null in the handle's
    tables, whatever vLLM's table holds there at the end."""
    book = ParkBook(8, 2, keep=lambda g, n: range(2, 4) if g == 0 else range(1 << 62))
    book.watch("a", 128)
    ((_, copied, slots),) = orders(book, step({"a": 128}, (new("a", [[1, 2, 3, 4], [5, 6]]),)))
    assert copied[0] == [0, 0, 3, 4] and slots[0][:2] == [0, 0] and all(slots[0][2:])
    assert copied[1] == [5, 6] and all(slots[1])
    assert len(book.free) == 3 and book.taken == 4
    assert settle(book, "a", [[0, 2, 3, 4], [5, 6]], True) == [[0, 0, *slots[0][2:]], slots[1]]


def test_a_request_first_seen_as_cached_is_not_followed() -> None:
    """vLLM names a request new before it names it cached; one that is not (the book was
    made after it was scheduled) is never parked, and no step fails on it."""
    book = ParkBook(8, 1)
    book.watch("a", 100)
    assert orders(book, step({"a": 36}, cached={"a": ([[5, 6]], 64)})) == []
    assert orders(book, step({"a": 1}, cached={"a": (None, 100)})) == []
    assert settle(book, "a", [[3, 4, 5, 6]], True) is None
