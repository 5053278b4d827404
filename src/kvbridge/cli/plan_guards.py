"""Resource guards of ``kvbridge plan``: the memory a plan needs, estimated before it is
built, and the model's context length from its ``config.json``.

The estimate plans every D rank at two small token counts and extrapolates each rank's
descriptor count linearly (descriptors grow at most linearly with the blocks a request
spans; windowed layers grow slower, so the estimate errs high). Ranks are planned one at
a time, so the peak is the largest rank's runs plus the block tables of both sides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge import catalog
from kvbridge.errors import ConfigError
from kvbridge.layout.side import SideConfig
from kvbridge.plan.dry_run import dry_run, pool_size
from kvbridge.spec.info import ModelInfo

BYTES_PER_DESCRIPTOR = 128
"""Peak bytes per descriptor of the largest rank while it is planned and summarised
(measured under tracemalloc: 48 to 82; a test keeps the bound honest)."""
FIXED_BYTES = 16 << 20
"""Geometry, layouts and small tables, whatever the token count."""
BYTES_PER_BLOCK_ID = 40
"""Block tables: the shuffled pool, P's and D's tables and their int64 copies."""
SAMPLE_TOKENS = (2048, 4096)
"""Token counts planned to extrapolate from; at or below the larger, no estimate."""


@dataclass(frozen=True, slots=True)
class Estimate:
    descriptors: int
    """Of the largest D rank."""
    bytes: int


def estimate(
    info: ModelInfo, p: SideConfig, d: SideConfig, tokens: int, seed: int | None
) -> Estimate:
    """The memory planning ``tokens`` tokens needs, from plans at :data:`SAMPLE_TOKENS`."""
    t1, t2 = SAMPLE_TOKENS
    if tokens <= t2:
        t1 = t2 = tokens
    one = [r.summary.descriptors for r in dry_run(info, p, d, t1, 0, seed)]
    two = [r.summary.descriptors for r in dry_run(info, p, d, t2, 0, seed)] if t2 != t1 else one
    slope = [max(b - a, 0) / (t2 - t1) if t2 > t1 else 0.0 for a, b in zip(one, two, strict=True)]
    # shuffled ids join by chance where they happen to be consecutive, less often in the
    # small samples' pools than in a large one: a 10 % margin keeps this a bound
    desc = max(int((b + s * (tokens - t2)) * 1.1) + 1 for b, s in zip(two, slope, strict=True))
    pool = max(pool_size(info.spec.with_block_sizes(x.block_size), tokens) for x in (p, d))
    return Estimate(desc, FIXED_BYTES + desc * BYTES_PER_DESCRIPTOR + pool * BYTES_PER_BLOCK_ID)


def context_length(model: str) -> int | None:
    """``max_position_embeddings`` of the model's ``config.json`` (top level, or in
    ``text_config``); None for spec files and configs without one."""
    path = Path(model)
    if not path.exists() and len(path.parts) == 1 and not model.endswith((".json", ".toml")):
        try:
            path = catalog.config_path(model)
        except ConfigError:
            return None
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return _max_positions(data)


def _max_positions(data: Any) -> int | None:
    if not isinstance(data, dict):
        return None
    for cfg in (data, data.get("text_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("max_position_embeddings"), int):
            return int(cfg["max_position_embeddings"])
    return None
