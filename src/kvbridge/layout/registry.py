"""Layouts by name: the one place a layout is registered.

A layout is a placement function: given, per group, per layer on this rank, the layer's
:class:`~kvbridge.layout.pieces.Piece` list (one per stream, already in the layout's
token order), the block count per group and ``kv_packed``, it returns the region sizes,
one :class:`~kvbridge.layout.view.View` per (layer, stream) and each group's region pool.
Everything downstream (planner, transports, engines) sees only views, so a new layout is
one function and one :func:`register_layout` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.errors import LayoutError
from kvbridge.layout.pieces import Built, Groups
from kvbridge.registry import Registry

Place = Callable[[Groups, tuple[int, ...], bool], Built]


@dataclass(frozen=True, slots=True)
class LayoutKind:
    """``order``: the token order inside a block, ``nhd`` (``[rows][heads][dim]``) or
    ``hnd`` (``[heads][rows][dim]``); ``None``: the caller's ``inner`` order.
    ``split_unpacked``: with ``kv_packed=False`` each stream gets its own region, so a
    layer's streams are not interleaved head by head."""

    name: str
    place: Place
    order: str | None = None
    split_unpacked: bool = False

    def token_order(self, inner: str) -> str:
        order = self.order or inner
        if order not in ("nhd", "hnd"):
            raise LayoutError(f"inner order {inner!r} must be nhd or hnd")
        return order


_LAYOUTS: Registry[LayoutKind] = Registry("layout", LayoutError)


def register_layout(kind: LayoutKind) -> None:
    _LAYOUTS.register(kind.name, kind)


def layout_names() -> tuple[str, ...]:
    return _LAYOUTS.names()


def get_layout(name: str) -> LayoutKind:
    return _LAYOUTS.get(name)


from kvbridge.layout import placements as _builtins  # noqa: E402, F401  (registers nhd, hnd, …)
