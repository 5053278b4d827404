"""``kvbridge proxy``: an OpenAI-compatible front for P/D serving.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a P server
with ``max_tokens = 1`` and ``kv_transfer_params = {"do_remote_decode": true}``; P's reply
carries the transfer handle in its ``kv_transfer_params``, which is added to the
original request and sent to a D server, whose reply (streamed or not) is the answer.

    client ──► proxy ──(1: prefill)──► P          P holds the blocks under a lease
                   └──(2: + handle)──► D ──► stream back to the client
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbridge.errors import ConfigError

log = logging.getLogger(__name__)
ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_BODY = 8 << 20
T = TypeVar("T")


@dataclass
class Backend:
    url: str
    """Base URL, e.g. ``http://127.0.0.1:8100`` (no trailing slash)."""
    in_flight: int = 0
    failed: int = 0


@dataclass
class Pool:
    """Backends of one role. :meth:`pick`: fewest requests in flight, ties in turn."""

    backends: list[Backend]
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @staticmethod
    def of(role: str, urls: list[str]) -> Pool:
        if not urls:
            raise ConfigError(f"--{role}: at least one server URL is needed")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"--{role} {url!r}: expected http(s)://host:port")
        return Pool([Backend(url.rstrip("/")) for url in urls])

    def pick(self) -> Backend:
        turn = next(self._turn) % len(self.backends)
        order = self.backends[turn:] + self.backends[:turn]
        return min(order, key=lambda b: b.in_flight)


_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ProxyMetrics:
    """The proxy's Prometheus metrics (seconds for durations, ``_total`` for counters)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvbridge_proxy_requests_total",
            "Requests by route and outcome.",
            ["route", "outcome"],
            registry=r,
        )
        self.stage = Histogram(
            "kvbridge_proxy_stage_seconds",
            "Time of each stage of a P/D request.",
            ["stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvbridge_proxy_time_to_first_token_seconds",
            "From the request's arrival to D's first streamed chunk (or full reply).",
            buckets=_BUCKETS,
            registry=r,
        )
        self.backend_errors = Counter(
            "kvbridge_proxy_backend_errors_total",
            "Failed calls to a backend, by role and cause.",
            ["role", "cause"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvbridge_proxy_in_flight",
            "Requests in flight per backend.",
            ["role", "url"],
            registry=r,
        )


class BackendError(Exception):
    """A P or D server failed; ``status`` is what the client gets, ``backend`` its URL."""

    def __init__(self, status: int, message: str, backend: str | None = None):
        super().__init__(message)
        self.status = status
        self.backend = backend


def describe(e: BaseException) -> str:
    """A failed call to a backend in a few words (no Python object dump)."""
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ClientConnectorError):
        err = e.os_error  # a DNS failure's errno is negative (a getaddrinfo code)
        why = os.strerror(err.errno) if err.errno and err.errno > 0 else None
        return f"unreachable ({why or err.strerror or err})"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "closed the connection"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "cut its reply short"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class _Cut(Exception):
    """D failed after the stream's headers went out to the client."""

    def __init__(self, out: web.StreamResponse, e: BackendError):
        super().__init__(str(e))
        self.out, self.error = out, e


def _error_body(e: BackendError) -> dict[str, Any]:
    """The OpenAI-style error the client gets, naming the backend that failed."""
    err = {"message": str(e), "type": "kvbridge_proxy_error", "code": e.status}
    return {"error": {**err, "backend": e.backend}}


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 300.0):
        self.p = Pool.of("prefill", prefill)
        self.d = Pool.of("decode", decode)
        self.metrics = ProxyMetrics()
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.render_metrics)
        app.router.add_get("/v1/models", self.models)
        app.cleanup_ctx.append(self._session)
        return app

    async def _session(self, _: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(timeout=self.timeout) as self.session:
            yield

    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.path
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BackendError(400, "the request body must be a JSON object")
            params = await self._prefill(route, body)
            body = {**body, "kv_transfer_params": params}
            self.metrics.stage.labels("prefill").observe(time.perf_counter() - t0)
            resp = await self._decode(request, route, body, t0)
        except json.JSONDecodeError as e:
            return self._error(route, BackendError(400, f"malformed JSON: {e}"))
        except BackendError as e:
            return self._error(route, e)
        except _Cut as cut:
            return await self._cut(request, route, cut)
        except ConnectionError as e:  # the client's own connection, not a backend's
            self.metrics.requests.labels(route, "client_closed").inc()
            log.info("%s: the client closed the connection (%s)", route, e)
            return web.Response()
        self.metrics.requests.labels(route, "ok").inc()
        self.metrics.stage.labels("total").observe(time.perf_counter() - t0)
        return resp

    def _error(self, route: str, e: BackendError) -> web.Response:
        """An OpenAI-style JSON error naming the backend that failed; one log line."""
        self.metrics.requests.labels(route, "error").inc()
        log.warning("%s -> %d: %s", route, e.status, e)
        return web.json_response(_error_body(e), status=e.status)

    async def _cut(self, request: web.Request, route: str, cut: _Cut) -> web.StreamResponse:
        """D failed mid-stream: an SSE error event, then the connection is closed before
        the stream's last chunk, so the client never takes the answer for complete."""
        self.metrics.requests.labels(route, "error").inc()
        log.warning("%s: stream cut, %s", route, cut.error)
        event = b"data: " + json.dumps(_error_body(cut.error)).encode() + b"\n\n"
        with contextlib.suppress(ConnectionError):  # the client may be gone too
            await cut.out.write(event)
        if request.transport is not None:
            request.transport.close()  # sends what is buffered, never the closing chunk
        return cut.out

    async def _prefill(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        req = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        req.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        backend = self.p.pick()
        async with self._call(backend, "prefill", route, req) as call:
            resp = call.resp
            if resp.status != 200:
                text = await call.read(resp.text())
                try:  # its OpenAI error message if it has one, else the text
                    why = str(json.loads(text)["error"]["message"])
                except (ValueError, TypeError, KeyError):
                    why = text
                why = why.strip()[:500] or "(empty body)"
                msg = f"prefill server {backend.url} answered {resp.status}: {why}"
                raise BackendError(resp.status, msg, backend.url)
            reply = await call.read(resp.json())
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if not isinstance(params, dict):
            self.metrics.backend_errors.labels("prefill", "no_handle").inc()
            msg = f"prefill server {backend.url} returned no kv_transfer_params"
            raise BackendError(502, msg, backend.url)
        return params

    async def _decode(
        self, request: web.Request, route: str, body: dict[str, Any], t0: float
    ) -> web.StreamResponse:
        backend = self.d.pick()
        t1 = time.perf_counter()
        async with self._call(backend, "decode", route, body) as call:
            resp = call.resp
            if not body.get("stream"):
                data = await call.read(resp.read())
                self.metrics.ttft.observe(time.perf_counter() - t0)
                self.metrics.stage.labels("decode").observe(time.perf_counter() - t1)
                return web.Response(body=data, status=resp.status, content_type=resp.content_type)
            out = await self._stream(request, call, t0)
        self.metrics.stage.labels("decode").observe(time.perf_counter() - t1)
        return out

    async def _stream(self, request: web.Request, call: _Tracked, t0: float) -> web.StreamResponse:
        """Relay D's streamed reply; D failing once the headers are out raises :class:`_Cut`."""
        out = web.StreamResponse(status=call.resp.status)
        out.content_type = call.resp.content_type
        await out.prepare(request)
        first = True
        try:
            while chunk := await call.read(call.resp.content.readany()):
                if first:
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                    first = False
                await out.write(chunk)
        except BackendError as e:
            raise _Cut(out, e) from None
        await out.write_eof()
        return out

    def _call(self, b: Backend, role: str, route: str, body: dict[str, Any] | None) -> _Tracked:
        """POST ``body`` to ``b`` (GET when ``body`` is None), tracked."""
        assert self.session is not None
        url = b.url + route
        ctx = self.session.get(url) if body is None else self.session.post(url, json=body)
        return _Tracked(self, b, role, ctx)

    async def health(self, _: web.Request) -> web.Response:
        async def ok(b: Backend) -> bool:
            assert self.session is not None
            try:
                async with self.session.get(
                    b.url + "/health", timeout=aiohttp.ClientTimeout(5)
                ) as r:
                    return r.status == 200
            except (TimeoutError, aiohttp.ClientError):
                return False

        p = await asyncio.gather(*(ok(b) for b in self.p.backends))
        d = await asyncio.gather(*(ok(b) for b in self.d.backends))
        body = {
            "prefill": {b.url: h for b, h in zip(self.p.backends, p, strict=True)},
            "decode": {b.url: h for b, h in zip(self.d.backends, d, strict=True)},
        }
        return web.json_response(body, status=200 if any(p) and any(d) else 503)

    async def render_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        b = self.d.pick()
        try:
            async with self._call(b, "decode", "/v1/models", None) as call:
                data = await call.read(call.resp.read())
        except BackendError as e:
            return self._error(request.path, e)
        self.metrics.requests.labels(request.path, "ok").inc()
        return web.Response(body=data, status=call.resp.status, content_type=call.resp.content_type)


class _Tracked:
    """``async with``: one call to a backend, counted in flight and in errors. Only the
    connection and what :meth:`read` awaits are the backend's; errors of the client's
    own connection inside the block pass through unchanged."""

    resp: aiohttp.ClientResponse

    def __init__(self, proxy: Proxy, b: Backend, role: str, ctx: Any):
        self.proxy, self.b, self.role, self.ctx = proxy, b, role, ctx
        self.bad = False

    async def __aenter__(self) -> _Tracked:
        self.b.in_flight += 1
        self.proxy.metrics.in_flight.labels(self.role, self.b.url).set(self.b.in_flight)
        try:
            self.resp = await self.ctx.__aenter__()
        except (TimeoutError, aiohttp.ClientError) as e:
            error = self._fail(e)
            self._done()
            raise error from None
        return self

    async def read(self, aw: Awaitable[T]) -> T:
        """Await a read of the backend's reply; a timeout, lost connection or malformed
        JSON becomes a :class:`BackendError` naming the backend."""
        try:
            return await aw
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            raise self._fail(e) from None

    async def __aexit__(self, *exc: Any) -> None:
        self.bad = self.bad or isinstance(exc[1], BackendError)
        self._done()
        await self.ctx.__aexit__(*exc)

    def _fail(self, e: BaseException) -> BackendError:
        self.bad = True
        self.proxy.metrics.backend_errors.labels(self.role, type(e).__name__).inc()
        status = 504 if isinstance(e, TimeoutError) else 502  # the client's answer
        return BackendError(status, f"{self.role} server {self.b.url}: {describe(e)}", self.b.url)

    def _done(self) -> None:
        self.b.in_flight -= 1
        self.b.failed += int(self.bad)
        self.proxy.metrics.in_flight.labels(self.role, self.b.url).set(self.b.in_flight)


def listening(host: str, port: int, prefill: list[str], decode: list[str]) -> str:
    """The line the proxy prints once it listens (an IPv6 address in brackets)."""
    addr = f"[{host}]" if ":" in host else host
    return (
        f"kvbridge proxy listening on http://{addr}:{port}"
        f" (prefill: {', '.join(prefill)}; decode: {', '.join(decode)})"
    )


def run(prefill: list[str], decode: list[str], host: str, port: int) -> None:
    proxy = Proxy(prefill, decode)
    line = listening(
        host, port, [b.url for b in proxy.p.backends], [b.url for b in proxy.d.backends]
    )
    web.run_app(proxy.app(), host=host, port=port, print=lambda _: print(line, flush=True))
