"""D's half of push mode: each P rank writes its runs into D's blocks direct, or (many
small runs) into D's staging slot, round by round, D scattering a round once every
notification of it arrived (``docs/faults.md``, staged push; P's half: :mod:`.push_gather`).
A failed load keeps the slot until the fence (:mod:`kvbridge.connector.fence`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbridge.connector.load import _Load
from kvbridge.connector.movers.spans import rounds
from kvbridge.connector.movers.staging import Chunk, Link, Stager
from kvbridge.connector.peers import Peer
from kvbridge.control.messages import Message, PushRefused, PushReply, PushRuns
from kvbridge.errors import PeerError, PushRefusedError
from kvbridge.plan.runs import Runs


@dataclass(frozen=True, slots=True)
class Pusher:
    """``job``'s pushes from D rank ``who`` = (engine id, epoch, rank, world; transport
    metadata ``agent``), bound to its lease (:class:`.push_gather.PushLedger`) by its
    ``begin`` token, D's epoch and engine id and the load's nonce. ``job.pushed`` gets
    each P rank before it is asked (it may write even if the call fails)."""

    peer: Peer
    job: _Load
    who: tuple[str, str, int, int]
    agent: bytes

    def notif(self, src: int) -> str:
        """The notification of P rank ``src``'s writes (a staged round appends to it)."""
        return f"kvb:{self.job.handle.request_id}:{self.job.nonce}:{src}:{self.who[2]}"

    def ask(
        self,
        src: int,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray],
        notif: bytes,
        part: tuple[int, bool] = (0, True),
        staged: bool = False,
    ) -> Callable[[], int]:
        """Ask P rank ``src`` to write ``runs`` (its sources, D's destinations, lengths)
        as message ``part`` = (number, the last to that rank) of the load → what takes
        P's answer, the descriptors it posted (call it once: the channel waits for it)."""
        s, d, n = (a.astype("<u8").tobytes() for a in runs)
        job, (engine, epoch, _, _) = self.job, self.who
        msg = PushRuns(
            job.handle.request_id, self.agent, src=s, dst=d, nbytes=n, notif=notif,
            staged=staged, token=job.token, d_epoch=epoch, nonce=job.nonce, part=part[0],
            last=part[1], d_engine=engine,
        )  # fmt: skip
        client = self.peer.rank_client(src)  # a rank without a push channel: nothing sent
        job.pushed.append(src)
        reply = client.send(msg)
        return lambda: reply_runs(reply(), "staged push" if staged else "push")

    def direct(self, runs: dict[int, Runs]) -> tuple[set[bytes], int]:
        """Send each source rank its runs (one message, the last to that rank), every
        rank asked before any answer is awaited (one round trip, not one per rank) → the
        notifications that will say they landed, and the descriptors posted."""
        want = {src: self.notif(src).encode() for src in runs}
        calls: list[Callable[[], int]] = []
        total = 0
        try:
            for src, r in runs.items():
                calls.append(self.ask(src, r.as_uint64(), want[src]))
            while calls:
                total += calls.pop(0)()
        finally:
            _answer(calls)  # what a failure above left unanswered
        return set(want.values()), total


def reply_runs(reply: Message, what: str) -> int:
    """Descriptors a P rank's ``reply`` to a push says it posted; :class:`PushRefusedError`
    if it refused (nothing posted), PeerError if the reply is something else."""
    if isinstance(reply, PushRefused):
        raise PushRefusedError(f"{what} of {reply.request_id!r} refused by P: {reply.reason}")
    if not isinstance(reply, PushReply):
        raise PeerError(f"{what}: unexpected reply {type(reply).__name__}")
    return reply.runs


@dataclass(frozen=True, slots=True)
class Part:
    """One P rank's chunk in a round, at ``offset`` in the slot."""

    src: int
    chunk: Chunk
    offset: int


@dataclass(frozen=True, slots=True)
class StagedPush:
    """Rounds through ``slot`` of the P ``ranks`` staged (the others pushed direct)."""

    slot: int
    rounds: list[list[Part]]
    ranks: frozenset[int]


def choose_push(
    stager: Stager, runs: dict[int, Runs], link: Link | None = None
) -> StagedPush | None:
    """The P ranks whose runs the cost model stages (:meth:`Stager.choose`; ``link``:
    the pair's measured WRITE costs) and a slot; None: all direct."""
    staged, slot = stager.choose(runs, push=True, link=link)
    if slot is None:
        return None
    return StagedPush(slot, _rounds(staged, stager.pool.slot_bytes // 2), frozenset(staged))


def _rounds(staged: dict[int, list[Chunk]], half: int) -> list[list[Part]]:
    """Chunks packed into rounds of at most ``half`` a slot (their spans end to end)."""
    out: list[list[Part]] = []
    cur: list[Part] = []
    used = 0
    for src, chs in staged.items():
        for ch in chs:
            size = ch.staged_bytes
            if cur and used + size > half:
                out.append(cur)
                cur, used = [], 0
            cur.append(Part(src, ch, used))
            used += size
    if cur:
        out.append(cur)
    return out


Asked = tuple[list[Callable[[], int]], set[bytes]]
"""A staged round's calls to P ranks (each taking one's answer) and its notifications."""


def push_staged(
    stager: Stager, pusher: Pusher, plan: StagedPush, await_notifs: Callable[[set[bytes]], None]
) -> tuple[int, int]:
    """Rounds through the slot's halves (:func:`.spans.rounds`): ask each P rank for
    round ``k`` once round ``k - 1`` landed (every answer and notification;
    ``await_notifs`` raises at the deadline), then scatter round ``k - 1`` while P
    writes round ``k`` → ``(descriptors P posted, runs moved)``. The slot is the caller's
    to give back; calls unanswered when this raises are answered first (the ranks'
    channels wait for them)."""
    base = stager.pool.region.addr + plan.slot * stager.pool.slot_bytes
    view = stager.pool.view(plan.slot)
    counts = [0, 0]

    def start(round_: tuple[int, list[Part]], at: int) -> Asked:
        (k, parts), calls, want = round_, [], set()
        try:
            for src in sorted({p.src for p in parts}):
                mine = [p for p in parts if p.src == src]
                runs = (
                    np.concatenate([p.chunk.span_src for p in mine]),
                    np.concatenate([p.chunk.span_stage + (base + at + p.offset) for p in mine]),
                    np.concatenate([p.chunk.span_len for p in mine]),
                )
                notif = f"{pusher.notif(src)}:s{k}".encode()
                last = not any(p.src == src for later in plan.rounds[k + 1 :] for p in later)
                calls.append(pusher.ask(src, runs, notif, (k, last), staged=True))
                want.add(notif)
        except BaseException:
            _answer(calls)  # the ranks asked before this one failed
            raise
        return calls, want

    def wait(asked: Asked) -> None:
        calls, want = asked
        while calls:
            counts[0] += calls.pop(0)()
        await_notifs(want)

    def scatter(round_: tuple[int, list[Part]], at: int) -> None:
        for p in round_[1]:  # every write of the round landed
            c = p.chunk
            stager.memory.scatter(c.run_dst, view, c.run_stage + at + p.offset, c.run_len)
            counts[1] += c.run_len.shape[0]

    inflight: list[Asked] = []
    try:
        numbered = list(enumerate(plan.rounds))
        rounds(numbered, stager.pool.slot_bytes // 2, start, wait, scatter, inflight, True)
    finally:
        for calls, _ in inflight:
            _answer(calls)
    return counts[0], counts[1]


def _answer(calls: list[Callable[[], int]]) -> None:
    """Take the answers of calls a failed round left (each rank's channel waits for its
    call's answer before it serves another), whatever they say."""
    for call in calls:
        with contextlib.suppress(Exception):
            call()
