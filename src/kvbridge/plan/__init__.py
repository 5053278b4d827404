"""Plan: which bytes go where, geometry once per pair, runs per request.

Map of the package: ``docs/structure.md``."""

from kvbridge.plan.geometry import Geometry, Side
from kvbridge.plan.pattern import Bound
from kvbridge.plan.plan import Plan, PlanSummary, SourceSummary
from kvbridge.plan.runs import Runs, merge_adjacent

__all__ = [
    "Bound",
    "Geometry",
    "Plan",
    "PlanSummary",
    "Runs",
    "Side",
    "SourceSummary",
    "merge_adjacent",
]
