"""A D rank's load of one request: its states, its record, and what it reports."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.peers import Peer
from kvbridge.control.messages import LeaseOpName, LeaseReply, Message, tables_digest
from kvbridge.errors import LeaseExpired, PeerError
from kvbridge.plan.tables import Tables
from kvbridge.spec.model import ModelSpec
from kvbridge.transport.base import XferHandle

if TYPE_CHECKING:
    from kvbridge.connector.movers.kernel import Launched, Over
    from kvbridge.plan.plan import Plan


@dataclass(frozen=True, slots=True)
class Started:
    """What a load's start on the engine's thread did (:mod:`kvbridge.connector.inline`):
    the plan (None: planning failed with ``error``), P's answer to take, and the load's
    start (``perf_counter``: the end of its ``queue`` stage)."""

    plan: Plan | None
    answer: Answer
    error: Exception | None
    t0: float


class Policy(enum.StrEnum):
    RECOMPUTE = "recompute"
    FAIL = "fail"


class Mode(enum.StrEnum):
    PULL = "pull"
    """D reads P's blocks."""
    PUSH = "push"
    """D sends its plan; each P rank writes into D's blocks and notifies."""
    AUTO = "auto"
    """Per request, pull or push, whichever costs less by what D measured with the P
    epoch (:mod:`kvbridge.connector.movers.choice`): never a direction whose bytes are priced
    far above the other's (READ emulated over TCP between GPUs without RDMA)."""


class LoadState(enum.Enum):
    QUEUED = "queued"
    HANDSHAKE = "handshake"
    TRANSFER = "transfer"
    VERIFY = "verify"
    DONE = "done"
    FAILED = "failed"


_NEXT = {
    LoadState.QUEUED: LoadState.HANDSHAKE,
    LoadState.HANDSHAKE: LoadState.TRANSFER,
    LoadState.TRANSFER: LoadState.VERIFY,
    LoadState.VERIFY: LoadState.DONE,
}
"""A load's one way forward (any state but DONE may end FAILED, set by the failure path)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    ok: bool
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    failed_blocks: list[list[int]] = field(default_factory=list)
    """Local block ids per group whose contents are not valid (failures only)."""
    action: Policy = Policy.RECOMPUTE
    error: str = ""
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds per stage: queue, handshake, plan, lease (what was left to wait for P's
    ``begin`` reply after planning; where the kernel mover takes it while its copies run,
    a part of ``transfer``, not added to it), post, transfer, verify. A load started on
    the engine's thread (:attr:`Consumer.inline`) has ``queue`` (sending ``begin``
    there), ``launch`` (the kernel mover's copies started there) and ``handoff`` (until a
    worker took it over, while P answered and the copies ran)."""
    staged_runs: int = 0
    """Runs moved through the staging area (``descriptors`` counts what was posted:
    the direct runs plus the staged spans)."""
    verified: str = ""
    """How success was established: ``lease time`` (the last byte landed well within the
    time P's ``begin`` reply granted) or ``at P`` (P answered that the lease still held)."""
    mover: str = ""
    """How the bytes moved: ``kernel`` (P's memory mapped here, one copy kernel), ``pull``
    or ``push`` (over the transport, direct or staged)."""
    reason: str = ""
    """Why that mover (e.g. why the kernel mover could not serve this request)."""


NO_TABLES = Tables((), ())
"""The tables of a load that moves nothing (a release, a load refused before it began)."""


@dataclass(slots=True)
class _Load:
    handle: TransferHandle
    tables: Tables
    """D's block tables, checked once (:meth:`Consumer.load`)."""
    cached: int
    state: LoadState = LoadState.QUEUED
    stages: dict[str, float] = field(default_factory=dict)
    mark: float = field(default_factory=time.perf_counter)
    queued: float = field(default_factory=time.monotonic)
    """When :meth:`Consumer.load` queued it: a P that left a call unanswered since then
    fails it at once (:meth:`Client.call`'s ``since``)."""
    posted: int = 0
    staged_runs: int = 0
    peer: Peer | None = None
    live: list[XferHandle] = field(default_factory=list)
    """Transfers still running when the load failed (fenced until they end)."""
    slot: int | None = None
    """The staging slot a live READ may still write into."""
    pushed: list[int] = field(default_factory=list)
    """P ranks asked to write (push): each must say its writes ended before a failure
    is reported."""
    token: str = ""
    """The lease token P's ``begin`` reply gave (confirm and fail carry it)."""
    refused: bool = False
    """P answered ``begin`` refused or foreign: nothing of the lease is this rank's."""
    nonce: str = ""
    """Push: issued by D for this load; retired when it ends."""
    no_kernel: str = ""
    """Why the kernel mover does not serve this load; set when the load is planned."""
    mapped: Over | None = None
    """Where the kernel mover serves it: the geometry over the memory it mapped that the
    plan was made in (with the offsets of P's regions there, per P rank)."""
    answer: Callable[[], object] | None = None
    """Takes P's ``begin`` answer (raising unless the lease is held): a mover that may run
    before it was taken (the kernel mover) calls it once its copies are launched, before
    waiting for them."""
    started: Started | None = None
    """What its start on the engine's thread did, until a worker runs it (else
    :meth:`Consumer.close` ends it)."""
    launched: Launched | None = None
    """Kernel copies started on the engine's thread (:meth:`Consumer.load`'s inline
    start), ended by the mover's run in a worker (or by the failure path)."""
    launched_by: tuple[str, str] | None = None
    """(mover, why) of a load an early mover started on the engine's thread."""
    direction: tuple[Mode, str] | None = None
    """Pull or push for this load and why (:func:`kvbridge.connector.movers.registry.direction`)."""
    planned_in: str = ""
    """The mover whose own geometry the load was planned in, the only one that may move
    it ("": the pair's geometry, any mover)."""
    digest: str = ""
    """:func:`tables_digest` of the handle, that every lease op carries (made once)."""

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = tables_digest(self.handle.block_tables, self.handle.n_tokens)

    def move(self, to: LoadState) -> None:
        """The next state of QUEUED → HANDSHAKE → TRANSFER → VERIFY → DONE."""
        assert _NEXT.get(self.state) is to, (self.state, to)
        self.state = to

    def lap(self, stage: str) -> None:
        """Close ``stage``: the seconds since the previous lap (or since queued)."""
        now = time.perf_counter()
        self.stages[stage] = now - self.mark
        self.mark = now


def failed_blocks(spec: ModelSpec, job: _Load) -> list[list[int]]:
    """Per spec group, the D blocks a failed ``job`` may have written: all of a state
    group's, the rest from the first uncached block."""
    out = []
    for g, grp in enumerate(spec.groups):
        if g < len(job.tables):
            first = 0 if spec.is_state_group(g) else job.cached // grp.block_size
            out.append(job.tables[g][first:].tolist())
        else:
            out.append([])
    return out


class Answer:
    """P's reply to a load's ``begin`` (sent at ``sent``, ``time.monotonic()``), taken
    once (:meth:`take`), then kept: the lease seconds left, or the typed error every
    later :meth:`take` raises again."""

    def __init__(self, reply: Callable[[], Message], job: _Load, sent: float):
        self._reply: Callable[[], Message] | None = reply
        self._job, self.sent = job, sent
        self._left = 0.0
        self._error: BaseException | None = None
        self.waited = 0.0
        """Seconds spent waiting for the reply."""

    def take(self, quiet: bool = False) -> float:
        """Wait for the reply (the first call), check it, its token kept for the rank's
        later ops → lease seconds left; ``quiet``: raise nothing (the caller is failing
        already, or takes the answer again later)."""
        if self._reply is not None:
            reply, self._reply = self._reply, None
            t0, job = time.perf_counter(), self._job
            try:
                msg = reply()
                if isinstance(msg, LeaseReply):
                    job.token, job.refused = msg.token, msg.state in ("refused", "foreign")
                self._left = checked_reply(job.handle, "begin", msg).remaining_s
            except BaseException as exc:  # kept: no later take may pass unchecked
                self._error = exc
            self.waited = time.perf_counter() - t0
        if self._error is not None and not quiet:
            raise self._error
        return self._left


def checked_reply(h: TransferHandle, op: LeaseOpName, reply: Message) -> LeaseReply:
    """P's answer to ``op``; anything but ``held`` raised as a typed error."""
    if not isinstance(reply, LeaseReply):
        raise PeerError(f"lease {op}: unexpected reply {type(reply).__name__}")
    rid = h.request_id
    if reply.state == "mismatch":
        raise PeerError(f"handle of {rid!r} does not match what P holds for it")
    if reply.state == "refused":
        why = "from this D rank (it began or reported already)"
        raise PeerError(f"P refused {op} of {rid!r} {why}")
    if reply.state == "foreign":
        raise PeerError(f"P refused {op} of {rid!r}: {reply.reason} (not this D's lease)")
    if reply.state != "held":
        raise LeaseExpired(f"lease of {rid!r} {reply.state} at {op}")
    return reply
