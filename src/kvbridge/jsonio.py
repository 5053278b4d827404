"""The ``--json`` writer of every command and benchmark: strict JSON, a missing figure as
``null``."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float (a figure not measured) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, indent: int | None = 1) -> str:
    """``obj`` as JSON any parser reads (no ``NaN``/``Infinity``: those become null)."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)
