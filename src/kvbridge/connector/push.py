"""D's half of push mode: ask each P rank to write its runs, and ask it again, after a
failure, whether those writes ended (the fence, :mod:`kvbridge.connector.fence`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbridge.connector.peers import Peer
from kvbridge.control.channel import Client
from kvbridge.control.messages import (
    FenceReply,
    Message,
    PushFence,
    PushRefused,
    PushReply,
    PushRuns,
)
from kvbridge.errors import KVBridgeError, PeerError, TransferFailed, TransportError
from kvbridge.plan.runs import Runs
from kvbridge.transport.base import Region, Transport, XferHandle, XferState

FENCE_TIMEOUT_S = 1.0
"""One fence question to a P rank waits this long for its answer (then asked again)."""


class ProbeArea:
    """A few registered bytes of D's own, the landing place of liveness probes."""

    def __init__(self) -> None:
        self.buf = np.zeros(64, np.uint8)
        self.region = Region(int(self.buf.ctypes.data), int(self.buf.nbytes))


@dataclass(frozen=True, slots=True)
class PushBind:
    """What binds a load's pushes to its lease (:mod:`kvbridge.connector.push_ledger`):
    the ``begin`` token, D's epoch, the nonce D issued for the load and D's engine id."""

    token: str
    epoch: str
    nonce: str
    engine: str

    def message(
        self,
        request_id: str,
        agent: bytes,
        arrays: list[bytes],
        notif: bytes,
        part: int = 0,
        last: bool = True,
        staged: bool = False,
    ) -> PushRuns:
        """The push of ``arrays`` (src, dst, nbytes: uint64 bytes), message ``part``."""
        s, d, n = arrays
        return PushRuns(
            request_id, agent, src=s, dst=d, nbytes=n, notif=notif, staged=staged,
            token=self.token, d_epoch=self.epoch, nonce=self.nonce, part=part, last=last,
            d_engine=self.engine,
        )  # fmt: skip


def reply_runs(reply: Message, what: str) -> int:
    """Descriptors a P rank's ``reply`` to a push says it posted; PeerError if it refused."""
    if isinstance(reply, PushRefused):
        raise PeerError(f"{what} of {reply.request_id!r} refused by P: {reply.reason}")
    if not isinstance(reply, PushReply):
        raise PeerError(f"{what}: unexpected reply {type(reply).__name__}")
    return reply.runs


def push_runs(
    peer: Peer,
    request_id: str,
    runs: dict[int, Runs],
    rank: int,
    agent: bytes,
    pushed: list[int],
    bind: PushBind,
) -> tuple[set[bytes], int]:
    """Send each source rank its runs (one message, the last of the load to that rank);
    returns the notifications that will say they landed and the descriptors the ranks
    posted. ``pushed`` gets each rank before it is asked (it may write even if the call
    fails)."""
    want = set()
    total = 0
    for src, r in runs.items():
        notif = f"kvb:{request_id}:{bind.nonce}:{src}:{rank}".encode()
        arrays = [a.astype("<u8").tobytes() for a in r.as_uint64()]
        client = peer.rank_client(src)  # a rank without a push channel: nothing sent
        pushed.append(src)
        total += reply_runs(client.call(bind.message(request_id, agent, arrays, notif)), "push")
        want.add(notif)
    return want, total


def push_fence_checks(
    peer: Peer,
    request_id: str,
    ranks: list[int],
    transport: Transport,
    probe_addr: int,
    d_engine: str,
) -> tuple[list[Callable[[], bool]], list[Callable[[], None]]]:
    """One check per P rank in ``ranks``: True once that rank answered that none of its
    writes for ``request_id`` from D instance ``d_engine`` is running (and it will refuse
    any later push of it), or once a 1-byte READ from it was posted and then failed as
    NIXL reports it (a killed rank: its connection is gone). ``probe_addr``: 1 registered
    byte of D's own for that READ. Also the closers.

    Limit: the probe sees D's connection to the rank, not the rank's to D. A rank that
    is alive but cut off long enough for D's connection to fail, and whose own write to
    D then resumes when the link heals, could still land bytes after the report. Pull
    mode has no such gap (D owns the READs it waits for)."""
    checks: list[Callable[[], bool]] = []
    closers: list[Callable[[], None]] = []
    for src in sorted(set(ranks)):
        client = Client(peer.endpoints[src], peer.secret, FENCE_TIMEOUT_S, peer.keys)
        fence = PushFence(request_id, d_engine)
        check = _RankFence(client, fence, transport, peer.agents.get(src), probe_addr)
        check.remote = peer.probe_addrs.get(src)
        checks.append(check)
        closers.append(check.close)
    return checks, closers


class _RankFence:
    """Asks one P rank whether its writes for a request ended; if it does not answer,
    probes whether its agent still lives (a stopped or cut-off rank: ask again later)."""

    def __init__(
        self, client: Client, fence: PushFence, transport: Transport, agent: str | None, local: int
    ):
        self.client, self.fence = client, fence
        self.transport, self.agent, self.local = transport, agent, local
        self.remote: int | None = None
        self.probe: XferHandle | None = None

    def __call__(self) -> bool:
        try:
            reply = self.client.call(self.fence)
        except KVBridgeError:
            return self._agent_gone()
        return isinstance(reply, FenceReply) and reply.ended

    def _agent_gone(self) -> bool:
        if self.agent is None or self.remote is None or not self.local:
            return False
        if self.probe is None:
            one = np.ones(1, np.uint64)
            try:
                self.probe = self.transport.read(
                    self.agent, one * self.local, one * self.remote, one
                )
            except TransferFailed:
                return True  # posted, and NIXL says it failed: the rank's connection is gone
            except TransportError:
                return False  # not posted (e.g. unknown peer): proves nothing, ask again
        try:
            state = self.transport.poll(self.probe)
        except TransferFailed:
            self.probe = None
            return True  # the READ failed: the rank's connection is gone
        except TransportError:
            self.probe = None
            return False
        if state is XferState.DONE:
            self.probe.release()
            self.probe = None  # alive but silent: ask again
        return False

    def close(self) -> None:
        if self.probe is not None:
            self.probe.release()
        self.client.close()
