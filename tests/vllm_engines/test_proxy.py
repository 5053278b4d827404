"""``kvbridge proxy`` with the official ``openai`` client against real vLLM servers: P
(block 32) and D (block 128) OpenAI servers with the kvbridge connector, the proxy in
front; answers equal the colocated answer of the same server, streaming too."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web

from kvbridge.serve.proxy import Proxy
from refengine.ranks import free_port
from tests.support.vllm_server import Server, ServerConfig
from tests.vllm_engines.conftest import SECRET, model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def servers(
    models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("servers")
    m = model(models, "llama")
    secret = str(SECRET["secret"])
    cfgs = [
        ServerConfig(m, free_port(), "proxy-p", secret, 32, cpus="0"),
        ServerConfig(m, free_port(), "proxy-d", secret, 128, cpus="1"),
    ]
    with ThreadPoolExecutor(2) as pool:  # both start at once; a failed start closes both
        futs = [pool.submit(Server, c, logs / f"{c.engine_id}.log") for c in cfgs]
    up = [f.result() for f in futs if f.exception() is None]
    try:
        if len(up) < 2:
            raise next(e for f in futs if (e := f.exception()) is not None)
        yield up[0], up[1]
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(Server.close, up))


@pytest.fixture(scope="module")
def proxy(servers: tuple[Server, Server]) -> Iterator[str]:
    p, d = servers
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(Proxy([p.url], [d.url]).app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


PROMPTS = [
    "the kv cache moves from prefill to decode " * 20,
    "short prompt about blocks",
    "ab cd ef gh ij kl mn op qr st uv wx yz " * 15,
]


def test_completions_equal_colocated(servers: tuple[Server, Server], proxy: str) -> None:
    p, _ = servers
    direct = openai.OpenAI(base_url=p.url + "/v1", api_key="x")
    via = openai.OpenAI(base_url=proxy + "/v1", api_key="x")
    for prompt in PROMPTS:
        kw = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        want = direct.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
        got = via.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
        assert got == want and len(want) > 0


def test_chat_streaming_equal_colocated(servers: tuple[Server, Server], proxy: str) -> None:
    p, _ = servers
    msgs = [{"role": "user", "content": "tell me about paged kv caches " * 10}]
    kw = {"model": "tiny", "messages": msgs, "max_tokens": 16, "temperature": 0}
    want = openai.OpenAI(base_url=p.url + "/v1", api_key="x").chat.completions.create(**kw)
    via = openai.OpenAI(base_url=proxy + "/v1", api_key="x")
    chunks = via.chat.completions.create(stream=True, **kw)
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == want.choices[0].message.content


def test_d_server_metrics_show_the_loads(servers: tuple[Server, Server], proxy: str) -> None:
    """D really loaded from P (a recompute would also give equal text): its /metrics; P
    counts the leases that ended with every D rank's confirmation."""
    p, d = servers
    via = openai.OpenAI(base_url=proxy + "/v1", api_key="x")
    via.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    ok = [ln for ln in text.splitlines() if ln.startswith("vllm:kvbridge_loads_total{")]
    assert any('outcome="ok"' in ln and float(ln.split()[-1]) >= 1 for ln in ok), ok
    assert not any('outcome="failed"' in ln and float(ln.split()[-1]) > 0 for ln in ok), ok
    kvb = [ln for ln in text.splitlines() if "kvbridge" in ln and not ln.startswith("#")]
    names = sorted({ln.split("{")[0] for ln in kvb})
    assert "vllm:kvbridge_load_stage_seconds_bucket" in names, names
    assert any('stage="transfer"' in ln for ln in kvb), kvb
    movers = [ln for ln in kvb if ln.startswith("vllm:kvbridge_loads_by_mover_total{")]
    assert any('mover="pull"' in ln and float(ln.split()[-1]) >= 1 for ln in movers), movers
    with urllib.request.urlopen(p.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    done = [ln for ln in text.splitlines() if ln.startswith("vllm:kvbridge_leases_total{")]
    assert any('end="done"' in ln and float(ln.split()[-1]) >= 1 for ln in done), done


def test_health_and_metrics(proxy: str) -> None:
    with urllib.request.urlopen(proxy + "/health", timeout=10) as r:
        assert r.status == 200
    with urllib.request.urlopen(proxy + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'kvbridge_proxy_requests_total{outcome="ok",route="/v1/completions"}' in text
    assert "kvbridge_proxy_time_to_first_token_seconds_bucket" in text


def test_bad_request_gets_a_typed_error(proxy: str) -> None:
    req = urllib.request.Request(proxy + "/v1/completions", data=b"[1, 2", method="POST")
    req.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
