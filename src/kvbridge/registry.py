"""Things by name: the one table shape behind layouts, transports, movers and engine mixers.

Each kind keeps one :class:`Registry` in its own module (``layout/build.py``,
``transport/__init__.py``, ``connector/movers/registry.py``, ``refengine/mixers.py``) and wraps it
in that kind's functions (``register_layout``, ``make_transport``, …); this module imports
nothing heavy.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from kvbridge.errors import KVBridgeError

T = TypeVar("T")

_BAD_CHARS = frozenset(" \t\n,=")  # a name is one token of a CLI ``key=value,…`` list


class Registry(Generic[T]):
    """Items of one kind by name, in registration order. ``kind`` names the kind in
    messages; ``error`` is raised for a bad, duplicate or unknown name."""

    __slots__ = ("_items", "error", "kind")

    def __init__(self, kind: str, error: type[Exception] = KVBridgeError) -> None:
        self.kind = kind
        self.error = error
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> None:
        """Make ``item`` known as ``name``; a name is registered once."""
        if not isinstance(name, str) or not name or not _BAD_CHARS.isdisjoint(name):
            raise self.error(
                f"{self.kind} name {name!r} must be a non-empty string without spaces, ',' or '='"
            )
        if name in self._items:
            raise self.error(f"{self.kind} {name!r} is registered already")
        self._items[name] = item

    def get(self, name: str) -> T:
        """The item registered as ``name``; the error lists the known names."""
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(self._items)
            raise self.error(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)
