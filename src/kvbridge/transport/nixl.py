"""NIXL transport, the only kvbridge module importing NIXL: one rank's agent
(UCX, progress thread sleeping between polls). Host memory is described as ``DRAM_SEG``,
a GPU's as ``VRAM_SEG`` with its CUDA ordinal on every row; the agent moves device memory
where UCX was built with CUDA and this process sees a GPU (:attr:`NixlTransport.kinds`).
NIXL is loaded through whichever package is installed (:func:`_load_nixl`). NIXL's status
strings, ``None`` returns and binding exceptions become :class:`XferState` values and
:mod:`kvbridge.errors` here. On loopback UCX copies inside ``read()``/``write()`` (GIL
released): call them from a worker thread. Threads may post and poll concurrently;
``close()`` must not race. A dead or stalled peer raises or never finishes: every wait
needs a deadline (:meth:`NixlTransport.wait`). Measured facts: ``docs/performance.md``."""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np

from kvbridge import envs

envs.prepare_process_env()  # UCX_MODULES / NIXL_LOG_LEVEL must precede loading NIXL

from kvbridge.errors import KVBridgeError, PeerError, TransferFailed, TransportError  # noqa: E402
from kvbridge.layout.tensor import MemKind  # noqa: E402
from kvbridge.transport.base import (  # noqa: E402
    U64,
    PostingTransport,
    Region,
    XferHandle,
    XferState,
    as_u64,
)
from kvbridge.transport.memory import cuda_available  # noqa: E402
from kvbridge.transport.nixl_meta import Places, seal, unseal  # noqa: E402

__all__ = ["NixlTransport", "NixlXferHandle"]

log = logging.getLogger(__name__)

NIXL_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")
"""In this order: ``nixl`` picks the build matching the machine's CUDA, then by name."""


def _load_nixl() -> tuple[Any, Any]:
    """``(the _api module, the compiled _bindings module)`` of the NIXL build to use:
    ``KVBRIDGE_NIXL`` if set, else the first of :data:`NIXL_PACKAGES` that imports."""
    names = (envs.nixl_module(),) if envs.nixl_module() else NIXL_PACKAGES
    errors = []
    for name in names:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        package = api.nixl_agent.__module__.rsplit(".", 1)[0]  # nixl maps onto a build
        return api, importlib.import_module(f"{package}._bindings")
    raise ImportError(f"no NIXL package imports ({'; '.join(errors)}); install nixl-cu12 or -cu13")


_api, _nb = _load_nixl()  # compiled, no type stubs
nixl_agent, nixl_agent_config = _api.nixl_agent, _api.nixl_agent_config
NIXL_BUILD: str = _nb.__name__.rsplit(".", 1)[0]  # the build in use, e.g. nixl_cu12
_SEG = {MemKind.HOST: _nb.DRAM_SEG, MemKind.DEVICE: _nb.VRAM_SEG}

# Every exception type the binding raises for a non-success nixl_status_t (and pybind's).
_ERRS = (getattr(_nb, n) for n in dir(_nb) if n.startswith("nixl") and n.endswith("Error"))
_CAUGHT: tuple[type[BaseException], ...] = (*_ERRS, RuntimeError)


def _quietly(what: str, call: Callable[..., object], *args: object) -> bool:
    """Run a clean-up ``call``; a binding error is logged (returns False), not raised."""
    try:
        call(*args)
    except _CAUGHT as exc:
        log.warning("NIXL could not %s: %r", what, exc)
        return False
    return True


@contextlib.contextmanager
def _raising(what: str, error: type[KVBridgeError] = TransportError) -> Iterator[None]:
    """A binding error inside raised as ``error``: ``what`` and the binding's."""
    try:
        yield
    except _CAUGHT as exc:
        raise error(f"{what}: {exc!r}") from exc


def _descs(where: tuple[MemKind, np.ndarray], addrs: np.ndarray, nbytes: np.ndarray) -> Any:
    """A ``nixlXferDList`` of memory ``where[0]`` from ``(addr, len, dev=where[1])`` rows."""
    rows = np.empty((addrs.shape[0], 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addrs, nbytes, where[1]
    return _nb.nixlXferDList(_SEG[where[0]], rows)


class NixlXferHandle(XferHandle):
    """A posted transfer (``runs`` descriptors, ``nbytes`` B); ``release()`` never raises."""

    __slots__ = ("_error", "_owner", "_xfer", "nbytes", "peer", "runs", "state")

    def __init__(self, owner: NixlTransport, xfer: Any, peer: str, runs: int, nbytes: int) -> None:
        self._owner, self._xfer = owner, xfer
        self._error: TransportError | None = None
        self.peer, self.runs, self.nbytes = peer, runs, nbytes
        self.state = XferState.PENDING if xfer is not None else XferState.DONE

    def release(self) -> None:
        self._owner._release(self)

    def __repr__(self) -> str:
        return f"NixlXferHandle({self.peer!r}, {self.runs} runs, {self.nbytes} B, {self.state})"


class NixlTransport(PostingTransport):
    """One rank's NIXL agent; ``name`` must be unique among agents that talk.

    ``progress_delay_us``: progress thread sleep between polls, µs, > 0 (default
    :func:`kvbridge.envs.progress_delay_us`; 1000 µs: an idle agent uses ~4 % of a core).
    ``threads``: UCX worker threads (default :func:`kvbridge.envs.ucx_threads`, 0: NIXL's
    default, none; more speed up many small descriptors, but see that function)."""

    def __init__(
        self, name: str, *, progress_delay_us: int | None = None, threads: int | None = None
    ) -> None:
        envs.prepare_process_env()
        delay = envs.progress_delay_us() if progress_delay_us is None else progress_delay_us
        if delay <= 0:
            raise TransportError(f"progress thread delay must be > 0 µs, got {delay}")
        threads = envs.ucx_threads() if threads is None else threads
        if not 0 <= threads <= 64:
            raise TransportError(f"UCX worker threads must be 0..64, got {threads}")
        self.threads, self.name = threads, name
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[bytes, Places]] = {}  # name -> sealed metadata, places
        self._live: set[NixlXferHandle] = set()
        self._stuck: list[Any] = []  # NIXL refused to release; retried at close
        self._regs: list[Any] = []
        self._places = Places(np.zeros((0, 4), np.uint64))
        self._closed = False
        # NIXL's wrapper hard-codes ``pthrDelay = 0``: build it bare (~0.2 ms), swap in a
        # binding agent made from our config, then instantiate UCX on that (~0.4 s).
        cfg = _nb.nixlAgentConfig()
        cfg.useProgThread, cfg.pthrDelay = True, delay
        cfg.useListenThread, cfg.captureTelemetry = False, False
        cfg.syncMode = _nb.NIXL_THREAD_SYNC_RW
        with _raising(f"cannot create NIXL agent {name!r}"):
            self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
            self._agent.agent = _nb.nixlAgent(name, cfg)
            self._agent.create_backend("UCX", {"num_threads": str(threads)} if threads else {})
        with _raising("cannot read UCX memory types"):
            segs = {str(t) for t in self._agent.get_backend_mem_types("UCX")}
        # device memory where UCX here handles VRAM and this process sees a GPU
        vram = any("VRAM" in t for t in segs) and cuda_available()
        self.kinds = frozenset({MemKind.HOST, MemKind.DEVICE} if vram else {MemKind.HOST})

    def _check_open(self) -> Any:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")
        return self._agent

    def register(self, regions: list[Region]) -> bytes:
        """Register memory regions; returns :meth:`metadata` for peers."""
        agent = self._check_open()
        self.check_kinds(regions)
        if not regions or any(r.nbytes == 0 for r in regions):
            raise TransportError(f"nothing to register or an empty region in {regions!r}")
        for kind in MemKind:
            rows = [(r.addr, r.nbytes, r.device) for r in regions if r.kind is kind]
            if not rows:
                continue
            with _raising(f"cannot register {regions!r}"):
                reg = _nb.nixlRegDList(_SEG[kind], np.array(rows, dtype=np.uint64))
                agent.register_memory(reg)
            with self._lock:
                self._regs.append(reg)
                self._places = self._places.add([r for r in regions if r.kind is kind])
        return self.metadata()

    def metadata(self) -> bytes:
        """This agent's metadata (NIXL's, sealed with name and digest) for :meth:`add_peer`."""
        with _raising("cannot read metadata"):
            blob = bytes(self._check_open().get_agent_metadata())
        with self._lock:
            table = self._places.table
        return seal(self.name, blob, table)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's :meth:`metadata` (:class:`PeerError` if damaged); returns its name.

        The same metadata again is a no-op. New metadata NIXL refuses under a known name
        (a restarted peer) replaces the old entry, failing that peer's live transfers."""
        self._check_open()
        name, blob, table = unseal(metadata)
        if name == self.name:
            raise PeerError(f"peer metadata carries this agent's own name {name!r}")
        md = bytes(metadata)
        with self._lock:
            entry = self._peers.get(name)  # (sealed metadata, places) if known
        known = entry[0] if entry is not None else None
        if known == md:
            return name
        if known is not None:
            try:
                return self._load(name, blob, md, table)
            except PeerError as err:
                if not isinstance(err.__cause__, _nb.nixlNotAllowedError):
                    raise
            self.remove_peer(name)
        return self._load(name, blob, md, table)

    def _load(self, name: str, blob: bytes, md: bytes, table: np.ndarray) -> str:
        """Hand ``blob`` to NIXL; remember peer ``name`` with its sealed metadata ``md``."""
        agent = self._check_open()
        with _raising(f"NIXL rejected metadata of peer {name!r}", PeerError):
            loaded = agent.add_remote_agent(blob)
        peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        with self._lock:
            if peer == name:
                self._peers[peer] = (md, Places(table))
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

    def peers(self) -> list[str]:  # the known peers' names, sorted
        with self._lock:
            return sorted(self._peers)

    def _post(
        self, op: str, peer: str, local: U64, remote: U64, nbytes: U64, notif: bytes | None
    ) -> NixlXferHandle:
        """Check the runs, build both descriptor lists and post one request."""
        agent = self._check_open()
        loc, rem, size = as_u64("local", local), as_u64("remote", remote), as_u64("nbytes", nbytes)
        if not loc.shape == rem.shape == size.shape:
            shapes = f"local {loc.shape}, remote {rem.shape}, nbytes {size.shape}"
            raise TransportError(f"{op} with {peer!r}: need equal lengths, got {shapes}")
        with self._lock:
            here, known = self._places, self._peers.get(peer)
        if known is None:
            raise TransportError(f"{op}: unknown peer {peer!r}; add_peer() it first")
        msg, runs, total = bytes(notif or b""), int(size.shape[0]), int(size.sum(dtype=np.uint64))
        if runs == 0:  # NIXL cannot build an empty request
            with _raising(f"notify {peer!r}"):
                if msg:
                    agent.send_notif(peer, msg)
            return NixlXferHandle(self, None, peer, 0, 0)
        local_d = _descs(here.kind_devs(loc, "local"), loc, size)
        remote_d = _descs(known[1].kind_devs(rem, f"{peer!r}'s"), rem, size)
        try:
            xfer = agent.initialize_xfer(op, local_d, remote_d, peer, msg)
        except _CAUGHT as exc:
            raise TransportError(
                f"{op} of {runs} runs ({total} B) with {peer!r} refused: {exc!r} "
                "(NOT_FOUND: a run outside registered memory)"
            ) from exc
        return self._start(op, xfer, peer, runs, total)

    def _start(self, op: str, xfer: Any, peer: str, runs: int, total: int) -> NixlXferHandle:
        """Post a built request (also the bench's prepared ones, ``benchmarks/nixl_prepped.py``)."""
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
        with _raising("cannot read notifications"):
            raw = self._check_open().get_new_notifs()
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
