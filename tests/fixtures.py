"""Where the shared model fixtures live: ``$KVBRIDGE_SHARED``, else ``shared/`` beside the
repository (as CI lays it out), else the workplace's ``/work/shared``."""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    candidates = [Path(p) for p in [os.environ.get("KVBRIDGE_SHARED", "")] if p]
    candidates += [_REPO.parent / "shared", Path("/work/shared")]
    for c in candidates:
        if (c / "data" / "models").is_dir():
            return c
    return candidates[0] if candidates else _REPO.parent / "shared"


MODELS_DIR = shared_dir() / "data" / "models"
