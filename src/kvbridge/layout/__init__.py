"""Layout: where a rank keeps its bytes (map: ``docs/structure.md``)."""

from kvbridge.layout.build import LAYOUTS, build_layout
from kvbridge.layout.view import RankLayout, View

__all__ = ["LAYOUTS", "RankLayout", "View", "build_layout"]
