"""The transport interface: register, add peer, read/write runs, poll."""

from __future__ import annotations

import abc
import enum
import time
from typing import Self

import numpy as np

from kvbridge.errors import TransferTimeout, TransportError
from kvbridge.layout.tensor import MemKind, Region

__all__ = [
    "U64",
    "MemKind",
    "PostingTransport",
    "Region",
    "Transport",
    "XferHandle",
    "XferState",
    "as_u64",
]
U64 = np.ndarray
"""A 1-D uint64 array (any non-negative integer dtype is accepted)."""


class XferState(enum.Enum):
    """State of a posted transfer, as :meth:`Transport.poll` reports it."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class XferHandle(abc.ABC):
    """A posted transfer. ``release()`` frees transport resources; idempotent."""

    @abc.abstractmethod
    def release(self) -> None: ...


class Transport(abc.ABC):
    """One rank's agent (``name``: unique per rank, known to peers). ``read`` copies
    ``remote[i]`` (peer memory) to ``local[i]``, ``write`` the other way, ``nbytes[i]``
    bytes each; ``notif`` is delivered to the peer once the data has landed."""

    name: str
    kinds: frozenset[MemKind] = frozenset({MemKind.HOST})
    """The memory kinds this agent moves (registers, reads and writes)."""

    def check_kinds(self, regions: list[Region]) -> None:
        """:class:`TransportError` naming the first region of a kind this agent cannot move."""
        for r in regions:
            if r.kind not in self.kinds:
                moves = ", ".join(sorted(k.value for k in self.kinds))
                raise TransportError(
                    f"agent {self.name!r} ({type(self).__name__}) moves {moves} memory, "
                    f"not the {r.kind.value} region {r.addr:#x} +{r.nbytes} B (device {r.device})"
                )

    @abc.abstractmethod
    def register(self, regions: list[Region]) -> bytes:
        """Register local memory; returns this agent's metadata for peers."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Make a peer known from its metadata; returns its agent name."""

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None: ...

    @abc.abstractmethod
    def read(
        self, peer: str, local: U64, remote: U64, nbytes: U64, notif: bytes | None = None
    ) -> XferHandle:
        """Post a READ of ``nbytes[i]`` bytes from ``remote[i]`` (peer) to ``local[i]``; the
        copy may finish in this call. :class:`TransportError` for a run outside registered
        memory (nothing copied), an unknown or dead peer."""

    @abc.abstractmethod
    def write(
        self, peer: str, local: U64, remote: U64, nbytes: U64, notif: bytes | None = None
    ) -> XferHandle:
        """Post a WRITE of ``nbytes[i]`` bytes from ``local[i]`` to ``remote[i]`` (peer)."""

    @abc.abstractmethod
    def poll(self, handle: XferHandle) -> XferState:
        """Non-blocking; raises :class:`~kvbridge.errors.TransportError` on failure."""

    def wait(self, handle: XferHandle, timeout_s: float) -> None:
        """Poll ``handle`` until done, at most ``timeout_s`` s (sleeps 10 µs → 1 ms); release it.

        :class:`~kvbridge.errors.TransferTimeout` on expiry, ``TransportError`` if it failed.
        A transfer still running at expiry is released too: use :meth:`wait_or_keep` where
        its bytes must not land unnoticed (releasing does not cancel it).
        """
        try:
            self.wait_or_keep(handle, timeout_s)
        finally:
            handle.release()

    def wait_or_keep(self, handle: XferHandle, timeout_s: float) -> None:
        """As :meth:`wait`, but a transfer still running at expiry stays posted (not
        released): the caller keeps polling it (:meth:`ended`) until it ends, because
        neither transport can cancel one. Released when it finished or failed."""
        deadline = time.monotonic() + timeout_s
        pause = 10e-6
        try:
            while self.poll(handle) is not XferState.DONE:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"{handle!r} not done after {timeout_s:.3f} s")
                time.sleep(min(pause, left))
                pause = min(pause * 2, 1e-3)
        except TransferTimeout:
            raise
        except BaseException:
            handle.release()
            raise
        handle.release()

    def ended(self, handle: XferHandle) -> bool:
        """True once no byte of ``handle`` can land any more (done, or failed as the
        transport reports it); then it is released. False while it may still run."""
        try:
            if self.poll(handle) is not XferState.DONE:
                return False
        except TransportError:
            pass
        handle.release()
        return True

    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """Drain received notifications as ``(peer name, message)``."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def as_u64(name: str, values: object) -> np.ndarray:
    """``values`` as a 1-D uint64 array (no copy if already one); refuses negatives."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype.kind not in "ui":
        raise TransportError(f"{name} must be 1-D integers, got {arr.shape} {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise TransportError(f"{name} has a negative entry ({int(arr.min())})")
    return arr.astype(np.uint64, copy=False)


class PostingTransport(Transport):
    """A transport whose :meth:`read` and :meth:`write` are one routine, :meth:`_post`
    (``op`` "READ" or "WRITE"): the loopback's and NIXL's."""

    def read(
        self, peer: str, local: U64, remote: U64, nbytes: U64, notif: bytes | None = None
    ) -> XferHandle:
        return self._post("READ", peer, local, remote, nbytes, notif)

    def write(
        self, peer: str, local: U64, remote: U64, nbytes: U64, notif: bytes | None = None
    ) -> XferHandle:
        return self._post("WRITE", peer, local, remote, nbytes, notif)

    @abc.abstractmethod
    def _post(
        self, op: str, peer: str, local: U64, remote: U64, nbytes: U64, notif: bytes | None
    ) -> XferHandle: ...
