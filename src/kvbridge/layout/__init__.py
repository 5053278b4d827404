"""Layout: where a rank keeps its bytes (map: ``docs/structure.md``).

Add a layout with :func:`register_layout` (``layout/build.py``)."""

from kvbridge.layout.build import (
    LayoutKind,
    build_layout,
    get_layout,
    layout_names,
    register_layout,
)
from kvbridge.layout.side import SideConfig
from kvbridge.layout.view import RankLayout, View

__all__ = [
    "LayoutKind",
    "RankLayout",
    "SideConfig",
    "View",
    "build_layout",
    "get_layout",
    "layout_names",
    "register_layout",
]
