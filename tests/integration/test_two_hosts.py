"""P and D on two simulated hosts: network namespaces joined by a veth link, so the side
channel and NIXL go over TCP between two addresses, as between machines."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import closing

import pytest

from kvbridge.api import SideConfig
from kvbridge.cli.main import main
from kvbridge.connector.consumer import Mode
from kvbridge.control.lease import LeaseState
from refengine import encode, generate
from refengine.netns import Hosts, unavailable
from refengine.pd import DecodeServer, PrefillServer, Router
from tests.integration.test_pd_processes import SECRET, Pair, hybrid
from tests.support.rank_worker import Changed, Scribble, Verify

WHY = unavailable()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(WHY), reason=WHY)]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with Hosts() as h:
        yield h


def pair(hosts: Hosts, mode: str = "pull", timeout_s: float = 10.0) -> Pair:
    return Pair(
        hybrid(), 2, 1, "hnd", "nhd", 16, 32, timeout_s=timeout_s, mode=mode,
        p_host=(hosts.p, hosts.p_addr), d_host=(hosts.d, hosts.d_addr),
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_byte_exact_between_two_hosts(hosts, mode):
    pr = pair(hosts, mode)
    try:
        assert pr.producer.endpoint.startswith(f"tcp://{hosts.p_addr}:")
        for rid, n, cached in [("a", 77, 0), ("b", 50, 20)]:
            handle, d_tabs = pr.prefill(rid, n)
            pr.load(handle, d_tabs, cached)
            (outs,) = pr.wait([rid])
            assert outs[rid].ok, outs[rid].error
            assert pr.d.call(Verify(rid, n, cached, d_tabs)) == [0]
        assert {f.reason for f in pr.producer.freed(wait_for=2)} == {LeaseState.DONE}
    finally:
        pr.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_partition_longer_than_the_deadline_fails_cleanly(hosts, mode):
    """Link cut for 6 s, deadline 2 s: D reports the failure within the deadline plus a
    margin; after the link is back, nothing lands in D's (reused) blocks, and the next
    request goes through."""
    pr = pair(hosts, mode, timeout_s=2.0)
    try:
        handle, d_tabs = pr.prefill("warm", 40)
        pr.load(handle, d_tabs)
        assert pr.wait(["warm"])[0]["warm"].ok
        handle, d_tabs = pr.prefill("cut", 64)
        hosts.cut()
        try:
            t0 = time.monotonic()
            pr.load(handle, d_tabs, snap=False)
            (outs,) = pr.wait(["cut"], timeout=10.0)
            took = time.monotonic() - t0
            assert "cut" in outs and not outs["cut"].ok, outs
            assert took < 2.0 + 1.5, took
            pr.d.call(Scribble())  # the engine reuses the blocks
            time.sleep(max(0.0, 6.0 - took))
        finally:
            hosts.heal()
        time.sleep(2.0)
        assert pr.d.call(Changed()) == [0]
        handle, d_tabs = pr.prefill("after", 40)
        pr.load(handle, d_tabs)
        (outs,) = pr.wait(["after"], timeout=30)
        assert outs["after"].ok, outs["after"].error
        assert pr.d.call(Verify("after", 40, 0, d_tabs)) == [0]
    finally:
        pr.close()


@pytest.mark.parametrize("mode", [Mode.PULL, Mode.PUSH])
def test_reference_engine_tokens_exact_between_hosts(hosts, mode):
    """The reference engine's P (TP 2) on one host, D (TP 1, other block size and
    layout) on the other: D's tokens are the colocated run's."""
    prompt = encode("Disaggregated prefill: the decode side continues the story.")
    want = generate("kimi-linear", prompt, tp=1, n_new_tokens=12)
    p_side = SideConfig(2, 16, "hnd", netns=hosts.p)
    d_side = SideConfig(1, 32, "block-major", netns=hosts.d)
    with (
        closing(PrefillServer("kimi-linear", p_side, SECRET, host=hosts.p_addr)) as p,
        closing(DecodeServer("kimi-linear", d_side, SECRET, mode)) as d,
    ):
        assert p.producer is not None and p.producer.endpoint.startswith(f"tcp://{hosts.p_addr}:")
        out = Router(p, d).generate("r1", prompt, 12)
        assert not out.recomputed, out.error
        assert out.tokens == want and out.bytes > 0


def test_demo_runs_p_and_d_on_two_hosts(capsys):
    assert main(["demo", "--quick", "--two-hosts", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] and out["all_match"]


def test_a_read_slower_than_the_deadline_is_fenced_not_landed_late(hosts, monkeypatch):
    """UCX on TCP between the hosts, P's link limited to 200 kbit/s: a request's READ
    outlives D's 1 s deadline. D reports the failure only once the READ ended, and after
    that report nothing lands in its (reused) blocks."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    pr = pair(hosts, timeout_s=1.0)
    try:
        handle, d_tabs = pr.prefill("warm", 20)
        pr.load(handle, d_tabs)
        assert pr.wait(["warm"])[0]["warm"].ok
        handle, d_tabs = pr.prefill("slow", 64)
        hosts.slow("200kbit")
        try:
            pr.load(handle, d_tabs, snap=False)
            (outs,) = pr.wait(["slow"], timeout=60.0)
            out = outs["slow"]
            assert not out.ok and "TransferTimeout" in out.error, out
            pr.d.call(Scribble())  # the engine reuses the blocks
            time.sleep(1.0)
        finally:
            hosts.fast()
        # the next request keeps D's agent busy: a READ left running would land now
        handle, d_tabs = pr.prefill("next", 40)
        pr.load(handle, d_tabs, snap=False)
        assert pr.wait(["next"])[0]["next"].ok
        time.sleep(1.0)
        assert pr.d.call(Verify("next", 40, 0, d_tabs, True)) == [0]
        assert out.stages.get("fence", 0) > 0.2, out.stages  # held past the deadline
    finally:
        pr.close()
