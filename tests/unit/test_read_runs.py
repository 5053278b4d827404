"""read_runs: the one function that posts a plan's runs by READ and waits for them.

Bytes are checked over the loopback transport against a copy made slice by slice with
numpy; the deadline and failure cases use a loopback whose transfers with a stalled peer
stay pending, so the READs left running are the ones it must report."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.api import Region, XferHandle, read_runs
from kvbridge.errors import TransferTimeout, TransportError
from kvbridge.plan import Runs
from kvbridge.transport.loopback import Fabric, LoopbackTransport
from tests.support.stalling import StallingLoopback

SIZE = 4096


class Counting(StallingLoopback):
    """Records every posted READ (its handle and run count); ``pause`` s per post."""

    def __init__(self, name: str, fabric: Fabric, pause: float = 0.0) -> None:
        super().__init__(name, fabric)
        self.pause = pause
        self.posts: list[tuple[XferHandle, int]] = []

    def read(self, peer, local, remote, nbytes, notif=None):  # type: ignore[no-untyped-def]
        time.sleep(self.pause)
        h = super().read(peer, local, remote, nbytes, notif)
        self.posts.append((h, len(nbytes)))
        return h


def _world(
    rng: np.random.Generator, pause: float = 0.0
) -> tuple[Counting, dict[int, str], list[np.ndarray], np.ndarray]:
    """D's agent, P's agent names per source rank (0, 1), P's buffers, D's buffer."""
    fabric = Fabric()
    d = Counting("d", fabric, pause)
    dst = np.zeros(2 * SIZE, np.uint8)
    d.register([Region(int(dst.ctypes.data), dst.nbytes)])
    srcs, agents = [], {}
    for r in range(2):
        buf = rng.integers(1, 256, SIZE, dtype=np.uint8)
        p = LoopbackTransport(f"p{r}", fabric)
        agents[r] = d.add_peer(p.register([Region(int(buf.ctypes.data), buf.nbytes)]))
        srcs.append(buf)
    return d, agents, srcs, dst


def _runs(rng: np.random.Generator, src: np.ndarray, dst: np.ndarray, half: int) -> Runs:
    """17 disjoint runs of 1..64 bytes from ``src`` into half ``half`` of ``dst``."""
    length = rng.integers(1, 65, 17)
    d_off = rng.permutation(SIZE // 64)[:17] * 64 + half * SIZE
    s_off = rng.permutation(SIZE // 64)[:17] * 64
    base_s, base_d = int(src.ctypes.data), int(dst.ctypes.data)
    return Runs(s_off + base_s, d_off + base_d, length.astype(np.int64))


def _expect(dst: np.ndarray, srcs: list[np.ndarray], runs: dict[int, Runs]) -> np.ndarray:
    want = dst.copy()
    for r, rr in runs.items():
        base_s, base_d = int(srcs[r].ctypes.data), int(dst.ctypes.data)
        for s, d, n in zip(rr.src.tolist(), rr.dst.tolist(), rr.length.tolist(), strict=True):
            want[d - base_d : d - base_d + n] = srcs[r][s - base_s : s - base_s + n]
    return want


def test_every_run_lands_in_requests_of_post_runs() -> None:
    rng = np.random.default_rng(3)
    d, agents, srcs, dst = _world(rng)
    runs = {r: _runs(rng, srcs[r], dst, r) for r in (1, 0)}
    want = _expect(dst, srcs, runs)
    live: list[XferHandle] = []
    called: list[int] = []
    posted = read_runs(d, agents, runs, time.monotonic() + 5, live, 5, lambda: called.append(1))
    assert posted == 34 and live == [] and called == [1]
    assert [k for _, k in d.posts] == [5, 5, 5, 2] * 2
    assert np.array_equal(dst, want)
    assert (dst != 0).sum() == sum(r.nbytes for r in runs.values())


def test_a_deadline_passing_while_posting_reports_the_reads_still_live() -> None:
    """Each post takes 20 ms and the deadline is 50 ms away: posting stops after a few
    requests; those READs (P rank 0 stalled) are reported live and land late."""
    rng = np.random.default_rng(4)
    d, agents, srcs, dst = _world(rng, pause=0.02)
    d.stall(agents[0])
    runs = {0: _runs(rng, srcs[0], dst, 0)}
    live: list[XferHandle] = []
    with pytest.raises(TransferTimeout, match="deadline passed while posting"):
        read_runs(d, agents, runs, time.monotonic() + 0.05, live, 1)
    assert 1 <= len(d.posts) < 17
    assert live == [h for h, _ in d.posts]
    assert not any(d.ended(h) for h in live)
    assert (dst == 0).all()  # nothing landed yet
    k = len(d.posts)
    want = _expect(dst, srcs, {0: Runs(runs[0].src[:k], runs[0].dst[:k], runs[0].length[:k])})
    d.resume(agents[0])
    assert np.array_equal(dst, want)
    assert all(d.ended(h) for h in live)


def test_reads_not_done_at_the_deadline_or_when_then_fails_are_reported() -> None:
    rng = np.random.default_rng(5)
    d, agents, srcs, dst = _world(rng)
    d.stall(agents[1])
    runs = {0: _runs(rng, srcs[0], dst, 0), 1: _runs(rng, srcs[1], dst, 1)}
    live: list[XferHandle] = []
    with pytest.raises(TransferTimeout, match="not done after"):
        read_runs(d, agents, runs, time.monotonic() + 0.05, live, 8)
    stalled = [h for h, _ in d.posts[3:]]  # P rank 0's three requests landed at once
    assert len(d.posts) == 6 and live == stalled

    def fail() -> None:
        raise TransportError("staged pull failed")

    live2: list[XferHandle] = []
    with pytest.raises(TransportError, match="staged pull failed"):
        read_runs(d, agents, runs, time.monotonic() + 5, live2, 8, fail)
    assert live2 == [h for h, _ in d.posts[9:]]
