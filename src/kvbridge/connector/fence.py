"""Fencing failed loads: D reports a failed request only once none of its bytes can land
(posted transfers cannot be cancelled; ``docs/faults.md``). The outcome, and with it the
destination blocks, is held until every transfer ended and every P rank that pushed said
its writes ended; the seconds held go to ``stages["fence"]``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from kvbridge.connector.load import Outcome
from kvbridge.connector.peers import Peer
from kvbridge.control.messages import FenceReply, PushFence
from kvbridge.errors import KVBridgeError, TransferFailed, TransportError
from kvbridge.transport.base import Region, Transport, XferHandle, XferState

log = logging.getLogger(__name__)

Check = Callable[[], bool]
"""Asks a P rank whether its writes for the request ended; True when it says so."""


@dataclass(slots=True)
class Held:
    outcome: Outcome
    handles: list[XferHandle]
    checks: list[Check] = field(default_factory=list)
    on_end: list[Callable[[], None]] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)
    reminded: float = 0.0


class Fence:
    """Holds failed loads until their transfers ended; ``deliver`` gets each outcome.
    Only its own thread asks P ranks; an exception while checking one load is logged and
    the load checked again later. A load still held is logged every :attr:`REMIND_S` s."""

    REMIND_S = 60.0

    def __init__(self, transport: Transport, deliver: Callable[[Outcome], None]):
        self.transport, self.deliver = transport, deliver
        self._lock = threading.Lock()
        self._held: list[Held] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvbridge-fence", daemon=True)
        self._thread.start()

    def hold(self, item: Held) -> None:
        """Deliver ``item.outcome`` now if nothing can land any more, else hold it."""
        if not item.checks and self._settled(item):
            self._release(item)
            return
        log.warning(
            "request %s failed (%s); its blocks stay fenced until %d transfer(s) and %d "
            "P rank(s) report that no byte can land any more",
            item.outcome.request_id, item.outcome.error, len(item.handles), len(item.checks),
        )  # fmt: skip
        with self._lock:
            self._held.append(item)
        self._wake.set()

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _settled(self, item: Held) -> bool:
        item.handles = [h for h in item.handles if not self.transport.ended(h)]
        if not item.handles:
            item.checks = [c for c in item.checks if not c()]
        return not item.handles and not item.checks

    def _release(self, item: Held) -> None:
        for fn in item.on_end:
            try:
                fn()
            except Exception:  # a clean-up must not cost the outcome
                log.exception("fence: clean-up of %s failed", item.outcome.request_id)
        held = time.monotonic() - item.since
        stages = dict(item.outcome.stages)
        if held > 1e-3:
            stages["fence"] = held
        self.deliver(replace(item.outcome, stages=stages))

    def _visit(self, item: Held) -> None:
        try:
            done = self._settled(item)
        except Exception:
            log.exception("fence: checking %s failed; checked again", item.outcome.request_id)
            return
        if not done:
            waited = time.monotonic() - item.since
            if waited > item.reminded + self.REMIND_S:
                item.reminded = waited
                log.warning(
                    "request %s still fenced after %.0f s: %d transfer(s), %d P rank(s) "
                    "have not ended (a stopped or cut-off peer)",
                    item.outcome.request_id, waited, len(item.handles), len(item.checks),
                )  # fmt: skip
            return
        with self._lock:
            if item not in self._held:
                return  # closed meanwhile
            self._held.remove(item)
        self._release(item)

    def _loop(self) -> None:
        pause = 0.005
        while not self._stop.is_set():
            with self._lock:
                items = list(self._held)
            if not items:
                self._wake.wait(0.2)
                self._wake.clear()
                pause = 0.005
                continue
            for item in items:
                if self._stop.is_set():
                    return
                self._visit(item)
            self._stop.wait(pause)
            pause = min(pause * 2, 0.25)

    def close(self) -> list[Held]:
        """Stop polling; returns what is still held (its transfers may still land)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        with self._lock:
            out, self._held = self._held, []
        return out


FENCE_TIMEOUT_S = 1.0
"""One fence question to a P rank waits this long for its answer (then asked again)."""


class ProbeArea:
    """A few registered bytes of D's own, the landing place of liveness probes."""

    def __init__(self) -> None:
        self.buf = np.zeros(64, np.uint8)
        self.region = Region(int(self.buf.ctypes.data), int(self.buf.nbytes))


def push_fence_checks(
    peer: Peer, request_id: str, ranks: list[int], d: Transport, probe: int, d_engine: str
) -> list[_RankFence]:
    """One check per P rank in ``ranks``: True once that rank answered that none of its
    writes for ``request_id`` from D instance ``d_engine`` is running (it then refuses any
    later push of it), or once a 1-byte READ from it to ``probe`` (D's own, over ``d``)
    was posted and then failed as NIXL reports it (a killed rank; the probe's limit:
    ``docs/faults.md``). Each is closed once its load is released."""
    fence = PushFence(request_id, d_engine)
    return [_RankFence(peer, src, fence, d, probe) for src in sorted(set(ranks))]


class _RankFence:
    """Asks one P rank whether its writes for a request ended; if it does not answer,
    probes whether its agent still lives (a stopped or cut-off rank: ask again later)."""

    def __init__(self, peer: Peer, src: int, fence: PushFence, transport: Transport, local: int):
        info = peer.ranks[src]
        self.client = peer.client.sibling(info.endpoint, FENCE_TIMEOUT_S)
        self.fence, self.transport, self.agent = fence, transport, peer.agents.get(src)
        self.local, self.remote = local, info.bases[0] if info.bases else None
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
        try:
            if self.probe is None:
                one = np.ones(1, np.uint64)
                self.probe = self.transport.read(
                    self.agent, one * self.local, one * self.remote, one
                )
            state = self.transport.poll(self.probe)
        except TransferFailed:  # posted, and NIXL says it failed: the rank's connection is gone
            self.probe = None
            return True
        except TransportError:  # not posted (e.g. unknown peer): proves nothing, ask again
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
