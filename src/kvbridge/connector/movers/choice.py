"""How a request crosses the transport in :attr:`~kvbridge.connector.load.Mode.AUTO`:
pull or push, each source rank direct or staged, from what D measured with the P epoch
(docs/performance.md, "The choice per request").

Once per P epoch, D times three transfers each way between a P rank's first region and
one of its staging slots (``PROBE_ROUNDS`` times in turn, each one's fastest kept, all
within ``PROBE_TIMEOUT_S``): one 64-byte run, ``PROBE_DESCS`` 64-byte runs and one run
of up to ``PROBE_BYTES``. Their differences give each direction's :class:`Link`: the
fixed cost of a round (post to landed; pushed: asking P and its notification too), the
cost of one descriptor and of one byte. Per request, :func:`choose` prices the request
both ways, each source rank direct or staged, and takes the cheaper, in a few
microseconds (no scan of the runs). A direction whose bytes cost more than ``SLOW`` times
the other's (a READ emulated over TCP between GPUs) is never chosen.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvbridge.connector.load import Mode
from kvbridge.connector.movers.push import reply_runs
from kvbridge.connector.movers.staging import (
    MAX_AVG,
    MAX_BYTE_S,
    MAX_DESC_S,
    MIN_BYTE_S,
    MIN_DESC_S,
    MIN_RUNS,
    Link,
    Staging,
)
from kvbridge.connector.peers import Peer
from kvbridge.control.messages import PushRuns
from kvbridge.errors import KVBridgeError, PushRefusedError
from kvbridge.plan.runs import Runs

if TYPE_CHECKING:
    from kvbridge.connector.movers.staging import Stager
    from kvbridge.transport.base import Transport

PROBE_BYTES = 8 << 20
PROBE_DESCS = 256
PROBE_RUN = 64
PROBE_TIMEOUT_S = 5.0
PROBE_ROUNDS = 3
PROBE_RETRY_S = 10.0
"""A probe that failed, or found no free slot, is tried again this long after."""
MARGIN = 1.25
"""Push is taken only where priced this much cheaper than pull (pull asks nothing of P)."""
SLOW, SLOW_NET_S = 4.0, 1e-3
"""A direction whose bytes cost this many times the other's is never chosen, where the
probe's bytes took it that long at least (fewer, and noise could decide)."""


def solve(tiny: float, many: float, big: float, descs: int, big_bytes: int) -> Link:
    """The link whose three probe transfers took ``tiny`` (one 64-byte run), ``many``
    (``descs`` of them) and ``big`` (one of ``big_bytes``) seconds."""
    byte_s = min(max((big - tiny) / max(big_bytes - PROBE_RUN, 1), MIN_BYTE_S), MAX_BYTE_S)
    spread = max(descs - 1, 1)
    desc_s = (many - tiny - (descs - 1) * PROBE_RUN * byte_s) / spread
    desc_s = min(max(desc_s, MIN_DESC_S), MAX_DESC_S)
    return Link(max(tiny - desc_s - PROBE_RUN * byte_s, 0.0), desc_s, byte_s)


def slow(read: Link, write: Link, nbytes: int) -> str:
    """The direction never to choose ("READ", "WRITE"; "": neither) by what the probe
    measured: its bytes cost ``SLOW`` times the other's, and the probe's ``nbytes`` took
    it ``SLOW_NET_S`` or more."""
    if read.byte_s > SLOW * write.byte_s and read.byte_s * nbytes >= SLOW_NET_S:
        return "READ"
    if write.byte_s > SLOW * read.byte_s and write.byte_s * nbytes >= SLOW_NET_S:
        return "WRITE"
    return ""


@dataclass(frozen=True, slots=True)
class PairCosts:
    """What D measured with one P epoch: each direction's :class:`Link` (None: failed),
    or ``note``, why nothing was measured (then D pulls; ``at``: when, by
    ``time.monotonic``, so that it is measured again after ``PROBE_RETRY_S``; None where
    the cause does not pass: the peer's or D's set-up, never measured again)."""

    read: Link | None = None
    write: Link | None = None
    note: str = ""
    never: str = ""
    """The direction the probe found far slower (:func:`slow`): learning never lifts it."""
    at: float | None = None

    def learned(self, push: bool, descriptors: int, nbytes: int, seconds: float) -> PairCosts:
        """After a direct transfer of that direction (:meth:`Link.learned`)."""
        link = self.write if push else self.read
        if link is None:
            return self
        new = link.learned(descriptors, nbytes, seconds)
        return replace(self, write=new) if push else replace(self, read=new)


def price(
    link: Link, runs: Mapping[int, Runs], push: bool, staging: Staging | None
) -> tuple[float, int]:
    """Seconds ``runs`` take over ``link`` (pulled: all posted, one round; pushed: the
    ranks sent direct asked at once, one round for them all), each source rank direct or
    staged, whichever costs less; and how many were priced staged.
    A staged rank costs one round and one descriptor per chunk of half a slot (a pulled
    chunk's spans counted as one: its floor), its bytes, and its local copies (P's
    gather and D's scatter pushed, D's scatter pulled)."""
    total = 0.0
    staged = 0
    own = link.round_s if push and len(runs) == 1 else 0.0  # a sole rank pushed: its round
    for r in runs.values():
        n, b = len(r), r.nbytes
        best = n * link.desc_s + b * link.byte_s + own
        if staging is not None and n >= MIN_RUNS and b <= MAX_AVG * n:
            rounds = -(-b // max(staging.slot_bytes // 2, 1))  # rounds of half a slot
            copy = n * staging.per_run + b * staging.per_byte
            cost = rounds * (link.round_s + link.desc_s) + b * link.byte_s + copy * (1 + push)
            if cost < best:
                best, staged = cost, staged + 1
        total += best
    if not push or (len(runs) > 1 and staged < len(runs)):  # the direct ranks' one round
        total += link.round_s
    return total, staged


def choose(costs: PairCosts, runs: Mapping[int, Runs], staging: Staging | None) -> tuple[Mode, str]:
    """Pull or push for this request, and why (with both prices)."""
    read, write = costs.read, costs.write
    if costs.note or read is None or write is None:
        return Mode.PULL, f"auto: pull ({costs.note or 'a direction failed its probe'})"
    if costs.never:
        mode = Mode.PUSH if costs.never == "READ" else Mode.PULL
        return mode, f"auto: {mode.value}, never {costs.never}: READ {read}, WRITE {write}"
    pull_s, pull_n = price(read, runs, False, staging)
    push_s, push_n = price(write, runs, True, staging)
    mode = Mode.PUSH if push_s * MARGIN < pull_s else Mode.PULL
    return mode, (
        f"auto: {mode.value}, priced pull {pull_s * 1e3:.3f} ms ({pull_n} ranks staged), "
        f"push {push_s * 1e3:.3f} ms ({push_n} staged); READ {read}; WRITE {write}"
    )


class Probing(Protocol):
    """What the probe uses of a D rank."""

    engine_id: str
    metadata: bytes
    stager: Stager | None
    transport: Transport

    def await_notifs(self, want: set[bytes], deadline: float) -> None: ...


def measure(d: Probing, peer: Peer, src: int) -> PairCosts:
    """Time the probe's transfers both ways between P rank ``src`` and a staging slot of
    D's; everything lands in the slot, never in a KV block.

    A probe that fails keeps its slot out of the pool (a transfer may still land in it),
    except where P refused a WRITE with ``PushRefused``: P sends that only before it
    posts anything (its ledger's check, ahead of the write), every transfer before it
    was waited for to the end (READ done, WRITE's notification in), and the side
    channel pairs each reply with its call. An ``ErrorReply`` (a timeout, a dead or
    failing P, a handler error) may follow a posted WRITE: the slot stays out."""
    stager = d.stager
    if stager is None:
        return PairCosts(note="no staging slot to probe into")
    info = peer.ranks.get(src)
    if info is None or not info.endpoint or not info.regions:
        return PairCosts(note=f"P rank {src} serves no push channel")
    size = min(PROBE_BYTES, stager.pool.slot_bytes, info.regions[0])
    if size < 4 * PROBE_RUN:
        return PairCosts(note=f"P rank {src}'s first region ({size} B) is too small to probe")
    slot = stager.pool.take(PROBE_TIMEOUT_S)
    if slot is None:
        return PairCosts(note="no free staging slot", at=time.monotonic())
    clean = False
    try:
        at = stager.pool.region.addr + slot * stager.pool.slot_bytes
        descs = max(min(PROBE_DESCS, size // (2 * PROBE_RUN)), 1)
        step = np.arange(descs, dtype=np.uint64) * np.uint64(2 * PROBE_RUN)
        one = np.ones(1, np.uint64)
        shapes: list[Shape] = [
            (one * at, one * info.bases[0], one * PROBE_RUN),
            (step + at, step + info.bases[0], np.full(descs, PROBE_RUN, np.uint64)),
            (one * at, one * info.bases[0], one * size),
        ]
        best = np.full((2, 3), np.inf)
        end = time.monotonic() + PROBE_TIMEOUT_S  # the whole probe's, not each transfer's
        for i in range(PROBE_ROUNDS):  # interleaved; the first of each pays the pair's set-up
            if i and time.monotonic() > end:  # what was measured so far
                break
            for k, runs in enumerate(shapes):
                best[0, k] = min(best[0, k], _read(d, peer, src, runs, end))
                best[1, k] = min(best[1, k], _write(d, peer, src, runs, end))
        clean = True
    except PushRefusedError as exc:  # see the docstring: the slot is clean
        clean = True
        return PairCosts(note=f"probe refused: {exc}", at=time.monotonic())
    except KVBridgeError as exc:
        return PairCosts(note=f"probe failed: {exc}", at=time.monotonic())
    finally:
        stager.pool.give_back(slot, clean)
    (rt, rm, rb), (wt, wm, wb) = best.tolist()
    read, write = solve(rt, rm, rb, descs, size), solve(wt, wm, wb, descs, size)
    return PairCosts(read, write, "", slow(read, write, size), time.monotonic())


Shape = tuple[np.ndarray, np.ndarray, np.ndarray]


def _read(d: Probing, peer: Peer, src: int, runs: Shape, end: float) -> float:
    t0 = time.perf_counter()
    handle = d.transport.read(peer.agents[src], *runs)
    d.transport.wait(handle, max(end - time.monotonic(), 0.001))
    return time.perf_counter() - t0


def _write(d: Probing, peer: Peer, src: int, runs: Shape, end: float) -> float:
    """Seconds from asking P rank ``src`` to write ``runs`` (local = D) to their landing,
    which must come before ``end`` (``time.monotonic()``)."""
    local, remote, n = (a.astype("<u8").tobytes() for a in runs)
    notif = f"kvb-probe:{secrets.token_hex(8)}".encode()
    probe = PushRuns(
        "probe:" + notif.decode(), d.metadata, src=remote, dst=local, nbytes=n, notif=notif,
        nonce=notif.decode(), d_engine=d.engine_id,
    )  # fmt: skip
    t0 = time.perf_counter()
    reply_runs(peer.rank_client(src).call(probe), "probe")
    d.await_notifs({notif}, end)
    return time.perf_counter() - t0


__all__ = ["Link", "PairCosts", "choose", "measure", "price", "slow", "solve"]
