"""D's half of push mode: ask each P rank to write its runs, and ask it again, after a
failure, whether those writes ended (the fence, :mod:`kvbridge.connector.fence`)."""

from __future__ import annotations

from collections.abc import Callable

from kvbridge.connector.peers import Peer
from kvbridge.control.channel import Client
from kvbridge.control.messages import FenceReply, PushFence, PushReply, PushRuns
from kvbridge.errors import KVBridgeError, PeerError
from kvbridge.plan.runs import Runs

FENCE_TIMEOUT_S = 1.0
"""One fence question to a P rank waits this long for its answer (then asked again)."""


def push_runs(
    peer: Peer, request_id: str, runs: dict[int, Runs], rank: int, agent: bytes, pushed: list[int]
) -> set[bytes]:
    """Send each source rank its runs; returns the notifications that will say they
    landed. ``pushed`` gets each rank before it is asked (it may write even if the call
    fails)."""
    want = set()
    for src, r in runs.items():
        notif = f"kvb:{request_id}:{src}:{rank}".encode()
        s, d, n = (a.astype("<u8").tobytes() for a in r.as_uint64())
        pushed.append(src)
        reply = peer.rank_client(src).call(PushRuns(request_id, agent, s, d, n, notif))
        if not isinstance(reply, PushReply):
            raise PeerError(f"push: unexpected reply {type(reply).__name__}")
        want.add(notif)
    return want


def push_fence_checks(
    peer: Peer, request_id: str, ranks: list[int]
) -> tuple[list[Callable[[], bool]], list[Callable[[], None]]]:
    """One check per P rank in ``ranks``: True once that rank answered that none of its
    writes for ``request_id`` is running (and it will refuse any later push of it).
    Also the closers of the short-timeout channels the checks use."""
    checks: list[Callable[[], bool]] = []
    closers: list[Callable[[], None]] = []
    for src in sorted(set(ranks)):
        client = Client(peer.endpoints[src], peer.secret, FENCE_TIMEOUT_S)
        checks.append(_asker(client, request_id))
        closers.append(client.close)
    return checks, closers


def _asker(client: Client, request_id: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            reply = client.call(PushFence(request_id))
        except KVBridgeError:
            return False  # no answer (stopped, cut off): ask again later
        return isinstance(reply, FenceReply) and reply.ended

    return check
