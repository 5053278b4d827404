"""``kvbridge proxy`` with a backend down, slow or failing: every route answers a JSON
error naming the backend (502 down, 504 timeout), and logs one line, no traceback. A D
failing mid-stream ends the stream with an error event and leaves it incomplete."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvbridge.serve.proxy import Proxy, listening

Stub = Mapping[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]


def closed_port() -> str:
    """The URL of a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@asynccontextmanager
async def proxied(
    p: list[str] | None, d: list[str] | None, p_stub: Stub, d_stub: Stub, timeout_s: float
) -> AsyncIterator[tuple[aiohttp.ClientSession, Proxy]]:
    """A proxy whose P/D are the given URLs, or stubs serving routes, and a client to it.
    The proxy runs as ``run`` serves it: its handler is not cancelled when a client leaves."""
    stubs: list[TestServer] = []
    urls = []
    for given, routes in ((p, p_stub), (d, d_stub)):
        if given is not None:
            urls.append(given)
            continue
        app = web.Application()
        for route, fn in routes.items():
            app.router.add_route("*", route, fn)
        server = TestServer(app)
        await server.start_server()
        stubs.append(server)
        urls.append([str(server.make_url("")).rstrip("/")])
    proxy = Proxy(urls[0], urls[1], timeout_s)
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    client = aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        yield client, proxy
    finally:
        await client.close()
        await runner.cleanup()
        for s in stubs:
            await s.close()


async def answer(
    p: list[str] | None,
    d: list[str] | None,
    p_stub: Stub,
    d_stub: Stub,
    method: str,
    path: str,
    timeout_s: float = 5.0,
) -> tuple[int, Any]:
    """One request through a proxy whose P/D are the given URLs, or stubs serving routes."""
    async with proxied(p, d, p_stub, d_stub, timeout_s) as (client, _):
        body = {"model": "m", "prompt": "hi", "max_tokens": 4}
        r = await client.request(method, path, json=body if method == "POST" else None)
        return r.status, await r.json()


async def p_ok(_: web.Request) -> web.Response:
    return web.json_response({"kv_transfer_params": {"handle": "h"}})


async def p_refuses(_: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "prompt too long"}}, status=400)


async def slow(_: web.Request) -> web.Response:
    await asyncio.sleep(5)
    return web.json_response({})


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]


def check(status: int, body: Any, want: int, backend: str, caplog: pytest.LogCaptureFixture):
    assert status == want, body
    err = body["error"]
    assert err["backend"] == backend and err["code"] == want
    assert backend in err["message"]
    assert "Error(" not in err["message"] and "ConnectionKey" not in err["message"]
    lines = [r for r in caplog.records if r.name == "kvbridge.serve.proxy"]
    assert len(lines) == 1 and backend in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_backends_down(method: str, path: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    p, d = closed_port(), closed_port()
    status, body = asyncio.run(answer([p], [d], {}, {}, method, path))
    check(status, body, 502, d if path == "/v1/models" else p, caplog)
    assert "unreachable" in body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_decode_down_after_prefill(path: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    d = closed_port()
    status, body = asyncio.run(answer(None, [d], {path: p_ok}, {}, "POST", path))
    check(status, body, 502, d, caplog)


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_timeout_is_504(method: str, path: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    stub = {path: slow}
    status, body = asyncio.run(answer(None, None, stub, stub, method, path, timeout_s=0.3))
    assert status == 504, body
    assert "timed out" in body["error"]["message"] and body["error"]["backend"]
    assert not [r for r in caplog.records if r.exc_info]


def test_prefill_refusal_names_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = "/v1/completions"
    status, body = asyncio.run(answer(None, [closed_port()], {path: p_refuses}, {}, "POST", path))
    assert status == 400
    assert "answered 400: prompt too long" in body["error"]["message"]
    assert body["error"]["backend"].startswith("http://127.0.0.1:")


def test_listening_line_names_address_and_backends() -> None:
    line = listening("0.0.0.0", 8000, ["http://p:1"], ["http://d:2", "http://d:3"])
    assert "\n" not in line
    assert "http://0.0.0.0:8000" in line and "http://p:1" in line
    assert "http://d:2, http://d:3" in line


def test_listening_line_brackets_ipv6() -> None:
    assert "http://[::]:8000 " in listening("::", 8000, ["http://p:1"], ["http://d:2"])
    assert "http://[::1]:80 " in listening("::1", 80, ["http://p:1"], ["http://d:2"])


def test_unresolvable_host_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    p = "http://kvbridge-no-such-host.invalid:1"
    status, body = asyncio.run(answer([p], [closed_port()], {}, {}, "POST", "/v1/completions"))
    check(status, body, 502, p, caplog)
    msg = body["error"]["message"]
    assert "unreachable (" in msg and "Unknown error" not in msg, msg


def count(proxy: Proxy, name: str, **labels: str) -> float:
    return proxy.metrics.registry.get_sample_value(name, labels) or 0.0


def test_models_counts_success() -> None:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def go() -> Proxy:
        async with proxied(None, None, {}, {"/v1/models": models}, 5.0) as (client, proxy):
            r = await client.get("/v1/models")
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
            return proxy

    proxy = asyncio.run(go())
    ok = {"route": "/v1/models", "outcome": "ok"}
    assert count(proxy, "kvbridge_proxy_requests_total", **ok) == 1


async def d_streams_then(how: str, request: web.Request) -> web.StreamResponse:
    """D sends one SSE event, then drops the connection ("abort") or stalls ("stall")."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"x": 1}\n\n')
    await asyncio.sleep(0.1)
    if how == "abort":
        assert request.transport is not None
        request.transport.abort()
    else:
        await asyncio.sleep(5)
    return out


async def read_stream(client: aiohttp.ClientSession, path: str) -> tuple[bytes, BaseException]:
    """Everything the client receives of a streamed request, and how the stream ended."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    got = b""
    async with client.post(path, json=body) as r:
        assert r.status == 200
        try:
            async for chunk in r.content.iter_any():
                got += chunk
        except aiohttp.ClientError as e:
            return got, e
    raise AssertionError(f"the stream ended as if complete: {got!r}")


@pytest.mark.parametrize("how", ["abort", "stall"])
def test_decode_dying_mid_stream_is_not_a_complete_answer(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = "/v1/completions"

    async def d(request: web.Request) -> web.StreamResponse:
        return await d_streams_then(how, request)

    async def go() -> tuple[bytes, BaseException, Proxy]:
        async with proxied(None, None, {path: p_ok}, {path: d}, 1.0) as (client, proxy):
            got, ended = await read_stream(client, path)
            return got, ended, proxy

    got, ended, proxy = asyncio.run(go())
    assert isinstance(ended, aiohttp.ClientPayloadError), repr(ended)
    first, error, rest = got.split(b"\n\n")
    assert first == b'data: {"x": 1}' and rest == b"", got
    assert error.startswith(b"data: "), got
    err = json.loads(error[len(b"data: ") :])["error"]
    d_url = proxy.d.backends[0].url
    assert err["backend"] == d_url and d_url in err["message"]
    assert err["code"] == (504 if how == "stall" else 502)
    assert err["type"] == "kvbridge_proxy_error"
    requests = "kvbridge_proxy_requests_total"
    assert count(proxy, requests, route=path, outcome="error") == 1
    assert count(proxy, requests, route=path, outcome="ok") == 0
    errors = [
        s for s in proxy.metrics.backend_errors.collect()[0].samples if s.name.endswith("_total")
    ]
    assert [(s.labels["role"], s.value) for s in errors] == [("decode", 1.0)]
    assert proxy.d.backends[0].failed == 1 and proxy.p.backends[0].failed == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbridge.serve.proxy"]
    assert len(lines) == 1 and "stream cut" in lines[0] and d_url in lines[0], lines
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_client_leaving_mid_stream_is_not_a_backend_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    path = "/v1/completions"

    async def d(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(100):
            await out.write(b'data: {"x": %d}\n\n' % i)
            await asyncio.sleep(0.02)
        await out.write_eof()
        return out

    async def go() -> Proxy:
        async with proxied(None, None, {path: p_ok}, {path: d}, 5.0) as (client, proxy):
            body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
            r = await client.post(path, json=body)
            await r.content.readany()
            r.close()  # the client drops its connection mid-stream
            labels = {"route": path, "outcome": "client_closed"}
            for _ in range(200):
                if count(proxy, "kvbridge_proxy_requests_total", **labels):
                    break
                await asyncio.sleep(0.01)
            return proxy

    proxy = asyncio.run(go())
    labels = {"route": path, "outcome": "client_closed"}
    assert count(proxy, "kvbridge_proxy_requests_total", **labels) == 1
    assert not proxy.metrics.backend_errors.collect()[0].samples
    assert proxy.d.backends[0].failed == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbridge.serve.proxy"]
    assert not [m for m in lines if proxy.d.backends[0].url in m], lines
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_prefill_malformed_json_is_the_backends_fault(caplog: pytest.LogCaptureFixture) -> None:
    async def p_garbled(_: web.Request) -> web.Response:
        return web.Response(text="{not json", content_type="application/json")

    caplog.set_level(logging.INFO)
    path = "/v1/completions"
    status, body = asyncio.run(answer(None, [closed_port()], {path: p_garbled}, {}, "POST", path))
    assert status == 502, body
    assert body["error"]["backend"].startswith("http://127.0.0.1:")
