"""Fencing failed loads: D reports a failed request only once none of its bytes can land.

Neither NIXL nor UCX cancels a posted transfer: releasing a READ that is still running
(a stopped P rank, a cut link) does not stop it, and over TCP its bytes land whenever
the peer resumes — in blocks D's engine may by then have given to another request
(measured: 16 MiB of 16 MiB landed after release and after ``remove_remote_agent``).
So a failed load whose transfers may still run is *fenced*: its outcome is held back,
and with it the destination blocks (the engine cannot reuse blocks of a request it has
not been told about), until every such transfer has ended — done, or failed as the
transport reports it — and, for push, until each P rank that wrote has answered that
its writes for the request ended. Then the outcome is delivered, with the seconds it
was held in ``stages["fence"]``. A staging slot held by the load is given back then.

The engine sees the failure late only while the transfer really can still land; a dead
peer ends it quickly (the transport reports the failure). Held loads are counted by
:meth:`Fence.held` and logged once when fenced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvbridge.connector.load import Outcome
from kvbridge.transport.base import Transport, XferHandle

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

    Only the fence's own thread asks P ranks (each question may wait up to a second);
    an exception while checking or releasing one load is logged and that load is checked
    again later — the thread never dies of it. A load held for a long time is logged
    again every :attr:`REMIND_S` seconds."""

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
