"""A loopback transport whose transfers with chosen peers can be held and landed late."""

from __future__ import annotations

from collections.abc import Callable

from kvbridge.transport.base import XferHandle, XferState
from kvbridge.transport.loopback import Fabric, LoopbackTransport, _Handle


class _Late(_Handle):
    def __init__(self, run: Callable[[], None]) -> None:
        super().__init__(XferState.PENDING)
        self.run: Callable[[], None] | None = run
        """The transfer's copy, run when its peer resumes."""


class StallingLoopback(LoopbackTransport):
    """Test double of a stopped peer or a cut link (:meth:`stall`, :meth:`resume`)."""

    def __init__(self, name: str, fabric: Fabric) -> None:
        super().__init__(name, fabric)
        self.stalled: dict[str, list[_Late]] = {}

    def stall(self, peer: str) -> None:
        """Transfers with ``peer`` posted from now on stay pending (release does not
        cancel them) until :meth:`resume`."""
        self.stalled.setdefault(peer, [])

    def resume(self, peer: str) -> None:
        """Land every transfer stalled on ``peer`` (late bytes, as over a real link)."""
        for h in self.stalled.pop(peer, []):
            assert h.run is not None
            h.run()
            h.state, h.run = XferState.DONE, None

    def _start(self, peer: str, run: Callable[[], None]) -> XferHandle:
        if peer in self.stalled:
            handle = _Late(run)
            self.stalled[peer].append(handle)
            return handle
        return super()._start(peer, run)
