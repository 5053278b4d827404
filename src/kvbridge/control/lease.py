"""P-side leases: one state machine per request.

    HELD ──all D ranks reported (each that began, with its token)──► DONE
      │ ──abort──────────────────────────────────────────────────────► ABORTED
      └─deadline passed──────────────────────────────────────────────► EXPIRED

Leaving HELD frees the request's blocks exactly once. A lease belongs to the D ranks that
began it: each rank's ``begin`` is accepted once and answered with a token its later ops
must carry; an abort waits for the ranks that began. The rules and why: ``docs/faults.md``
(leases).
"""

from __future__ import annotations

import enum
import hmac
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvbridge.control.messages import LeaseOp, LeaseReply

Clock = Callable[[], float]


class LeaseState(enum.Enum):
    HELD = "held"
    DONE = "done"
    ABORTED = "aborted"
    EXPIRED = "expired"


REFUSALS: dict[str, Literal["refused", "foreign"]] = {
    "begun twice": "refused",  # a second begin from the same rank
    "reported": "refused",  # a begin from a rank that reported
    "other engine": "foreign",  # the lease was begun by another D engine id
    "other epoch": "foreign",  # this rank began under another D epoch
    "other world": "foreign",  # a D world other than the one that began
    "token required": "foreign",  # no token for a rank that began
    "unknown token": "foreign",
    "other identity": "foreign",  # another rank's token, or from another engine / epoch
}
"""Why an op is refused → the reply's state."""


@dataclass(frozen=True, slots=True)
class Owner:
    """The D rank that began a lease, and the token its later ops carry."""

    engine: str
    epoch: str
    token: str


@dataclass(slots=True)
class Lease:
    request_id: str
    lease_id: str
    tables: list[list[int]]
    digest: str
    deadline: float
    reported: set[int] = field(default_factory=set)
    owners: dict[int, Owner] = field(default_factory=dict)
    """The D ranks that began, by rank."""
    d_world: int = 0
    """The D world of the first ``begin`` (0: none yet)."""
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
        self, lease_s: float, clock: Clock = time.monotonic, max_hold_s: float | None = None
    ):
        """``max_hold_s``: the longest a lease is held, renewals included (default 10 leases)."""
        self.lease_s = lease_s
        self.max_hold_s = 10 * lease_s if max_hold_s is None else max_hold_s
        self.clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, Lease] = {}
        self._freed: list[Freed] = []
        self.refused: Counter[str] = Counter()
        """Ops refused, by cause (a :data:`REFUSALS` key)."""

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
            if op.tables_digest != lease.digest or op.d_rank not in range(op.d_world):
                return LeaseReply("mismatch")
            why = refusal(lease, op)
            if why:
                self.refused[why] += 1
                return LeaseReply(REFUSALS[why], reason=why)
            if op.op in ("begin", "renew"):
                if lease.aborting:
                    return LeaseReply("expired")
                token = secrets.token_hex(16) if op.op == "begin" else ""
                if token:  # the rank's own from now on: its later ops carry the token
                    lease.owners[op.d_rank] = Owner(op.d_engine, op.d_epoch, token)
                    lease.d_world = op.d_world
                until = min(self.clock() + self.lease_s, lease.granted + self.max_hold_s)
                lease.deadline = max(lease.deadline, until)
                return LeaseReply("held", self._left(lease), token=token)
            # confirm / fail: this D rank is finished with the blocks
            lease.reported.add(op.d_rank)
            left, done = self._left(lease), lease.owners.keys() <= lease.reported
            if done and (lease.aborting or len(lease.reported) >= op.d_world):
                self._move(lease, LeaseState.ABORTED if lease.aborting else LeaseState.DONE)
            return LeaseReply("held", left)

    def _left(self, lease: Lease) -> float:
        return max(lease.deadline - self.clock(), 0.0)

    def abort(self, request_id: str) -> bool:
        """End ``request_id``'s lease for P's own reasons; False if it holds none (or is
        already aborting). D ranks still reading keep its blocks until they report."""
        with self._lock:
            lease = self._held.get(request_id)
            if lease is None or lease.aborting:
                return False
            if lease.owners.keys() <= lease.reported:
                self._move(lease, LeaseState.ABORTED)
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
            self._move(lease, LeaseState.EXPIRED)

    def _move(self, lease: Lease, to: LeaseState) -> None:
        """Leave HELD (each lease once: it is dropped from the table here)."""
        del self._held[lease.request_id]
        self._freed.append(Freed(lease.request_id, lease.tables, to))


def refusal(lease: Lease, op: LeaseOp) -> str:
    """Why ``op`` may not act on ``lease`` (a :data:`REFUSALS` key; "" when it may)."""
    first = next(iter(lease.owners.values()), None)
    if first is not None and op.d_engine != first.engine:
        return "other engine"
    if lease.d_world and op.d_world != lease.d_world:
        return "other world"
    mine = lease.owners.get(op.d_rank)
    if op.op == "begin":
        if mine is not None:
            same = (mine.engine, mine.epoch) == (op.d_engine, op.d_epoch)
            return "begun twice" if same else "other epoch"
        return "reported" if op.d_rank in lease.reported else ""
    if not op.token:
        return "" if mine is None else "token required"
    if mine is None or not hmac.compare_digest(mine.token, op.token):
        known = any(hmac.compare_digest(o.token, op.token) for o in lease.owners.values())
        return "other identity" if known else "unknown token"
    return "" if (mine.engine, mine.epoch) == (op.d_engine, op.d_epoch) else "other identity"
