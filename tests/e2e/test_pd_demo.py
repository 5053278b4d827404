"""P and D as rank processes over NIXL, a router in between: D's output is the colocated
output, token for token, whatever the two sides' TP, block size and layout.

Per preset one P (TP 2) serves two D instances: TP 1 (a head split) and TP 3 (2→3, the
split does not divide), each with another block size and layout than P.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbridge.api import SideConfig as Side
from kvbridge.cli import demo_cmd
from kvbridge.cli.main import main
from kvbridge.connector.consumer import Mode
from kvbridge.spec import Kind
from refengine import PRESETS, encode, generate, model_spec, preset
from refengine import demo as demo_run
from refengine.pd import Decoded, DecodeServer, PrefillServer, Router
from tests.support.procs import killed

pytestmark = pytest.mark.e2e

SECRET = b"e2e-pd"
NEW_TOKENS = 16
CACHED = 21
PROMPTS = (
    encode("Disaggregated prefill: the decode side continues the story."),
    encode("Short prompt."),
)

# P, D at TP 1 (head split), D at TP 3 (non-divisible), how the TP 3 D moves the KV.
PAIRS = {
    "llama": (
        Side(2, 16, "hnd"),
        Side(1, 32, "block-major"),
        Side(3, 8, "nhd"),
        Mode.PUSH,
    ),
    "gemma": (
        Side(2, 16, "nhd"),
        Side(1, 32, "hnd"),
        Side(3, 24, "block-major"),
        Mode.PULL,
    ),
    "deepseek": (
        Side(2, 16, "block-major"),
        Side(1, 32, "nhd"),
        Side(3, 8, "hnd"),
        Mode.PUSH,
    ),
    "qwen3-next": (
        Side(2, 16, "hnd"),
        Side(1, 32, "block-major"),
        Side(3, 24, "shared-pool"),
        Mode.PULL,
    ),
    "kimi-linear": (
        Side(2, 16, "hnd"),
        Side(1, 32, "shared-pool"),
        Side(3, 8, "block-major"),
        Mode.PUSH,
    ),
    "jamba": (
        Side(2, 32, "shared-pool"),
        Side(1, 16, "nhd"),
        Side(3, 24, "hnd"),
        Mode.PULL,
    ),
}


@dataclass
class Cluster:
    name: str
    p: PrefillServer
    split: DecodeServer
    """D at TP 1: P's two head halves land on one rank."""
    odd: DecodeServer
    """D at TP 3: each D rank's heads straddle P ranks."""

    def run(self, d: DecodeServer, rid: str, prompt: list[int], cached: int = 0) -> Decoded:
        out = Router(self.p, d).generate(rid, prompt, NEW_TOKENS, cached)
        assert not out.recomputed, out.error
        assert self.p.producer is not None and self.p.producer.leases.held() == 0
        return out


@pytest.fixture(scope="module", params=list(PRESETS))
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    name = request.param
    p_side, split_side, odd_side, odd_mode = PAIRS[name]
    servers: list[PrefillServer | DecodeServer] = []
    try:
        servers.append(PrefillServer(name, p_side, SECRET))
        servers.append(DecodeServer(name, split_side, SECRET))
        servers.append(DecodeServer(name, odd_side, SECRET, odd_mode))
        p, split, odd = servers
        assert isinstance(p, PrefillServer) and isinstance(split, DecodeServer)
        assert isinstance(odd, DecodeServer)
        yield Cluster(name, p, split, odd)
    finally:
        for server in reversed(servers):
            server.close()


@functools.cache
def colocated(name: str, prompt: tuple[int, ...]) -> list[int]:
    return generate(name, prompt, tp=1, n_new_tokens=NEW_TOKENS)


def needed_bytes(name: str, n: int, cached: int) -> int:
    """What one D rank at TP 1 lacks: the needed tokens of every token layer, every state."""
    total = 0
    for layer in model_spec(preset(name)).layers:
        a, b = layer.needed_tokens(n, cached)
        total += layer.state_bytes if layer.kind is Kind.STATE else (b - a) * layer.token_bytes
    return total


def test_head_split_with_other_block_size_and_layout(cluster: Cluster) -> None:
    for i, prompt in enumerate(PROMPTS):
        out = cluster.run(cluster.split, f"split{i}", prompt)
        assert out.tokens == colocated(cluster.name, tuple(prompt))
        assert out.bytes == needed_bytes(cluster.name, len(prompt), 0) and out.descriptors > 0


def test_tp_2_to_3_with_other_block_size_and_layout(cluster: Cluster) -> None:
    for i, prompt in enumerate(PROMPTS):
        out = cluster.run(cluster.odd, f"odd{i}", prompt)
        assert out.tokens == colocated(cluster.name, tuple(prompt))
        assert out.bytes >= needed_bytes(cluster.name, len(prompt), 0)  # + replicas


def test_d_prepares_for_p_on_every_rank_and_a_dead_p_costs_no_rank(cluster: Cluster) -> None:
    """``DecodeServer.prepare``: every rank of the TP-3 D connects to P before a request
    (its requests then match colocated output); one for a P that does not answer says so
    per rank, and the D ranks serve on (that part once, with one model: it waits out the
    handshake's timeout, ~10 s, and nothing of it depends on the model)."""
    p = cluster.p
    assert p.producer is not None
    assert cluster.odd.prepare(p.producer.endpoint, p.engine_id) == []
    out = cluster.run(cluster.odd, "prepared", PROMPTS[0])
    assert out.tokens == colocated(cluster.name, tuple(PROMPTS[0]))
    if cluster.name != "llama":
        return
    failed = cluster.odd.prepare("tcp://127.0.0.1:9", "P-gone")
    assert len(failed) == 3 and all("TransportError" in e for e in failed), failed
    again = cluster.run(cluster.odd, "after-dead-p", PROMPTS[1])
    assert again.tokens == colocated(cluster.name, tuple(PROMPTS[1]))


def test_a_prefix_cached_on_d_moves_fewer_bytes_for_the_same_tokens(cluster: Cluster) -> None:
    prompt = PROMPTS[0]
    full = cluster.run(cluster.split, "full", prompt)
    partial = cluster.run(cluster.split, "partial", prompt, cached=CACHED)
    assert partial.tokens == full.tokens == colocated(cluster.name, tuple(prompt))
    assert 0 < partial.bytes < full.bytes
    assert partial.bytes == needed_bytes(cluster.name, len(prompt), CACHED)


@pytest.mark.parametrize("name", ["jamba", "kimi-linear"])
def test_pipeline_stages_on_both_sides(name: str) -> None:
    p_side, d_side = Side(1, 16, "hnd", pp=2), Side(2, 24, "block-major", pp=3)
    with (
        closing(PrefillServer(name, p_side, SECRET)) as p,
        closing(DecodeServer(name, d_side, SECRET)) as d,
    ):
        cluster = Cluster(name, p, d, d)
        full = cluster.run(d, "pp", PROMPTS[0])
        partial = cluster.run(d, "pp-cached", PROMPTS[0], CACHED)
    assert full.tokens == partial.tokens == colocated(name, tuple(PROMPTS[0]))
    assert full.bytes >= needed_bytes(name, len(PROMPTS[0]), 0)  # + replicas at D TP 2
    assert 0 < partial.bytes < full.bytes


def test_a_mixed_up_handle_or_a_dead_p_rank_makes_d_recompute_the_same_output() -> None:
    name, prompt = "kimi-linear", PROMPTS[0]
    p = PrefillServer(name, Side(2, 16, "hnd"), SECRET)
    try:
        d = DecodeServer(name, Side(1, 32, "block-major"), SECRET, transfer_timeout_s=3.0)
        try:
            assert not Router(p, d).generate("warm", prompt, NEW_TOKENS).recomputed
            other = p.prefill("mixed", prompt[::-1]).to_bytes()  # same length, other tokens
            mixed = d.decode("mixed", prompt, other, NEW_TOKENS)
            p.release("mixed")
            assert mixed.recomputed and "PromptMismatch" in mixed.error and mixed.bytes == 0
            assert mixed.tokens == colocated(name, tuple(prompt))
            handle = p.prefill("doomed", prompt).to_bytes()
            killed(p.engine.pids[1])  # dead before D reads from it
            out = d.decode("doomed", prompt, handle, NEW_TOKENS)
        finally:
            d.close()
    finally:
        p.close()
    assert out.recomputed and out.error
    assert out.tokens == colocated(name, tuple(prompt))


def test_demo_quick_json_exits_0_with_all_outputs_matching() -> None:
    env = {**os.environ, "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
    cmd = [sys.executable, "-m", "kvbridge.cli.main", "demo", "--quick", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "D prepared for P P-" in done.stderr  # before the first request, over NIXL
    summary = json.loads(done.stdout)
    assert summary["all_match"] is True and len(summary["requests"]) == demo_cmd.QUICK + 1
    for r in summary["requests"]:
        assert r["output_matches"] and r["bytes"] > 0 and r["descriptors"] > 0
        assert r["prompt_tokens"] > 0 and r["transfer_ms"] > 0
    cached = summary["requests"][-1]
    assert cached["cached_tokens"] == demo_run.REPEAT_CACHED
    assert cached["bytes"] < summary["requests"][-2]["bytes"]


def test_demo_exits_1_when_an_output_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one prompt from a file\n\n")
    monkeypatch.setattr(demo_run, "generate", lambda *a, **k: [0] * NEW_TOKENS)
    argv = ["demo", "--preset", "llama", "--prompts", str(prompts), "--mode", "push"]
    argv += ["--prefill", "tp=1,block=8,layout=nhd", "--decode", "tp=2,block=16,layout=hnd"]
    assert main([*argv, "--new-tokens", str(NEW_TOKENS), "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["all_match"] is False and len(summary["requests"]) == 1
    assert summary["mode"] == "push" and summary["requests"][0]["bytes"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill", "tp=4"],  # 6 KV heads do not split over TP 4
        ["--decode", "pp=9"],  # more stages than the 6 layers
        ["--decode", "layout=diagonal"],
        ["--new-tokens", "0"],
        ["--prompts", "/nonexistent/prompts.txt"],
        ["--cached", "500"],
    ],
)
def test_demo_refuses_bad_input_with_exit_2(argv: list[str]) -> None:
    assert main(["demo", *argv]) == 2
