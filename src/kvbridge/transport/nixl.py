"""NIXL transport, the only kvbridge module importing NIXL: one rank's agent
(UCX, host memory, device 0, progress thread sleeping between polls). NIXL's status
strings, ``None`` returns and binding exceptions become :class:`XferState` values and
:mod:`kvbridge.errors` here. On loopback UCX copies inside ``read()``/``write()``
(256 MiB: 0.06–0.4 s here, GIL released): call them from a worker thread, not an event
loop. Reader/writer sync mode: threads may post and poll concurrently; ``close()`` must
not race. A dead or stalled peer raises or never finishes: every wait needs a deadline
(:meth:`NixlTransport.wait`). Measured facts: ``shared/NIXL_NOTES.md``."""

from __future__ import annotations

import hashlib
import importlib
import logging
import struct
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from kvbridge import envs

envs.prepare_process_env()  # UCX_MODULES / NIXL_LOG_LEVEL must precede loading NIXL

from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_xfer_handle  # noqa: E402

from kvbridge.errors import PeerError, TransferFailed, TransportError  # noqa: E402
from kvbridge.transport.base import Region, Transport, XferHandle, XferState, host_only  # noqa: E402

__all__ = ["NixlTransport", "NixlXferHandle"]
_U64 = np.ndarray  # 1-D uint64 (any non-negative integer dtype is accepted)

log = logging.getLogger(__name__)
_nb: Any = importlib.import_module("nixl_cu12._bindings")  # compiled, no type stubs

# Every exception type the binding raises for a non-success nixl_status_t (and pybind's).
_ERRS = (getattr(_nb, n) for n in dir(_nb) if n.startswith("nixl") and n.endswith("Error"))
_CAUGHT: tuple[type[BaseException], ...] = (*_ERRS, RuntimeError)

# Metadata envelope: header (magic+version, name and blob lengths), name, NIXL blob,
# BLAKE2b digest. NIXL must never see a damaged blob: one a byte short half-loads and the
# name stays unusable in this process (NIXL_ERR_INVALID_PARAM even after removal).
_MAGIC = b"KVBNIXL1"
_HEAD = struct.Struct("<8sHI")
_DIGEST_BYTES = 16


def _seal(name: str, blob: bytes) -> bytes:
    """Wrap NIXL metadata ``blob`` of agent ``name`` in the checked envelope."""
    raw_name = name.encode()
    body = _HEAD.pack(_MAGIC, len(raw_name), len(blob)) + raw_name + blob
    return body + hashlib.blake2b(body, digest_size=_DIGEST_BYTES).digest()


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
    if hashlib.blake2b(md[:body_len], digest_size=_DIGEST_BYTES).digest() != md[body_len:]:
        raise PeerError(f"peer metadata ({len(md)} B) fails its digest check")
    try:
        name = md[_HEAD.size : _HEAD.size + name_len].decode()
    except UnicodeDecodeError as exc:
        raise PeerError(f"peer name is not UTF-8: {exc}") from exc
    return name, md[_HEAD.size + name_len : body_len]


def _quietly(what: str, call: Callable[..., object], *args: object) -> bool:
    """Run a clean-up ``call``; a binding error is logged (returns False), not raised."""
    try:
        call(*args)
    except _CAUGHT as exc:
        log.warning("NIXL could not %s: %r", what, exc)
        return False
    return True


def _as_u64(name: str, values: object) -> np.ndarray:
    """``values`` as a 1-D uint64 array (no copy if already one); refuses negatives."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype.kind not in "ui":
        raise TransportError(f"{name} must be 1-D integers, got {arr.shape} {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise TransportError(f"{name} has a negative entry ({int(arr.min())})")
    return arr.astype(np.uint64, copy=False)


def _descs(addrs: np.ndarray, nbytes: np.ndarray) -> Any:
    """A DRAM ``nixlXferDList`` built from an ``(N, 3)`` ``(addr, len, dev=0)`` array."""
    rows = np.zeros((addrs.shape[0], 3), dtype=np.uint64)
    rows[:, 0] = addrs
    rows[:, 1] = nbytes
    return _nb.nixlXferDList(_nb.DRAM_SEG, rows)


class NixlXferHandle(XferHandle):
    """A posted transfer (``runs`` descriptors, ``nbytes`` B); ``release()`` never raises."""

    __slots__ = ("_error", "_owner", "_xfer", "nbytes", "peer", "runs", "state")

    def __init__(
        self, owner: NixlTransport, xfer: nixl_xfer_handle | None, peer: str, runs: int, nbytes: int
    ) -> None:
        self._owner, self._xfer = owner, xfer
        self._error: TransportError | None = None
        self.peer, self.runs, self.nbytes = peer, runs, nbytes
        self.state = XferState.PENDING if xfer is not None else XferState.DONE

    def release(self) -> None:
        self._owner._release(self)

    def __repr__(self) -> str:
        return f"NixlXferHandle({self.peer!r}, {self.runs} runs, {self.nbytes} B, {self.state})"


class NixlTransport(Transport):
    """One rank's NIXL agent; ``name`` must be unique among agents that talk.

    ``progress_delay_us``: progress thread sleep between polls, µs, > 0 (default
    :func:`kvbridge.envs.progress_delay_us`; 1000 µs: an idle agent uses ~4 % of a core)."""

    def __init__(self, name: str, *, progress_delay_us: int | None = None) -> None:
        envs.prepare_process_env()
        delay = envs.progress_delay_us() if progress_delay_us is None else progress_delay_us
        if delay <= 0:
            raise TransportError(f"progress thread delay must be > 0 µs, got {delay}")
        self.name = name
        self._lock = threading.Lock()
        self._peers: dict[str, bytes] = {}  # name -> sealed metadata
        self._live: set[NixlXferHandle] = set()
        self._stuck: list[nixl_xfer_handle] = []  # NIXL refused to release; retried at close
        self._regs: list[Any] = []
        self._closed = False
        self._agent = self._make_agent(name, delay)

    @staticmethod
    def _make_agent(name: str, delay_us: int) -> nixl_agent:
        """The wrapper hard-codes ``pthrDelay = 0``: build it bare (~0.2 ms), swap in a
        binding agent made from our config, then instantiate UCX on that (~0.4 s)."""
        cfg = _nb.nixlAgentConfig()
        cfg.useProgThread, cfg.pthrDelay = True, delay_us
        cfg.useListenThread, cfg.captureTelemetry = False, False
        cfg.syncMode = _nb.NIXL_THREAD_SYNC_RW
        try:
            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
            agent.agent = _nb.nixlAgent(name, cfg)
            agent.create_backend("UCX", {})
        except _CAUGHT as exc:
            raise TransportError(f"cannot create NIXL agent {name!r}: {exc!r}") from exc
        return agent

    def _check_open(self) -> nixl_agent:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")
        return self._agent

    def register(self, regions: list[Region]) -> bytes:
        """Register host memory regions; returns :meth:`metadata` (bytes) for peers."""
        agent = self._check_open()
        host_only(regions, self.name)
        rows = np.array([(r.addr, r.nbytes, 0) for r in regions], dtype=np.uint64)
        if rows.size == 0 or (rows[:, 1] == 0).any():
            raise TransportError(f"nothing to register or an empty region in {regions!r}")
        try:
            reg = _nb.nixlRegDList(_nb.DRAM_SEG, rows)
            agent.register_memory(reg)
        except _CAUGHT as exc:
            raise TransportError(f"cannot register {regions!r}: {exc!r}") from exc
        with self._lock:
            self._regs.append(reg)
        return self.metadata()

    def metadata(self) -> bytes:
        """This agent's metadata (NIXL's, sealed with name and digest) for :meth:`add_peer`."""
        try:
            blob = bytes(self._check_open().get_agent_metadata())
        except _CAUGHT as exc:
            raise TransportError(f"cannot read metadata: {exc!r}") from exc
        return _seal(self.name, blob)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's :meth:`metadata` (:class:`PeerError` if damaged); returns its name.

        The same metadata again is a no-op. New metadata NIXL refuses under a known name
        (a restarted peer) replaces the old entry, failing that peer's live transfers."""
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
        """Hand ``blob`` to NIXL; remember peer ``name`` with its sealed metadata ``md``."""
        agent = self._check_open()
        try:
            loaded = agent.add_remote_agent(blob)
        except _CAUGHT as exc:
            raise PeerError(f"NIXL rejected metadata of peer {name!r}: {exc!r}") from exc
        peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        with self._lock:
            if peer == name:
                self._peers[peer] = md
                return peer
            if peer not in self._peers:
                agent.remove_remote_agent(peer)
        raise PeerError(f"metadata is labelled {name!r} but NIXL loaded agent {peer!r}")

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect; its live transfers fail. Unknown names: no-op."""
        with self._lock:
            if self._closed or self._peers.pop(name, None) is None:
                return
            doomed = [h for h in self._live if h.peer == name]
        for handle in doomed:
            handle._error, handle.state = TransportError(f"peer {name!r} removed"), XferState.FAILED
            self._release(handle)
        _quietly(f"remove peer {name!r}", self._agent.remove_remote_agent, name)

    def peers(self) -> list[str]:
        """Names of the known peers, sorted."""
        with self._lock:
            return sorted(self._peers)

    def read(
        self, peer: str, local: _U64, remote: _U64, nbytes: _U64, notif: bytes | None = None
    ) -> NixlXferHandle:
        """Post a READ of ``nbytes[i]`` bytes from ``remote[i]`` (peer) to ``local[i]``.

        Byte addresses in registered memory; the copy may finish in this call. ``notif``
        (``None``/``b""``: none) reaches the peer after the data. :class:`TransportError`
        for a run outside registered memory (nothing copied), an unknown or dead peer."""
        return self._post("READ", peer, local, remote, nbytes, notif)

    def write(
        self, peer: str, local: _U64, remote: _U64, nbytes: _U64, notif: bytes | None = None
    ) -> NixlXferHandle:
        """Post a WRITE of ``nbytes[i]`` bytes from ``local[i]`` to ``remote[i]`` (peer).

        As :meth:`read`; the notification reaches the peer after the data landed."""
        return self._post("WRITE", peer, local, remote, nbytes, notif)

    def _runs(self, op: str, peer: str, *arrays: object) -> tuple[np.ndarray, ...]:
        """Checked ``(local, remote, nbytes)`` uint64 arrays for ``op`` with ``peer``."""
        loc, rem, size = (
            _as_u64(n, a) for n, a in zip(("local", "remote", "nbytes"), arrays, strict=True)
        )
        if not loc.shape == rem.shape == size.shape:
            msg = f"local {loc.shape}, remote {rem.shape}, nbytes {size.shape}"
            raise TransportError(f"{op} with {peer!r}: need equal lengths, got {msg}")
        with self._lock:
            if peer not in self._peers:
                raise TransportError(f"{op}: unknown peer {peer!r}; add_peer() it first")
        return loc, rem, size

    def _post(
        self, op: str, peer: str, local: object, remote: object, nbytes: object, notif: bytes | None
    ) -> NixlXferHandle:
        """Validate the runs, build both descriptor lists and post one request."""
        agent = self._check_open()
        loc, rem, size = self._runs(op, peer, local, remote, nbytes)
        msg, runs, total = bytes(notif or b""), int(size.shape[0]), int(size.sum(dtype=np.uint64))
        if runs == 0:  # NIXL cannot build an empty request
            try:
                if msg:
                    agent.send_notif(peer, msg)
            except _CAUGHT as exc:
                raise TransportError(f"notify {peer!r}: {exc!r}") from exc
            return NixlXferHandle(self, None, peer, 0, 0)
        try:
            xfer = agent.initialize_xfer(op, _descs(loc, size), _descs(rem, size), peer, msg)
        except _CAUGHT as exc:
            raise TransportError(
                f"{op} of {runs} runs ({total} B) with {peer!r} refused: {exc!r} "
                "(NOT_FOUND: a run outside registered memory)"
            ) from exc
        return self._start(op, xfer, peer, runs, total)

    def prep(self, peer: str, rows: np.ndarray) -> Any:
        """NIXL list of uint64 rows (addr, len, 0[, stride, count]); ``peer`` "": own memory."""
        try:
            return self._check_open().prep_xfer_dlist(peer, rows, "DRAM")
        except _CAUGHT as exc:
            raise TransportError(f"cannot prepare {len(rows)} rows for {peer!r}: {exc!r}") from exc

    def read_prepped(self, peer: str, lists: Any, idx: Any, nbytes: int) -> NixlXferHandle:
        """READ runs ``idx[1]`` of the peer's list ``lists[1]`` (from :meth:`prep`) to runs
        ``idx[0]`` of ``lists[0]`` (int32 indices); ``nbytes``: their total."""
        try:
            xfer = self._check_open().make_prepped_xfer("READ", lists[0], idx[0], lists[1], idx[1])
        except _CAUGHT as exc:
            raise TransportError(f"prepped READ of {len(idx[0])} runs refused: {exc!r}") from exc
        return self._start("READ", xfer, peer, len(idx[0]), nbytes)

    def _start(self, op: str, xfer: Any, peer: str, runs: int, total: int) -> NixlXferHandle:
        agent, handle = self._check_open(), NixlXferHandle(self, xfer, peer, runs, total)
        with self._lock:
            self._live.add(handle)
        try:
            status = agent.transfer(xfer)
        except _CAUGHT as exc:
            self._fail(handle, f"posting {op} failed: {exc!r}")
        if status == "ERR":
            self._fail(handle, f"posting {op} returned an error")
        if status == "DONE":
            handle.state = XferState.DONE
        return handle

    def _fail(self, handle: NixlXferHandle, why: str, nixl: bool = True) -> NoReturn:
        """Mark ``handle`` failed, release it and raise :class:`TransferFailed` (NIXL said
        so: ``nixl``) or :class:`TransportError`."""
        err = (TransferFailed if nixl else TransportError)(f"transfer {handle!r}: {why}")
        handle._error, handle.state = err, XferState.FAILED
        self._release(handle)
        raise err

    def poll(self, handle: XferHandle) -> XferState:
        """``PENDING`` or ``DONE`` (also after release); raises :class:`TransportError`
        if the transfer failed, again on every later poll."""
        if not isinstance(handle, NixlXferHandle) or handle._owner is not self:
            raise TransportError(f"{handle!r} was not posted by transport {self.name!r}")
        if handle.state is XferState.DONE:
            return XferState.DONE
        if handle._error is not None:
            raise handle._error
        xfer = handle._xfer
        if xfer is None:
            self._fail(handle, "handle was released before it finished", nixl=False)
        try:
            status = self._check_open().check_xfer_state(xfer)
        except _CAUGHT as exc:
            self._fail(handle, f"failed: {exc!r}")
        if status == "DONE":
            handle.state = XferState.DONE
            return XferState.DONE
        if status == "PROC":
            return XferState.PENDING
        self._fail(handle, f"NIXL reported state {status!r}")

    def _release(self, handle: NixlXferHandle) -> None:
        """Free (or cancel) the request behind ``handle``; refusals are kept for close."""
        with self._lock:
            xfer, handle._xfer = handle._xfer, None
            self._live.discard(handle)
        if xfer is not None and not _quietly(f"release {handle!r}", xfer.release):
            with self._lock:
                self._stuck.append(xfer)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Drain the notifications received so far as ``(peer name, message)`` pairs."""
        try:
            raw = self._check_open().get_new_notifs()
        except _CAUGHT as exc:
            raise TransportError(f"reading notifications failed: {exc!r}") from exc
        return [(str(peer), bytes(m)) for peer, msgs in raw.items() for m in msgs]

    def close(self) -> None:
        """Release requests, drop peers, deregister, destroy the agent; idempotent."""
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
            stuck, regs = self._stuck, self._regs
            self._stuck, self._regs = [], []
        for xfer in stuck:
            _quietly("release a request at close", xfer.release)
        for reg in regs:
            _quietly("deregister memory at close", self._agent.deregister_memory, reg)
        del self._agent

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
