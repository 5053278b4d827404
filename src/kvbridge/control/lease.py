"""P-side leases: one state machine per request.

    HELD ──all D ranks reported──► DONE
      │ ──abort────────────────► ABORTED
      └─deadline passed────────► EXPIRED

Leaving HELD frees the request's blocks exactly once. A D rank's ``confirm`` is
answered ``held`` only while the lease is HELD and before its deadline; anything later
(or a request P does not know) is ``expired``, so D never reports success for bytes
read after P may have reused the blocks. Each D rank's ``begin`` is accepted once (a
second is ``refused``), and renewals never hold a lease past ``max_hold_s`` after it was
granted: a D that stalls, or keeps renewing, cannot pin P's blocks for ever.

An abort frees at once only when no D rank is reading: once a rank's ``begin`` was
answered ``held``, P keeps the blocks until that rank reports or the deadline passes
(then ABORTED; EXPIRED if the deadline comes first). A rank may then count the lease as
held for as long as the ``begin`` reply said, without asking again after its last byte
landed (:class:`kvbridge.connector.consumer.Consumer` does, within half that time); so a
rank that reported may not ``begin`` again. While an abort waits, ``begin`` and ``renew``
are answered ``expired``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.control.messages import LeaseOp, LeaseReply


class LeaseState(enum.Enum):
    HELD = "held"
    DONE = "done"
    ABORTED = "aborted"
    EXPIRED = "expired"


class Event(enum.Enum):
    ALL_REPORTED = "all_reported"
    ABORT = "abort"
    DEADLINE = "deadline"


TRANSITIONS: dict[tuple[LeaseState, Event], LeaseState] = {
    (LeaseState.HELD, Event.ALL_REPORTED): LeaseState.DONE,
    (LeaseState.HELD, Event.ABORT): LeaseState.ABORTED,
    (LeaseState.HELD, Event.DEADLINE): LeaseState.EXPIRED,
}


@dataclass(slots=True)
class Lease:
    request_id: str
    lease_id: str
    tables: list[list[int]]
    digest: str
    deadline: float
    state: LeaseState = LeaseState.HELD
    reported: set[int] = field(default_factory=set)
    begun: set[int] = field(default_factory=set)
    granted: float = 0.0
    aborting: bool = False
    """Aborted while a D rank that began had not reported: freed once they have."""


@dataclass(frozen=True, slots=True)
class Freed:
    """Blocks the P engine may reuse now."""

    request_id: str
    tables: list[list[int]]
    reason: LeaseState


class LeaseTable:
    """Thread-safe; time is ``time.monotonic()`` unless a clock is given."""

    def __init__(
        self,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_hold_s: float | None = None,
    ):
        """``max_hold_s``: the longest a lease can be held, renewals included (default
        ten lease periods)."""
        self.lease_s = lease_s
        self.max_hold_s = 10 * lease_s if max_hold_s is None else max_hold_s
        self.clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, Lease] = {}
        self._freed: list[Freed] = []

    def grant(self, request_id: str, lease_id: str, tables: list[list[int]], digest: str) -> Lease:
        with self._lock:
            if request_id in self._held:
                raise ValueError(f"request {request_id!r} already holds a lease")
            now = self.clock()
            lease = Lease(request_id, lease_id, tables, digest, now + self.lease_s, granted=now)
            self._held[request_id] = lease
            return lease

    def on_op(self, op: LeaseOp) -> LeaseReply:
        with self._lock:
            self._expire_locked()
            lease = self._held.get(op.request_id)
            if lease is None or lease.lease_id != op.lease_id:
                return LeaseReply("expired")
            if op.tables_digest != lease.digest:
                return LeaseReply("mismatch")
            if op.d_rank not in range(op.d_world):
                return LeaseReply("mismatch")
            if op.op == "begin" and op.d_rank in lease.begun | lease.reported:
                return LeaseReply("refused")  # a rank that reported may not read again
            if lease.aborting and op.op in ("begin", "renew"):
                return LeaseReply("expired")
            if op.op in ("begin", "renew"):
                if op.op == "begin":
                    lease.begun.add(op.d_rank)
                until = min(self.clock() + self.lease_s, lease.granted + self.max_hold_s)
                lease.deadline = max(lease.deadline, until)
            else:  # confirm / fail: this D rank is finished with the blocks
                lease.reported.add(op.d_rank)
                left = max(lease.deadline - self.clock(), 0.0)
                if lease.aborting and lease.begun <= lease.reported:
                    self._move(lease, Event.ABORT)
                elif len(lease.reported) >= op.d_world and lease.begun <= lease.reported:
                    self._move(lease, Event.ALL_REPORTED)
                return LeaseReply("held", left)
            return LeaseReply("held", max(lease.deadline - self.clock(), 0.0))

    def abort(self, request_id: str) -> bool:
        """End ``request_id``'s lease for P's own reasons; False if it holds none (or is
        already aborting). D ranks still reading keep its blocks until they report."""
        with self._lock:
            lease = self._held.get(request_id)
            if lease is None or lease.aborting:
                return False
            if lease.begun <= lease.reported:
                self._move(lease, Event.ABORT)
            else:
                lease.aborting = True
            return True

    def drain_freed(self) -> list[Freed]:
        with self._lock:
            self._expire_locked()
            out, self._freed = self._freed, []
            return out

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _expire_locked(self) -> None:
        now = self.clock()
        for lease in [x for x in self._held.values() if x.deadline <= now]:
            self._move(lease, Event.DEADLINE)

    def _move(self, lease: Lease, event: Event) -> None:
        lease.state = TRANSITIONS[(lease.state, event)]
        del self._held[lease.request_id]
        self._freed.append(Freed(lease.request_id, lease.tables, lease.state))
