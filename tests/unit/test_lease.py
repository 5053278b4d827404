"""P's lease table on its own, with a clock the test moves: replies carry the time left
as a duration (P's monotonic clock means nothing on D), and a lapsed lease frees once."""

from __future__ import annotations

from kvbridge.control.lease import LeaseState, LeaseTable
from kvbridge.control.messages import LeaseOp, LeaseOpName, LeaseReply, seal, unseal


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def op(name: LeaseOpName, d_rank: int = 0, token: str = "") -> LeaseOp:
    return LeaseOp(name, "r1", "L1", "digest", "D", d_rank, 2, "e", token)


def test_replies_carry_the_seconds_left_not_p_clock() -> None:
    clock = Clock(1000.0)
    table = LeaseTable(30.0, clock)
    table.grant("r1", "L1", [[3, 4]], "digest")
    clock.now = 1010.0
    assert table.on_op(op("confirm")) == LeaseReply("held", 20.0)
    assert table.on_op(op("renew")) == LeaseReply("held", 30.0)
    reply = unseal(seal(table.on_op(op("begin", 1)), b"k"), b"k")
    assert isinstance(reply, LeaseReply) and (reply.state, reply.remaining_s) == ("held", 30.0)
    assert len(reply.token) == 32


def test_a_lapsed_lease_answers_expired_and_frees_its_blocks_once() -> None:
    clock = Clock(0.0)
    table = LeaseTable(5.0, clock)
    table.grant("r1", "L1", [[3, 4]], "digest")
    clock.now = 5.0
    assert table.on_op(op("confirm")) == LeaseReply("expired", 0.0)
    freed = table.drain_freed()
    assert [(f.request_id, f.tables, f.reason) for f in freed] == [
        ("r1", [[3, 4]], LeaseState.EXPIRED)
    ]
    assert table.drain_freed() == []


def test_begin_is_accepted_once_per_d_rank() -> None:
    table = LeaseTable(30.0, Clock(0.0))
    table.grant("r1", "L1", [[3, 4]], "digest")
    token = table.on_op(op("begin", 0)).token
    assert table.on_op(op("begin", 0)).state == "refused"  # replayed or repeated
    assert table.on_op(op("begin", 1)).state == "held"  # another D rank of the request
    assert table.on_op(op("renew", 0, token)).state == "held"


def test_renewals_cannot_hold_a_lease_past_its_maximum() -> None:
    clock = Clock(0.0)
    table = LeaseTable(5.0, clock, max_hold_s=12.0)
    table.grant("r1", "L1", [[3, 4]], "digest")
    for t in (4.0, 8.0, 11.0):
        clock.now = t
        assert table.on_op(op("renew")).state == "held"
    assert table.on_op(op("renew")).remaining_s == 1.0  # capped at grant + 12 s
    clock.now = 12.0
    assert table.on_op(op("renew")).state == "expired"
    assert [f.reason for f in table.drain_freed()] == [LeaseState.EXPIRED]


def test_an_abort_waits_for_the_d_ranks_that_began() -> None:
    """A D rank that began may count on the time its begin reply granted: P's abort
    frees only when every rank that began has reported (or at the deadline)."""
    clock = Clock(0.0)
    table = LeaseTable(30.0, clock)
    table.grant("r1", "L1", [[3, 4]], "digest")
    began = table.on_op(op("begin", 0))
    assert (began.state, began.remaining_s) == ("held", 30.0)
    assert table.abort("r1") and not table.abort("r1")
    assert table.drain_freed() == []  # rank 0 is still reading
    assert table.on_op(op("begin", 1)).state == "expired"  # no new reader
    assert table.on_op(op("renew", 1)).state == "expired"
    clock.now = 10.0
    assert table.on_op(op("confirm", 0, began.token)) == LeaseReply("held", 20.0)  # bytes stood
    assert [f.reason for f in table.drain_freed()] == [LeaseState.ABORTED]
    assert table.held() == 0


def test_an_abort_with_no_reader_frees_at_once_and_a_waiting_one_expires() -> None:
    clock = Clock(0.0)
    table = LeaseTable(30.0, clock)
    table.grant("r1", "L1", [[3, 4]], "digest")
    table.grant("r2", "L1", [[5]], "digest")
    assert table.on_op(LeaseOp("fail", "r1", "L1", "digest", "D", 0, 2)).state == "held"
    assert table.abort("r1")  # its only reader reported: nothing is reading
    assert [f.request_id for f in table.drain_freed()] == ["r1"]
    assert table.on_op(LeaseOp("begin", "r2", "L1", "digest", "D", 1, 2, "e")).state == "held"
    assert table.abort("r2")
    clock.now = 29.0
    assert table.drain_freed() == []
    clock.now = 30.0  # the reader never reported: freed at the deadline it was granted
    assert [f.reason for f in table.drain_freed()] == [LeaseState.EXPIRED]


def test_a_rank_that_reported_cannot_begin_again_and_so_read_past_a_free() -> None:
    """A rank's ``fail`` before P saw its ``begin`` (or a load retried after an outcome)
    must not let it begin afterwards: P would count it reported and free the blocks on an
    abort, or once the other ranks confirm, while it reads them on lease time."""
    table = LeaseTable(30.0, Clock(0.0))
    table.grant("r1", "L1", [[3, 4]], "digest")
    assert table.on_op(op("fail", 0)).state == "held"
    assert table.on_op(op("begin", 0)).state == "refused"
    token = table.on_op(op("begin", 1)).token
    assert table.abort("r1")
    assert table.drain_freed() == []  # rank 1 began and has not reported
    assert table.on_op(op("confirm", 1)).state == "foreign"  # no token: not rank 1's word
    assert table.on_op(op("confirm", 1, token)).state == "held"
    assert [f.reason for f in table.drain_freed()] == [LeaseState.ABORTED]
