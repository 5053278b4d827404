"""One case of the trace benchmark: model, TP pair, layouts; the pool and trace sizes
derived from a memory budget; the layouts and the memory both processes build.

Pool sizing (``pool_bytes`` per instance, all its ranks together, as an engine sizes its
pool from the memory left after the weights): state groups get ``live + 8`` slots, the
rest goes to attention blocks. Prompt lengths are lognormal with the median that fills
about 75 % of the pool with ``live`` requests (prompt and output on D), capped at
``min(32768, pool tokens / 8)`` so that two of the longest fit besides the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from benchmarks.shapes import llama
from benchmarks.trace_alloc import TraceConfig
from kvbridge.errors import ConfigError
from kvbridge.layout import RankLayout, build_layout
from kvbridge.spec import ModelSpec, Parallel, load_model

PAGE = 4096
SIGMA = 1.0
OUTPUT_RATIO = 0.25
FILL = 0.75


@dataclass(frozen=True, slots=True)
class Case:
    model: str
    p_tp: int
    d_tp: int
    p_layout: str
    d_layout: str
    requests: int = 12
    pool_bytes: int = 5 << 28
    """Cache memory per instance (bytes, all ranks): 1.25 GiB by default."""
    live: int = 32
    seed: int = 0
    budget_s: float = 12.0
    """Measuring stops after this many seconds (at least ``min_requests`` requests)."""
    min_requests: int = 3

    def label(self) -> str:
        lay = (
            self.p_layout if self.p_layout == self.d_layout else f"{self.p_layout}→{self.d_layout}"
        )
        return f"{self.model} TP {self.p_tp}→{self.d_tp} {lay}"


@dataclass(frozen=True, slots=True)
class Sizing:
    """Blocks per group (state groups: slots), the trace and the scratch buffers."""

    num_blocks: dict[str, int]
    trace: TraceConfig
    scratch_bytes: int


def model_spec(name: str) -> ModelSpec:
    """``llama-3.1-8b`` as :func:`benchmarks.shapes.llama`; others from the catalog."""
    return llama(32) if name == "llama-3.1-8b" else load_model(name).spec


def _bytes_per_block(spec: ModelSpec, tp: int, ranks: range) -> list[int]:
    """Bytes of one block (state: one slot) per group, summed over ``ranks``."""
    lays = [build_layout(spec, Parallel(tp), r, "nhd", 1) for r in ranks]
    out = [0] * len(spec.groups)
    for lay in lays:
        for v in lay.views:
            out[spec.group_of(v.layer)] += v.rows * sum(
                (b - a) * ub for (a, b), ub in zip(v.seg_units, v.unit_bytes, strict=True)
            )
    return out


def sizing(spec: ModelSpec, case: Case) -> Sizing:
    p = _bytes_per_block(spec, case.p_tp, range(case.p_tp))
    d = _bytes_per_block(spec, case.d_tp, range(case.d_tp))
    inst = [max(a, b) for a, b in zip(p, d, strict=True)]
    state = [spec.is_state_group(g) for g in range(len(spec.groups))]
    slots = case.live + 8 if any(state) else 0
    left = case.pool_bytes - slots * sum(b for b, s in zip(inst, state, strict=True) if s)
    blocks = left // sum(b for b, s in zip(inst, state, strict=True) if not s)
    if blocks < 4 * case.live:
        raise ConfigError(
            f"{case.pool_bytes} B per instance leave {max(blocks, 0)} blocks for "
            f"{case.live} live requests ({slots} state slots take the rest)"
        )
    bs = next(g.block_size for g, s in zip(spec.groups, state, strict=True) if not s)
    tokens = blocks * bs
    spread = math.exp(SIGMA**2 / 2) * (1 + OUTPUT_RATIO)
    cfg = TraceConfig(
        blocks=int(blocks),
        block_tokens=bs,
        slots=slots,
        live=case.live,
        median_tokens=tokens * FILL / (case.live * spread),
        sigma=SIGMA,
        max_tokens=min(32768, tokens // 8),
        output_ratio=OUTPUT_RATIO,
        seed=case.seed,
    )
    d_rank = _bytes_per_block(spec, case.d_tp, range(1))
    blocks_max = -(-cfg.max_tokens // bs)
    scratch = sum(b * (1 if s else blocks_max) for b, s in zip(d_rank, state, strict=True))
    names = {g.name: (slots if s else int(blocks)) for g, s in zip(spec.groups, state, strict=True)}
    return Sizing(names, cfg, scratch)


def layouts(spec: ModelSpec, case: Case, size: Sizing) -> tuple[list[RankLayout], RankLayout]:
    """Every P rank's layout and D rank 0's."""
    p = [
        build_layout(spec, Parallel(case.p_tp), r, case.p_layout, size.num_blocks)
        for r in range(case.p_tp)
    ]
    return p, build_layout(spec, Parallel(case.d_tp), 0, case.d_layout, size.num_blocks)


def head_split(p_lays: list[RankLayout], d_lay: RankLayout) -> bool:
    """Whether D rank 0 holds other units (heads, channels) than some P rank."""
    return any(
        p.has(v.layer, v.stream) and p.view(v.layer, v.stream).seg_units != v.seg_units
        for p in p_lays
        for v in d_lay.views
    )


def allocate(layout: RankLayout) -> tuple[np.ndarray, list[np.ndarray]]:
    """One zeroed buffer (its pages untouched until written, as an engine's pool before
    use) carved into the layout's regions at page boundaries; (buffer, regions)."""
    offsets, pos = [], 0
    for n in layout.regions:
        offsets.append(pos)
        pos += -(-n // PAGE) * PAGE
    buf = np.zeros(pos + PAGE, np.uint8)
    shift = -int(buf.ctypes.data) % PAGE
    regions = [buf[shift + o : shift + o + n] for o, n in zip(offsets, layout.regions, strict=True)]
    return buf, regions
