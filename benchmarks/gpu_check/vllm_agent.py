"""A raw NIXL agent for the vLLM-like path: ``nixl_agent_config(num_threads=N)`` as vLLM
passes it (UCX worker threads), loaded through kvbridge's NIXL loader (the ``nixl``
package, which picks the build matching the machine's CUDA). Its progress thread sleeps
``KVBRIDGE_PROGRESS_DELAY_US`` between polls, as kvbridge's own agents do: the Python
wrapper's default (0) spins a core per agent, which on a shared machine slows everyone.

``NIXL_UCX_SGL_ENABLE=1`` (UCX scatter-gather put, WRITE only) is read once per process by
NIXL's UCX plugin: the check sets it for the rank processes before NIXL loads.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge import envs
from kvbridge.errors import TransferTimeout, TransportError
from kvbridge.layout.tensor import MemKind, Region
from kvbridge.transport.nixl import NIXL_BUILD, nixl_agent, nixl_agent_config

_nb = importlib.import_module(f"{NIXL_BUILD}._bindings")
MEM = {MemKind.HOST: "DRAM", MemKind.DEVICE: "VRAM"}


class RawAgent:
    """One agent with ``threads`` UCX worker threads, ``regions`` registered."""

    def __init__(self, name: str, threads: int, regions: Sequence[Region]) -> None:
        cfg = _nb.nixlAgentConfig()
        cfg.useProgThread, cfg.pthrDelay = True, envs.progress_delay_us()
        cfg.useListenThread, cfg.captureTelemetry = False, False
        cfg.syncMode = _nb.NIXL_THREAD_SYNC_RW
        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.agent = _nb.nixlAgent(name, cfg)
        self.agent.create_backend("UCX", {"num_threads": str(threads)} if threads else {})
        self.mem = MEM[regions[0].kind]
        rows = [(r.addr, r.nbytes, r.device, "") for r in regions]
        self.reg = self.agent.register_memory(self.agent.get_reg_descs(rows, self.mem))
        self.peers: list[str] = []
        self.lists: list[Any] = []

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self.peers.append(peer)
        return peer

    def prep(self, peer: str, rows: np.ndarray) -> Any:
        """A prepared list of ``rows`` (``(addr, len, dev)``) in ``peer``'s memory ("": own)."""
        handle = self.agent.prep_xfer_dlist(peer, rows, self.mem)
        if handle is None:
            raise TransportError(f"NIXL refused to prepare {rows.shape[0]} rows for {peer!r}")
        self.lists.append(handle)
        return handle

    def post(self, op: str, local: Any, l_idx: np.ndarray, remote: Any, r_idx: np.ndarray) -> Any:
        """``op`` (READ or WRITE) of descriptors ``l_idx`` of ``local`` with ``r_idx`` of
        ``remote``, posted; the handle to :meth:`wait` for."""
        xfer = self.agent.make_prepped_xfer(op, local, l_idx, remote, r_idx, b"")
        state = self.agent.transfer(xfer)
        if state == "ERR":
            xfer.release()
            raise TransportError(f"posting a {op} of {l_idx.shape[0]} descriptors failed")
        return xfer

    def wait(self, handles: Sequence[Any], timeout_s: float) -> None:
        """Until every handle is done (released then); TransferTimeout past ``timeout_s``."""
        end = time.monotonic() + timeout_s
        for xfer in handles:
            while (state := self.agent.check_xfer_state(xfer)) != "DONE":
                if state == "ERR":
                    raise TransportError("a vLLM-like transfer failed")
                if time.monotonic() > end:
                    raise TransferTimeout(f"vLLM-like transfer not done after {timeout_s} s")
            xfer.release()

    def close(self) -> None:
        for handle in self.lists:
            self.agent.release_dlist_handle(handle)
        for peer in self.peers:
            self.agent.remove_remote_agent(peer)
        self.agent.deregister_memory(self.reg)
        self.lists, self.peers = [], []
        del self.agent
