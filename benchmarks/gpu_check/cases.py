"""The check's cases and the requests each moves.

A case is one P/D pairing (model shapes, tokens per request, TP on each side, block sizes,
layouts, pull or push); its requests take their block ids from an allocator trace
(:mod:`benchmarks.trace_alloc`) run on both sides until every block was handed out
twice, so ids are as fragmented as a long-running engine's, independently on P and D.

Pools hold ``pool_factor`` requests' worth of blocks (hybrids: ``live + 8`` state slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from benchmarks.shapes import llama
from benchmarks.trace_alloc import Side, Simulator, TraceConfig
from kvbridge.errors import ConfigError
from kvbridge.layout import RankLayout, build_layout
from kvbridge.spec import ModelSpec, Parallel, load_model

SHORT = {"llama-3.1-8b": "llama-8b", "jamba-1.5-mini": "jamba", "qwen3-next-80b-a3b": "qwen3-next"}


@dataclass(frozen=True, slots=True)
class Case:
    """One pairing. ``model``: ``llama-3.1-8b`` (32 layers), ``llama-<N>l`` (Llama-3.1 shapes,
    N layers) or a catalog name; ``tokens`` per request; ``mode``: ``pull`` or ``push`` (the
    consumer's mode, and who posts the direct and staged transfers)."""

    model: str
    tokens: int
    p_tp: int = 1
    d_tp: int = 1
    p_layout: str = "nhd"
    d_layout: str = "nhd"
    p_block: int = 16
    d_block: int = 16
    mode: str = "pull"
    requests: int = 6
    """Requests measured (each: one cold transfer per method, then ``reps`` timed)."""
    reps: int = 2
    pool_factor: int = 4
    live: int = 6
    seed: int = 0

    def label(self) -> str:
        size = f"{self.tokens // 1024}k" if self.tokens % 1024 == 0 else f"{self.tokens}t"
        lay = (
            self.p_layout if self.p_layout == self.d_layout else f"{self.p_layout}→{self.d_layout}"
        )
        bs = f"{self.p_block}" if self.p_block == self.d_block else f"{self.p_block}→{self.d_block}"
        name = SHORT.get(self.model, self.model)
        return f"{name} {size} {self.p_tp}→{self.d_tp} {lay} bs{bs} {self.mode}"

    def spec(self) -> ModelSpec:
        if self.model == "llama-3.1-8b":
            return llama(32)
        if self.model.startswith("llama-") and self.model.endswith("l"):
            return llama(int(self.model[len("llama-") : -1]))
        return load_model(self.model).spec

    def specs(self) -> tuple[ModelSpec, ModelSpec]:
        """(P's spec, D's spec): the model with each side's block size."""
        spec = self.spec()
        return spec.with_block_sizes(self.p_block), spec.with_block_sizes(self.d_block)

    def pars(self) -> tuple[Parallel, Parallel]:
        return Parallel(self.p_tp), Parallel(self.d_tp)

    def num_blocks(self, spec: ModelSpec) -> dict[str, int]:
        """Blocks per group (state groups: slots) of a pool on the side keeping ``spec``."""
        out = {}
        for g, grp in enumerate(spec.groups):
            if spec.is_state_group(g):
                out[grp.name] = self.live + 8
            else:
                out[grp.name] = self.pool_factor * -(-self.tokens // grp.block_size)
        return out

    def layouts(self) -> tuple[list[RankLayout], list[RankLayout]]:
        """Every P rank's layout and every D rank's."""
        (sp, sd), (pp, pd) = self.specs(), self.pars()
        p = [build_layout(sp, pp, r, self.p_layout, self.num_blocks(sp)) for r in range(pp.world)]
        d = [build_layout(sd, pd, r, self.d_layout, self.num_blocks(sd)) for r in range(pd.world)]
        return p, d


GPU_CASES = (
    Case("llama-3.1-8b", 1024, mode="pull"),
    Case("llama-3.1-8b", 8192, mode="push"),
    Case("llama-3.1-8b", 1024, 1, 2, mode="push"),
    Case("llama-3.1-8b", 1024, 2, 1, "hnd", "hnd", mode="pull"),
    Case("llama-3.1-8b", 1024, 1, 1, "block-major", "block-major", 16, 32, mode="push"),
    Case("jamba-1.5-mini", 1024, 1, 1, "hnd", "hnd", mode="pull"),
)
"""``make gpu-check``: Llama-3.1-8B shapes (bf16) at 1k and 8k tokens, 1→2 NHD, 2→1,
block 16→32 block-major, and a hybrid (Jamba: Mamba state + attention); sized for an H100
within the 260 s budget of ``gpu_check.sh`` (6 requests each: untried on a GPU yet)."""

QUICK_CASES = (
    Case("llama-4l", 300, mode="pull", requests=2, reps=1),
    Case("llama-4l", 300, 1, 2, mode="push", requests=2, reps=1),
    Case("llama-4l", 300, 2, 1, "hnd", "hnd", mode="pull", requests=2, reps=1),
    Case("llama-4l", 300, 1, 1, "block-major", "block-major", 16, 32, "push", 2, 1),
    Case("jamba-1.5-mini", 200, 1, 1, "hnd", "hnd", mode="pull", requests=2, reps=1),
)
"""``--quick``, the CPU half in ``make test``: Llama-3.1 shapes cut to 4 layers, 300
tokens (partial last blocks), the same pairings; Jamba at 200 tokens."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request: ``tokens`` prompt tokens; block ids per spec group on each side (int64;
    a state group holds one slot id)."""

    index: int
    tokens: int
    p_tables: tuple[np.ndarray, ...]
    d_tables: tuple[np.ndarray, ...]

    def lists(self, side: str) -> list[list[int]]:
        """The tables as lists of ints (what :class:`~kvbridge.api.Producer` takes)."""
        tabs = self.p_tables if side == "P" else self.d_tables
        return [[int(x) for x in t] for t in tabs]


def requests(case: Case) -> list[Request]:
    """``case.requests`` requests of ``case.tokens`` tokens with fragmented block ids."""
    sp, sd = case.specs()
    p_sim, d_sim = _simulator(case, sp, 0), _simulator(case, sd, 1)
    out = []
    for i in range(case.requests):
        p = _take(p_sim, p_sim.p, sp, case.tokens, 1_000_000 + i)
        d = _take(d_sim, d_sim.d, sd, case.tokens, 1_000_000 + i)
        out.append(Request(i, case.tokens, p, d))
    return out


def _token_group(spec: ModelSpec) -> int:
    token = [g for g in range(len(spec.groups)) if not spec.is_state_group(g)]
    if len(token) != 1:
        raise ConfigError(f"{spec.name}: the trace serves one token group, not {len(token)}")
    return token[0]


def _simulator(case: Case, spec: ModelSpec, salt: int) -> Simulator:
    """A two-sided trace over pools of this side's size, warmed until every block was
    handed out twice on both of its sides."""
    g = _token_group(spec)
    bs = spec.groups[g].block_size
    blocks = case.num_blocks(spec)[spec.groups[g].name]
    slots = case.live + 8 if len(spec.groups) > 1 else 0
    spread = math.exp(0.5) * 1.25  # lognormal mean over median (sigma 1), prompt + output
    cfg = TraceConfig(
        blocks=blocks,
        block_tokens=bs,
        slots=slots,
        live=case.live,
        median_tokens=blocks * bs * 0.75 / (case.live * spread),
        max_tokens=case.tokens,
        seed=case.seed * 2 + salt,
    )
    sim = Simulator(cfg)
    while min(sim.p.blocks.handed, sim.d.blocks.handed) < 2 * blocks:
        sim.step()
    return sim


def _take(
    sim: Simulator, side: Side, spec: ModelSpec, tokens: int, rid: int
) -> tuple[np.ndarray, ...]:
    """Block ids (and a slot) for one request from ``side``'s free queue after a few more
    steps of churn; given back at once (the trace only lends the ids)."""
    for _ in range(4):
        sim.step()
    k = -(-tokens // spec.groups[_token_group(spec)].block_size)
    while not side.room(k):
        side.finish(next(iter(side.live)))
    held = side.take(rid, k, tokens, tokens)
    tables = tuple(
        np.array([held.slot], np.int64)
        if spec.is_state_group(g)
        else np.array(held.blocks, np.int64)
        for g in range(len(spec.groups))
    )
    side.finish(rid)
    return tables
