"""The P and D servers behind the proxy, and the rule that picks one per request."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvbridge.errors import ConfigError


@dataclass
class Backend:
    url: str
    """Base URL, e.g. ``http://127.0.0.1:8100`` (no trailing slash)."""
    in_flight: int = 0
    served: int = 0
    failed: int = 0


@dataclass
class Pool:
    """Backends of one role. :meth:`pick`: fewest requests in flight, ties in turn."""

    role: str
    backends: list[Backend]
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @staticmethod
    def of(role: str, urls: list[str]) -> Pool:
        if not urls:
            raise ConfigError(f"--{role}: at least one server URL is needed")
        return Pool(role, [Backend(check_url(role, u)) for u in urls])

    def pick(self) -> Backend:
        turn = next(self._turn)
        n = len(self.backends)
        order = [self.backends[(turn + i) % n] for i in range(n)]
        return min(order, key=lambda b: b.in_flight)


def check_url(role: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--{role} {url!r}: expected http(s)://host:port")
    return url.rstrip("/")
