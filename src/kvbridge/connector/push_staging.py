"""D's half of a staged push: many small runs written by P into D's staging slot at
contiguous offsets, then scattered locally into D's blocks.

A head split (P TP 1 → D TP 2, NHD) cuts every token row of K and V into its own run
(1 KiB for a Llama-8B shape): pushed direct, P posts one descriptor per run. Staged,
D takes a slot of its :class:`~kvbridge.connector.staging.StagingPool`, sorts each P
rank's runs by source (so P's sources are as contiguous as they get) and asks the rank
to write them to ``slot + running offset`` (``PushRuns.staged``); the rank gathers its
sources into a slot of its own and WRITEs a few long spans
(:mod:`kvbridge.connector.push_gather`). A request larger than the slot goes in rounds.

Safety (docs/faults.md): D scatters a round only after every notification of that
round arrived, and before the request is reported. A failed load keeps the slot (the
consumer's ``job.slot``) until the push fence says P's writes ended: a late write can
land only in the slot, never in blocks the engine may reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbridge.connector.peers import Peer
from kvbridge.connector.push import PushBind, reply_runs
from kvbridge.connector.staging import Chunk, Stager
from kvbridge.plan.runs import Runs


@dataclass(frozen=True, slots=True)
class Part:
    """One P rank's chunk in a round, at ``offset`` in the slot."""

    src: int
    chunk: Chunk
    offset: int


@dataclass(frozen=True, slots=True)
class StagedPush:
    slot: int
    rounds: list[list[Part]]
    ranks: frozenset[int]
    """P ranks whose runs go through the slot (the others are pushed direct)."""


def choose_push(stager: Stager, runs: dict[int, Runs]) -> StagedPush | None:
    """The P ranks whose runs the cost model stages (:meth:`Stager.choose` with
    ``push``), and a slot; None: all direct (also when no slot frees up within 10 ms)."""
    staged, slot = stager.choose(runs, push=True)
    if slot is None:
        return None
    return StagedPush(slot, _rounds(staged, stager.pool.slot_bytes), frozenset(staged))


def _rounds(staged: dict[int, list[Chunk]], slot_bytes: int) -> list[list[Part]]:
    """Chunks packed into rounds of at most ``slot_bytes`` (their spans laid end to end)."""
    out: list[list[Part]] = []
    cur: list[Part] = []
    used = 0
    for src, chs in staged.items():
        for ch in chs:
            size = int(ch.span_len.sum())
            if cur and used + size > slot_bytes:
                out.append(cur)
                cur, used = [], 0
            cur.append(Part(src, ch, used))
            used += size
    if cur:
        out.append(cur)
    return out


class StagedPusher:
    """Runs one staged push: per round, ask each P rank, wait for all notifications
    (``await_notifs``, which raises at the deadline), scatter the slot into D's blocks."""

    def __init__(
        self,
        stager: Stager,
        peer: Peer,
        request_id: str,
        rank: int,
        agent: bytes,
        await_notifs: Callable[[set[bytes]], None],
        bind: PushBind,
    ):
        """``bind``: the load's lease token, D epoch, nonce and D engine id (each round is
        one part)."""
        self.stager, self.peer, self.request_id = stager, peer, request_id
        self.rank, self.agent, self.await_notifs = rank, agent, await_notifs
        self.bind = bind

    def run(self, plan: StagedPush, pushed: list[int]) -> tuple[int, int]:
        """``(descriptors P posted, runs moved)``. ``pushed`` gets each P rank before
        it is asked. The slot is the caller's to give back (now, or after the fence)."""
        base = self.stager.pool.region.addr + plan.slot * self.stager.pool.slot_bytes
        view = self.stager.pool.view(plan.slot)
        posted = moved = 0
        for k, parts in enumerate(plan.rounds):
            want = set()
            for src in sorted({p.src for p in parts}):
                mine = [p for p in parts if p.src == src]
                notif = f"kvb:{self.request_id}:{self.bind.nonce}:{src}:{self.rank}:s{k}".encode()
                last = not any(p.src == src for later in plan.rounds[k + 1 :] for p in later)
                posted += self._ask(src, mine, base, notif, pushed, (k, last))
                want.add(notif)
            self.await_notifs(want)
            for p in parts:  # every write of the round landed: scatter it
                c = p.chunk
                self.stager.memory.scatter(c.run_dst, view, c.run_stage + p.offset, c.run_len)
                moved += c.run_len.shape[0]
        return posted, moved

    def _ask(
        self,
        src: int,
        parts: list[Part],
        base: int,
        notif: bytes,
        pushed: list[int],
        part: tuple[int, bool],
    ) -> int:
        """Ask P rank ``src`` to write ``parts``: message ``part`` = (round, the last to
        that rank) of the load."""
        s = np.concatenate([p.chunk.span_src for p in parts])
        d = np.concatenate([p.chunk.span_stage + (base + p.offset) for p in parts])
        n = np.concatenate([p.chunk.span_len for p in parts])
        arrays = [a.astype("<u8").tobytes() for a in (s, d, n)]
        k, last = part
        msg = self.bind.message(self.request_id, self.agent, arrays, notif, k, last, staged=True)
        client = self.peer.rank_client(src)  # a rank without a push channel: nothing sent
        pushed.append(src)
        return reply_runs(client.call(msg), "staged push")
