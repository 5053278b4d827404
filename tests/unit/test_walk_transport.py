"""Change-walk "a new transport" (docs/structure.md), performed here: a transport written
in this file (memmove between agents of this process, sharing no code with the loopback
one), registered by name, and made by name only (``make_transport``) for the real
Producer and Consumer, which move requests through it, pulled and pushed, byte-exact
against the element-wise reference."""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.api import (
    Consumer,
    Kind,
    Mode,
    Outcome,
    Parallel,
    PeerError,
    Producer,
    ProducerWorker,
    Region,
    Transport,
    TransportError,
    XferHandle,
    XferState,
    attention,
    group_by_kind,
    make_transport,
    mla,
    register_transport,
    transport_names,
)
from tests.support.reference import expected_dest, fill_source
from tests.support.scenario import Side, random_tables

NAME = "walk-memmove"
SECRET = b"walk-secret"
_AGENTS: dict[str, WalkTransport] = {}
"""This process's agents of the walk transport, by name."""


class _Done(XferHandle):
    def release(self) -> None:
        pass


class WalkTransport(Transport):
    """Agents of one process: JSON metadata naming the agent and its regions; every run
    checked inside the registered regions of both sides, then copied with memmove, at
    once; a notification lands in the peer's inbox after the bytes."""

    def __init__(self, name: str) -> None:
        if name in _AGENTS:
            raise TransportError(f"agent {name!r} exists")
        self.name = name
        self.regions: list[tuple[int, int]] = []
        self.peers: set[str] = set()
        self.inbox: list[tuple[str, bytes]] = []
        self.moved = 0
        """Bytes this agent copied (reads and writes it posted)."""
        _AGENTS[name] = self

    def register(self, regions: list[Region]) -> bytes:
        self.check_kinds(regions)
        self.regions += [(r.addr, r.nbytes) for r in regions]
        return json.dumps({"agent": self.name, "regions": self.regions}).encode()

    def add_peer(self, metadata: bytes) -> str:
        name = json.loads(metadata)["agent"]
        if name not in _AGENTS:
            raise PeerError(f"no walk agent {name!r}")
        self.peers.add(name)
        return str(name)

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)

    def read(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        notif: bytes | None = None,
    ) -> XferHandle:
        return self._copy(peer, _AGENTS.get(peer), self, remote, local, nbytes, notif)

    def write(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        notif: bytes | None = None,
    ) -> XferHandle:
        return self._copy(peer, self, _AGENTS.get(peer), local, remote, nbytes, notif)

    def _copy(self, peer: str, src_agent: Any, dst_agent: Any, src: Any, dst: Any, n: Any,
              notif: bytes | None) -> XferHandle:  # fmt: skip
        if peer not in self.peers or src_agent is None or dst_agent is None:
            raise TransportError(f"{self.name}: unknown peer {peer!r}")
        runs = list(zip(np.asarray(src).tolist(), np.asarray(dst).tolist(),
                        np.asarray(n).tolist(), strict=True))  # fmt: skip
        for s, d, k in runs:
            src_agent.check(s, k)
            dst_agent.check(d, k)
        for s, d, k in runs:
            ctypes.memmove(d, s, k)
        self.moved += sum(k for _, _, k in runs)
        if notif is not None:
            _AGENTS[peer].inbox.append((self.name, notif))
        return _Done()

    def check(self, addr: int, n: int) -> None:
        if not any(a <= addr and addr + n <= a + size for a, size in self.regions):
            raise TransportError(f"{self.name}: [{addr:#x}, +{n}) is outside registered memory")

    def poll(self, handle: XferHandle) -> XferState:
        return XferState.DONE

    def notifications(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        _AGENTS.pop(self.name, None)


def _factory(agent_name: str, **options: Any) -> Transport:
    if options:
        raise TypeError(f"{NAME} takes no options, got {sorted(options)}")
    return WalkTransport(agent_name)


if NAME not in transport_names():
    register_transport(NAME, _factory)

LAYERS = [attention(0, 4, 16), attention(1, 4, 16, kind=Kind.SLIDING, window=9), mla(2, 24)]
SPEC = group_by_kind("walk", LAYERS, 16)


class Pair:
    """P (TP 2, hnd) and D (TP 1, block-major, block 8) over transports made by name."""

    def __init__(self, mode: Mode, tag: str) -> None:
        self.rng = np.random.default_rng(11)
        self.p = Side(SPEC, Parallel(2), "hnd", 32)
        self.d = Side(SPEC.with_block_sizes(8), Parallel(1), "block-major", 64)
        self.p.allocate(self.rng)
        self.d.allocate(self.rng)
        self.producer = Producer("P", SPEC, self.p.par, SECRET)
        self.workers = []
        for r in range(2):
            agent = make_transport(NAME, f"{tag}-p{r}")
            bases = list(self.p.bound(r).bases)
            push = (SECRET, "127.0.0.1", 5.0) if mode is Mode.PUSH else (None,)
            w = ProducerWorker(r, self.p.layouts[r], bases, agent, *push, share=False)  # type: ignore[arg-type,misc]
            self.workers.append(w)
            self.producer.add_rank(w.info)
        self.d_agent = make_transport(NAME, f"{tag}-d0")
        self.consumer = Consumer(
            "D", self.d.spec, self.d.par, 0, self.d.layouts[0], list(self.d.bound(0).bases),
            self.d_agent, SECRET, transfer_timeout_s=5.0, mode=mode, kernel=False,
        )  # fmt: skip

    def load(self, rid: str, n: int, cached: int = 0) -> Outcome:
        """One request moved, D's bytes compared with the reference."""
        before = [b.copy() for b in self.d.bufs[0]]
        p_tabs = random_tables(SPEC, n, 32, self.rng)
        for r in range(2):
            fill_source(SPEC, self.p.par, r, self.p.layouts[r], self.p.bufs[r], n, p_tabs)
        d_tabs = random_tables(self.d.spec, n, 64, self.rng)
        self.consumer.load(self.producer.prefill_done(rid, p_tabs, n), d_tabs, cached)
        end, out = time.monotonic() + 10, []
        while not out and time.monotonic() < end:
            out = self.consumer.poll()
            time.sleep(0.005)
        assert len(out) == 1, out
        assert out[0].ok, out[0].error
        want = expected_dest(
            self.d.spec, self.d.par, 0, self.d.layouts[0], before, n, cached, d_tabs
        )
        for got, exp in zip(self.d.bufs[0], want, strict=True):
            assert np.array_equal(got, exp)
        return out[0]

    def close(self) -> None:
        self.consumer.close()
        for w in self.workers:
            w.close()
        self.producer.close()


@pytest.fixture(params=[Mode.PULL, Mode.PUSH], ids=["pull", "push"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param, f"walk-{request.param.value}")
    yield p
    p.close()


def test_the_connector_moves_requests_through_a_transport_made_by_name(pair: Pair) -> None:
    agents = [pair.d_agent, *(w.transport for w in pair.workers)]
    assert all(type(a) is WalkTransport for a in agents)  # the registered one, by name
    mode = pair.consumer.mode
    out = pair.load("r1", 45)
    out2 = pair.load("r2", 60, cached=24)
    assert (out.mover, out2.mover) == (mode.value, mode.value)
    assert out2.bytes < out.bytes
    # the bytes went through the walk agents: D's READs (pull) or P's WRITEs (push)
    movers = [pair.d_agent] if mode is Mode.PULL else [w.transport for w in pair.workers]
    assert sum(a.moved for a in movers) >= out.bytes + out2.bytes  # type: ignore[attr-defined]


def test_a_registered_transport_is_listed_and_takes_its_own_options() -> None:
    assert NAME in transport_names()
    with pytest.raises(TypeError, match="no options"):
        make_transport(NAME, "walk-x", fabric=None)


def test_a_transport_without_read_or_write_is_refused_when_made() -> None:
    class NoWrite(WalkTransport):
        write = Transport.write  # the abstract one: no way to post a WRITE

    with pytest.raises(TypeError, match="write"):
        NoWrite("no-write")
