"""P and D instances as real processes over NIXL on loopback (pull)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvbridge.api import SideConfig
from kvbridge.control.lease import LeaseState
from kvbridge.spec import DType, Kind, ModelSpec, attention, group_by_kind, mamba2, mla
from tests.support.procs import Instance, killed
from tests.support.rank_worker import Changed, Fill, Load, Scribble, Verify, Wait
from tests.support.scenario import random_tables

pytestmark = pytest.mark.integration
SECRET = b"integration"


def hybrid() -> ModelSpec:
    layers = [attention(0, 12, 16), attention(1, 12, 16, kind=Kind.SLIDING, window=17)]
    layers += [attention(2, 12, 16)]
    return group_by_kind("full+sliding", layers, 16)


def mla_model() -> ModelSpec:
    return group_by_kind("mla", [mla(i, 36, DType.FP16) for i in range(3)], 16)


def mamba_model() -> ModelSpec:
    layers = [mamba2(0, 12, 4, 1, 8, 4), attention(1, 12, 16), mamba2(2, 12, 4, 1, 8, 4)]
    return group_by_kind("mamba2", layers, 16)


class Pair:
    def __init__(
        self,
        spec,
        p_tp,
        d_tp,
        p_layout,
        d_layout,
        p_bs=16,
        d_bs=16,
        lease_s=30.0,
        timeout_s=10.0,
        mode="pull",
        p_host=("", "127.0.0.1"),
        d_host=("", "127.0.0.1"),
    ):
        """``p_host``/``d_host``: (network namespace, address) of each side."""
        p_side = SideConfig(p_tp, p_bs, p_layout, 64, netns=p_host[0])
        d_side = SideConfig(d_tp, d_bs, d_layout, 64, netns=d_host[0])
        self.p = Instance("P", p_side.spec(spec), p_side, SECRET, lease_s, host=p_host[1])
        try:
            self.d = Instance(
                "D",
                d_side.spec(spec),
                d_side,
                SECRET,
                timeout_s=timeout_s,
                mode=mode,
                host=d_host[1],
            )
        except Exception:
            self.p.close()
            raise
        self.rng = np.random.default_rng(3)
        assert self.p.producer is not None
        self.producer = self.p.producer

    def prefill(self, rid: str, n: int):
        p_tabs = random_tables(self.p.spec, n, 64, self.rng)
        self.p.call(Fill(n, p_tabs))
        d_tabs = random_tables(self.d.spec, n, 64, self.rng)
        return self.producer.prefill_done(rid, p_tabs, n), d_tabs

    def load(self, handle, d_tabs, cached=0, snap=True):
        self.d.call(Load(handle.to_bytes(), d_tabs, cached, snap))

    def wait(self, ids, timeout=30.0):
        per_rank = self.d.call(Wait(ids, timeout), timeout=timeout + 30)
        return per_rank

    def close(self):
        self.d.close()
        self.p.close()


CASES = [
    ("hybrid", hybrid, 2, 4, "hnd", "nhd", 16, 32, "pull"),
    ("hybrid", hybrid, 3, 2, "nhd", "block-major", 16, 8, "pull"),
    ("mla", mla_model, 2, 4, "nhd", "hnd", 16, 32, "pull"),
    ("mamba2", mamba_model, 3, 2, "hnd", "nhd", 32, 16, "pull"),
    ("hybrid", hybrid, 2, 4, "hnd", "nhd", 16, 32, "push"),
    ("mla", mla_model, 3, 2, "nhd", "block-major", 16, 8, "push"),
    ("mamba2", mamba_model, 2, 4, "hnd", "nhd", 32, 16, "push"),
]


@pytest.mark.parametrize(
    ("name", "make", "p_tp", "d_tp", "p_lay", "d_lay", "p_bs", "d_bs", "mode"),
    CASES,
    ids=[f"{c[0]}-{c[2]}to{c[3]}-{c[8]}" for c in CASES],
)
def test_byte_exact(name, make, p_tp, d_tp, p_lay, d_lay, p_bs, d_bs, mode):
    pair = Pair(make(), p_tp, d_tp, p_lay, d_lay, p_bs, d_bs, mode=mode)
    try:
        for rid, n, cached in [("a", 77, 0), ("b", 50, 20)]:
            handle, d_tabs = pair.prefill(rid, n)
            pair.load(handle, d_tabs, cached)
            outs = pair.wait([rid])
            assert all(o[rid].ok for o in outs), [o[rid].error for o in outs]
            diffs = pair.d.call(Verify(rid, n, cached, d_tabs))
            assert diffs == [0] * d_tp
        freed = pair.producer.freed(wait_for=2)
        assert sorted((f.request_id, f.reason) for f in freed) == [
            ("a", LeaseState.DONE),
            ("b", LeaseState.DONE),
        ]
    finally:
        pair.close()


def test_faults_lease_lapse_abort_dead_d():
    pair = Pair(hybrid(), 2, 1, "hnd", "nhd", lease_s=1.0)
    try:
        # a lease that lapses while D is queued: P frees, the blocks are reused, D fails
        handle, d_tabs = pair.prefill("late", 40)
        time.sleep(1.3)
        assert [f.reason for f in pair.producer.freed()] == [LeaseState.EXPIRED]
        pair.p.call(Scribble())
        pair.load(handle, d_tabs)
        (out,) = pair.wait(["late"])
        assert not out["late"].ok and "LeaseExpired" in out["late"].error
        # an aborted request: blocks freed once, D's later load fails
        handle, d_tabs = pair.prefill("gone", 30)
        assert pair.producer.abort("gone") and not pair.producer.abort("gone")
        pair.load(handle, d_tabs)
        (out,) = pair.wait(["gone"])
        assert not out["gone"].ok
        assert [f.reason for f in pair.producer.freed()] == [LeaseState.ABORTED]
        # a D that never comes: P frees at lease expiry
        pair.prefill("orphan", 30)
        time.sleep(1.3)
        assert [f.reason for f in pair.producer.freed()] == [LeaseState.EXPIRED]
        assert pair.producer.leases.held() == 0
    finally:
        pair.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_p_rank_killed_during_transfers_fails_within_deadline(mode):
    """Push: the dead rank never answers the fence; a 1-byte READ from it fails, which
    shows nothing of it can land, so the failure is not held for ever."""
    pair = Pair(hybrid(), 2, 1, "nhd", "hnd", timeout_s=3.0, mode=mode)
    try:
        handle, d_tabs = pair.prefill("ok", 40)
        pair.load(handle, d_tabs)
        assert pair.wait(["ok"])[0]["ok"].ok
        handles = [pair.prefill(f"k{i}", 60) for i in range(4)]
        killed(pair.p.procs.pids[1])  # dead before D reads: its memory no longer readable
        t0 = time.monotonic()
        for h, tabs in handles:
            pair.load(h, tabs, snap=False)
        outs = pair.wait([f"k{i}" for i in range(4)], timeout=20)[0]
        assert len(outs) == 4 and not any(o.ok for o in outs.values())
        assert time.monotonic() - t0 < 15
    finally:
        pair.close()


def test_200_concurrent_requests():
    pair = Pair(hybrid(), 2, 2, "hnd", "hnd")
    try:
        rng = np.random.default_rng(11)
        ids = []
        for i in range(200):
            n = int(rng.integers(1, 60))
            p_tabs = random_tables(pair.p.spec, n, 64, rng)
            d_tabs = random_tables(pair.d.spec, n, 64, rng)
            h = pair.producer.prefill_done(f"c{i}", p_tabs, n)
            pair.load(h, d_tabs, snap=False)
            ids.append(f"c{i}")
        outs = pair.wait(ids, timeout=60)
        assert all(len(o) == 200 and all(x.ok for x in o.values()) for o in outs)
        freed = pair.producer.freed(wait_for=200)
        assert len(freed) == 200 and {f.reason for f in freed} == {LeaseState.DONE}
        assert pair.producer.leases.held() == 0
    finally:
        pair.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_no_byte_lands_after_a_failure_is_reported(mode, monkeypatch):
    """A P rank stopped (SIGSTOP) mid-request over TCP, the way a second host is reached:
    the transfer outlives D's 2 s deadline and cannot be cancelled. D holds the failure
    back until the transfer ended (pull: the READ; push: the P rank says its write
    ended), then reports it; D's blocks, reused from then on, see no late byte."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # shared memory would not stall on a stopped P
    pair = Pair(hybrid(), 2, 1, "hnd", "nhd", timeout_s=2.0, mode=mode)
    try:
        handle, d_tabs = pair.prefill("warm", 40)
        pair.load(handle, d_tabs)
        assert pair.wait(["warm"])[0]["warm"].ok
        handle, d_tabs = pair.prefill("late", 64)
        stopped = pair.p.procs.pids[0]
        os.kill(stopped, signal.SIGSTOP)
        try:
            pair.load(handle, d_tabs, snap=False)
            assert pair.wait(["late"], timeout=5.0) == [{}]  # deadline passed, still held
        finally:
            os.kill(stopped, signal.SIGCONT)
        t0 = time.monotonic()
        (outs,) = pair.wait(["late"], timeout=15.0)
        assert "late" in outs and not outs["late"].ok, outs
        assert outs["late"].stages.get("fence", 0) > 2.0, outs["late"].stages
        assert time.monotonic() - t0 < 5.0
        pair.d.call(Scribble())  # the engine reuses the blocks
        time.sleep(1.0)
        assert pair.d.call(Changed()) == [0]
    finally:
        pair.close()
