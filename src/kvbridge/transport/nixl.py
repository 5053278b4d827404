"""NIXL transport: the only kvbridge module that imports NIXL (DESIGN §5).

One :class:`NixlTransport` is one rank's NIXL agent with the UCX backend on host memory
(DRAM, device id 0). Everything NIXL reports — ``"DONE"``/``"PROC"``/``"ERR"`` strings,
``None`` returns, binding exceptions — is turned here into :class:`XferState` values and
:mod:`kvbridge.errors` exceptions; none of it leaves this module.

Threading: with UCX's loopback transports :meth:`NixlTransport.read` and
:meth:`NixlTransport.write` may perform the whole copy inside the call (hundreds of ms
for a large plan; the GIL is released meanwhile). Run them from a worker thread, never
on an event loop. The agent uses NIXL's reader/writer sync mode, so posting and polling
from several threads is safe; :meth:`NixlTransport.close` must not race with other calls.

Facts this module relies on are measured in ``shared/NIXL_NOTES.md``: the progress
thread's poll delay must be non-zero (the stock Python wrapper hard-codes 0 and burns a
core), a dead peer shows up as an exception or as a transfer that never finishes (so
every wait needs a deadline: :meth:`NixlTransport.wait`), and re-adding a known agent
name is refused by NIXL unless the old entry is removed first.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import struct
import threading
import time
from typing import Any, NoReturn

import numpy as np

from kvbridge import envs

# UCX_MODULES / NIXL_LOG_LEVEL must be in place before NIXL is loaded.
envs.prepare_process_env()

from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_xfer_handle  # noqa: E402

from kvbridge.errors import PeerError, TransferTimeout, TransportError  # noqa: E402
from kvbridge.transport.base import Region, Transport, XferHandle, XferState  # noqa: E402

# The compiled binding has no type stubs.
_nb: Any = importlib.import_module("nixl_cu12._bindings")

__all__ = ["NixlTransport", "NixlXferHandle"]

log = logging.getLogger(__name__)

# Every exception type the binding raises for a non-success nixl_status_t.
_NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(_nb, n) for n in dir(_nb) if n.startswith("nixl") and n.endswith("Error")
)
_CAUGHT: tuple[type[BaseException], ...] = (*_NIXL_ERRORS, RuntimeError)

# Metadata travels in an envelope: magic+version, name and blob lengths, the agent name,
# NIXL's own metadata blob and a BLAKE2b digest of all that. NIXL cannot be handed a
# damaged blob safely: one truncated by a byte half-loads and leaves that agent name
# unusable for the rest of the process (measured: every later load raises
# NIXL_ERR_INVALID_PARAM, even after remove_remote_agent).
_MAGIC = b"KVBNIXL1"
_HEAD = struct.Struct("<8sHI")
_DIGEST_BYTES = 16


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def _seal(name: str, blob: bytes) -> bytes:
    """Wrap NIXL metadata ``blob`` of agent ``name`` in kvbridge's checked envelope."""
    raw_name = name.encode()
    body = _HEAD.pack(_MAGIC, len(raw_name), len(blob)) + raw_name + blob
    return body + _digest(body)


def _unseal(data: object) -> tuple[str, bytes]:
    """``(agent name, NIXL blob)`` from an envelope; :class:`PeerError` if damaged."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PeerError(f"peer metadata must be bytes, got {type(data).__name__}")
    md = bytes(data)
    if len(md) < _HEAD.size + _DIGEST_BYTES or not md.startswith(_MAGIC):
        raise PeerError(f"not kvbridge NIXL metadata ({len(md)} B, head {md[:16]!r})")
    _, name_len, blob_len = _HEAD.unpack_from(md)
    body_len = _HEAD.size + name_len + blob_len
    if len(md) != body_len + _DIGEST_BYTES:
        raise PeerError(f"peer metadata is {len(md)} B, its header says {body_len + 16} B")
    if _digest(md[:body_len]) != md[body_len:]:
        raise PeerError(f"peer metadata ({len(md)} B) fails its digest check")
    try:
        name = md[_HEAD.size : _HEAD.size + name_len].decode()
    except UnicodeDecodeError as exc:
        raise PeerError(f"peer name is not UTF-8: {exc}") from exc
    return name, md[_HEAD.size + name_len : body_len]


def _describe(exc: BaseException) -> str:
    """``"nixlNotFoundError: NIXL_ERR_NOT_FOUND"`` style text for a binding error."""
    return f"{type(exc).__name__}: {exc}"


def _as_u64(name: str, values: object) -> np.ndarray:
    """A 1-D uint64 view/copy of ``values``; negative or non-integer input is refused."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype.kind not in "ui":
        raise TransportError(
            f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}"
        )
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise TransportError(f"{name} has a negative entry ({int(arr.min())})")
    return arr.astype(np.uint64, copy=False)


def _descs(addrs: np.ndarray, nbytes: np.ndarray) -> Any:
    """A DRAM descriptor list from an ``(N, 3)`` ``(addr, len, dev=0)`` uint64 array."""
    rows = np.empty((addrs.shape[0], 3), dtype=np.uint64)
    rows[:, 0] = addrs
    rows[:, 1] = nbytes
    rows[:, 2] = 0
    return _nb.nixlXferDList(_nb.DRAM_SEG, rows)


class NixlXferHandle(XferHandle):
    """A posted NIXL transfer.

    ``peer`` is the remote agent's name, ``nbytes`` the total bytes moved, ``runs`` the
    descriptor count and ``state`` the last state observed (``FAILED`` once an error
    was raised for it). ``release()`` is idempotent and never raises.
    """

    __slots__ = ("_error", "_owner", "_xfer", "nbytes", "peer", "runs", "state")

    def __init__(
        self, owner: NixlTransport, xfer: nixl_xfer_handle | None, peer: str, runs: int, nbytes: int
    ) -> None:
        self._owner = owner
        self._xfer = xfer
        self._error: TransportError | None = None
        self.peer = peer
        self.runs = runs
        self.nbytes = nbytes
        self.state = XferState.PENDING if xfer is not None else XferState.DONE

    def release(self) -> None:
        self._owner._release(self)

    def __repr__(self) -> str:
        return (
            f"NixlXferHandle(peer={self.peer!r}, runs={self.runs}, nbytes={self.nbytes}, "
            f"state={self.state.name})"
        )


class NixlTransport(Transport):
    """One rank's NIXL agent (UCX backend, host memory, progress thread with a delay).

    ``name`` must be unique among the agents that talk to each other.
    ``progress_delay_us`` is the progress thread's sleep between polls in µs
    (default :func:`kvbridge.envs.progress_delay_us`); it must be positive.
    """

    def __init__(self, name: str, *, progress_delay_us: int | None = None) -> None:
        envs.prepare_process_env()
        delay = envs.progress_delay_us() if progress_delay_us is None else progress_delay_us
        if delay <= 0:
            raise TransportError(f"progress thread delay must be > 0 µs, got {delay}")
        self.name = name
        self._lock = threading.Lock()
        self._peers: dict[str, bytes] = {}
        self._live: set[NixlXferHandle] = set()
        self._stuck: list[nixl_xfer_handle] = []
        self._regs: list[Any] = []
        self._closed = False
        self._agent = self._make_agent(name, delay)

    @staticmethod
    def _make_agent(name: str, delay_us: int) -> nixl_agent:
        """Build the Python agent around a binding agent whose config we control.

        The stock wrapper fixes the progress delay at 0 µs. So the wrapper is created
        without backend or progress thread (cheap, ~0.2 ms), its binding agent is
        replaced by one built from our own config, and UCX is instantiated on that.
        """
        cfg = _nb.nixlAgentConfig()
        cfg.useProgThread = True
        cfg.useListenThread = False
        cfg.pthrDelay = delay_us
        cfg.syncMode = _nb.NIXL_THREAD_SYNC_RW
        cfg.captureTelemetry = False
        try:
            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
            agent.agent = _nb.nixlAgent(name, cfg)
            agent.create_backend("UCX", {})
        except _CAUGHT as exc:
            raise TransportError(f"cannot create NIXL agent {name!r}: {_describe(exc)}") from exc
        return agent

    def _check_open(self) -> nixl_agent:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")
        return self._agent

    # -- memory and peers -------------------------------------------------------------

    def register(self, regions: list[Region]) -> bytes:
        """Register host memory regions (bytes) and return this agent's full metadata."""
        agent = self._check_open()
        rows = np.array([(r.addr, r.nbytes, 0) for r in regions], dtype=np.uint64)
        if rows.size == 0 or (rows[:, 1] == 0).any():
            raise TransportError(f"nothing to register or an empty region in {regions!r}")
        try:
            reg = _nb.nixlRegDList(_nb.DRAM_SEG, rows.reshape(-1, 3))
            agent.register_memory(reg)
        except _CAUGHT as exc:
            raise TransportError(f"cannot register {regions!r}: {_describe(exc)}") from exc
        with self._lock:
            self._regs.append(reg)
        return self.metadata()

    def metadata(self) -> bytes:
        """This agent's current metadata (bytes, sealed) for peers' :meth:`add_peer`."""
        try:
            blob = bytes(self._check_open().get_agent_metadata())
        except _CAUGHT as exc:
            raise TransportError(f"cannot read metadata: {_describe(exc)}") from exc
        return _seal(self.name, blob)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (from its :meth:`metadata`); returns its agent name.

        The same metadata again is a no-op. Metadata that NIXL refuses under a known name
        (a restarted peer) replaces the old entry: the old one is removed first, which
        fails that peer's live transfers. Damaged metadata raises :class:`PeerError`.
        """
        self._check_open()
        name, blob = _unseal(metadata)
        if name == self.name:
            raise PeerError(f"peer metadata carries this agent's own name {name!r}")
        md = bytes(metadata)
        with self._lock:
            known = self._peers.get(name)
        if known == md:
            return name
        if known is not None:
            try:
                return self._load(name, blob, md)
            except PeerError as err:
                if not isinstance(err.__cause__, _nb.nixlNotAllowedError):
                    raise
            self.remove_peer(name)
        return self._load(name, blob, md)

    def _load(self, name: str, blob: bytes, md: bytes) -> str:
        """Hand ``blob`` to NIXL and remember peer ``name`` with its sealed ``md``."""
        agent = self._check_open()
        try:
            loaded = agent.add_remote_agent(blob)
        except _CAUGHT as exc:
            raise PeerError(f"NIXL rejected metadata of peer {name!r}: {_describe(exc)}") from exc
        peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if peer != name:
            with self._lock:
                if peer not in self._peers:
                    agent.remove_remote_agent(peer)
            raise PeerError(f"metadata names {name!r} but NIXL loaded {peer!r}")
        with self._lock:
            self._peers[peer] = md
        return peer

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect from it; its live transfers are released.

        Unknown names are ignored.
        """
        with self._lock:
            if self._closed or self._peers.pop(name, None) is None:
                return
            doomed = [h for h in self._live if h.peer == name]
        for handle in doomed:
            handle._error = TransportError(f"peer {name!r} was removed")
            handle.state = XferState.FAILED
            self._release(handle)
        try:
            self._agent.remove_remote_agent(name)
        except _CAUGHT as exc:
            log.warning("removing NIXL peer %r: %s", name, _describe(exc))

    def peers(self) -> list[str]:
        """Names of the peers currently known."""
        with self._lock:
            return sorted(self._peers)

    # -- transfers --------------------------------------------------------------------

    def read(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        notif: bytes | None = None,
    ) -> NixlXferHandle:
        """Post a READ: copy ``nbytes[i]`` bytes from ``remote[i]`` (peer) to ``local[i]``.

        Addresses are byte addresses in registered memory; the copy may complete inside
        this call (see the module docstring). ``notif`` (non-empty bytes) reaches the
        peer after the data moved. Raises :class:`TransportError`, e.g. when a run
        leaves either side's registered memory (nothing is copied then).
        """
        return self._post("READ", peer, local, remote, nbytes, notif)

    def write(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        notif: bytes | None = None,
    ) -> NixlXferHandle:
        """Post a WRITE: copy ``nbytes[i]`` bytes from ``local[i]`` to ``remote[i]`` (peer).

        Same rules as :meth:`read`; the notification lands after the data.
        """
        return self._post("WRITE", peer, local, remote, nbytes, notif)

    def _post(
        self,
        op: str,
        peer: str,
        local: object,
        remote: object,
        nbytes: object,
        notif: bytes | None,
    ) -> NixlXferHandle:
        """Validate the runs, build both descriptor lists and post one transfer."""
        agent = self._check_open()
        loc, rem, size = (
            _as_u64("local", local),
            _as_u64("remote", remote),
            _as_u64("nbytes", nbytes),
        )
        if not loc.shape == rem.shape == size.shape:
            raise TransportError(
                f"{op} to {peer!r}: local {loc.shape}, remote {rem.shape} and nbytes "
                f"{size.shape} must have equal lengths"
            )
        with self._lock:
            known = peer in self._peers
        if not known:
            raise TransportError(f"{op}: unknown peer {peer!r}; add_peer() it first")
        msg = bytes(notif) if notif else b""
        total = int(size.sum(dtype=np.uint64))
        if size.shape[0] == 0:
            if msg:
                self._notify(agent, peer, msg)
            return NixlXferHandle(self, None, peer, 0, 0)
        try:
            xfer = agent.initialize_xfer(op, _descs(loc, size), _descs(rem, size), peer, msg)
        except _CAUGHT as exc:
            raise TransportError(
                f"{op} of {size.shape[0]} runs ({total} B) with {peer!r} refused: "
                f"{_describe(exc)} (a run outside registered memory?)"
            ) from exc
        handle = NixlXferHandle(self, xfer, peer, int(size.shape[0]), total)
        with self._lock:
            self._live.add(handle)
        try:
            status = agent.transfer(xfer)
        except _CAUGHT as exc:
            self._fail(handle, f"posting {op} failed: {_describe(exc)}")
        if status == "ERR":
            self._fail(handle, f"posting {op} returned an error")
        if status == "DONE":
            handle.state = XferState.DONE
        return handle

    def _notify(self, agent: nixl_agent, peer: str, msg: bytes) -> None:
        try:
            agent.send_notif(peer, msg)
        except _CAUGHT as exc:
            raise TransportError(f"notification to {peer!r} failed: {_describe(exc)}") from exc

    def _fail(self, handle: NixlXferHandle, why: str) -> NoReturn:
        """Mark ``handle`` failed, release it and raise the error; never returns."""
        err = TransportError(
            f"transfer with {handle.peer!r} ({handle.runs} runs, {handle.nbytes} B): {why}"
        )
        handle._error = err
        handle.state = XferState.FAILED
        self._release(handle)
        raise err

    def poll(self, handle: XferHandle) -> XferState:
        """``PENDING`` or ``DONE``; raises :class:`TransportError` if it failed.

        A failed handle keeps raising the same error; a done one keeps reporting
        ``DONE`` even after release.
        """
        if not isinstance(handle, NixlXferHandle) or handle._owner is not self:
            raise TransportError(f"{handle!r} was not posted by transport {self.name!r}")
        if handle.state is XferState.DONE:
            return XferState.DONE
        if handle._error is not None:
            raise handle._error
        xfer = handle._xfer
        if xfer is None:
            self._fail(handle, "handle was released before it finished")
        try:
            status = self._check_open().check_xfer_state(xfer)
        except _CAUGHT as exc:
            self._fail(handle, f"failed: {_describe(exc)}")
        if status == "DONE":
            handle.state = XferState.DONE
            return XferState.DONE
        if status == "PROC":
            return XferState.PENDING
        self._fail(handle, f"NIXL reported state {status!r}")

    def wait(self, handle: XferHandle, timeout_s: float) -> None:
        """Poll ``handle`` until done, for at most ``timeout_s`` seconds; then release it.

        Raises :class:`TransferTimeout` when the time runs out and
        :class:`TransportError` when the transfer fails; the handle is released in
        every case. Sleeps grow from 10 µs to 1 ms between polls.
        """
        deadline = time.monotonic() + timeout_s
        pause = 10e-6
        try:
            while self.poll(handle) is not XferState.DONE:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"{handle!r} not done after {timeout_s:.3f} s")
                time.sleep(min(pause, left))
                pause = min(pause * 2, 1e-3)
        finally:
            handle.release()

    def _release(self, handle: NixlXferHandle) -> None:
        """Free the NIXL request behind ``handle``; failures are kept for :meth:`close`."""
        with self._lock:
            xfer, handle._xfer = handle._xfer, None
            self._live.discard(handle)
        if xfer is None:
            return
        try:
            xfer.release()
        except _CAUGHT as exc:
            log.warning("NIXL could not release %r: %s", handle, _describe(exc))
            with self._lock:
                self._stuck.append(xfer)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Drain notifications received so far as ``(peer name, message)`` pairs."""
        try:
            raw = self._check_open().get_new_notifs()
        except _CAUGHT as exc:
            raise TransportError(f"reading notifications failed: {_describe(exc)}") from exc
        return [(str(peer), bytes(m)) for peer, msgs in raw.items() for m in msgs]

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Release transfers, drop peers, deregister memory, destroy the agent.

        Idempotent; never raises (problems are logged).
        """
        with self._lock:
            if self._closed:
                return
            live, peers = list(self._live), list(self._peers)
        for handle in live:
            self._release(handle)
        for peer in peers:
            self.remove_peer(peer)
        with self._lock:
            self._closed = True
            stuck, self._stuck = self._stuck, []
            regs, self._regs = self._regs, []
        for xfer in stuck:
            try:
                xfer.release()
            except _CAUGHT as exc:
                log.warning("NIXL request still unreleasable at close: %s", _describe(exc))
        for reg in regs:
            try:
                self._agent.deregister_memory(reg)
            except _CAUGHT as exc:
                log.warning("NIXL deregistration failed at close: %s", _describe(exc))
        del self._agent

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
