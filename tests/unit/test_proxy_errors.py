"""``kvbridge proxy`` with a backend down, slow or failing: every route answers a JSON
error naming the backend (502 down, 504 timeout), and logs one line, no traceback."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvbridge.serve.proxy import Proxy, listening

Stub = dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]


def closed_port() -> str:
    """The URL of a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


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
    client = TestClient(TestServer(Proxy(urls[0], urls[1], timeout_s).app()))
    await client.start_server()
    try:
        body = {"model": "m", "prompt": "hi", "max_tokens": 4}
        kw = {"json": body} if method == "POST" else {}
        r = await client.request(method, path, **kw)
        return r.status, await r.json()
    finally:
        await client.close()
        for s in stubs:
            await s.close()


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
