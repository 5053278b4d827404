"""A seeded allocator trace: which blocks a request holds on P and on D.

Each side owns a pool of ``blocks`` blocks (and ``slots`` state slots for hybrids) with
a free queue as an engine keeps it (vLLM's block pool):

    free queue  [front ... back]     allocate: pop from the front
                                     free:     append at the back, blocks in REVERSE order

One request arrives per step with a lognormal prompt (``median_tokens``, ``sigma``,
capped at ``max_tokens``). P allocates its prompt blocks at once and keeps them until D
pulled them, ``hold`` steps later (uniform in ``[1, 2·live)``, so about ``live`` requests
wait on P). The pull is the traced event: D allocates the prompt blocks, then decodes
``decode_tokens`` tokens per step and takes a new block whenever the last one is full,
interleaved with every other live request, until its lognormal output is done; then it
frees everything. A side that runs out of blocks finishes its oldest requests first.
P and D allocate independently, so their ids fragment independently.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvbridge.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TraceConfig:
    blocks: int
    """Blocks per side (P and D pools have the same count)."""
    block_tokens: int = 16
    slots: int = 0
    """State slots per side (0: the model has no state group)."""
    live: int = 32
    median_tokens: float = 512.0
    sigma: float = 1.0
    max_tokens: int = 32768
    output_ratio: float = 0.25
    """Median output tokens as a fraction of ``median_tokens``."""
    seed: int = 0

    def check(self) -> None:
        need = -(-self.max_tokens // self.block_tokens)
        if self.blocks < 2 * need or self.blocks < self.live:
            raise ConfigError(
                f"a pool of {self.blocks} blocks cannot hold two {self.max_tokens}-token "
                f"prompts ({need} blocks each) or {self.live} live requests"
            )
        if self.slots and self.slots <= self.live:
            raise ConfigError(f"{self.slots} state slots for {self.live} live requests")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One pull: ``tokens`` prompt tokens in P's ``p_blocks`` and D's ``d_blocks``
    (int64 ids, ``⌈tokens / block_tokens⌉`` each); state slots, -1 without state."""

    index: int
    tokens: int
    p_blocks: np.ndarray
    d_blocks: np.ndarray
    p_slot: int = -1
    d_slot: int = -1


Event = tuple[str, str, int, tuple[int, ...]]
"""``(pool, "alloc" | "free", request, ids)``; pool is ``P``, ``D``, ``P-slot``, ``D-slot``."""


class BlockPool:
    """Ids ``[0, n)`` with a FIFO free queue; freed ids go to the back in reverse order."""

    def __init__(self, name: str, n: int, events: list[Event] | None = None):
        self.name, self.size = name, n
        self._free: deque[int] = deque(range(n))
        self._events = events
        self.handed = 0
        """Ids handed out so far, counting each time."""

    @property
    def free_count(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        """The free queue, front first."""
        return list(self._free)

    def allocate(self, k: int, req: int) -> list[int]:
        if k > len(self._free):
            raise ConfigError(f"pool {self.name}: {k} blocks asked, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(k)]
        self.handed += k
        self._log("alloc", req, ids)
        return ids

    def free(self, ids: list[int], req: int) -> None:
        self._free.extend(reversed(ids))
        self._log("free", req, ids)

    def _log(self, op: str, req: int, ids: list[int]) -> None:
        if self._events is not None and ids:
            self._events.append((self.name, op, req, tuple(ids)))


@dataclass(slots=True)
class _Live:
    """A request held by one side: its blocks (growing on D), slot, tokens, deadline."""

    req: int
    blocks: list[int]
    slot: int
    tokens: int
    until: int
    """P: the step of the pull. D: total tokens (prompt + output) when done."""


@dataclass
class Side:
    """One instance's pools and the requests it holds, oldest first."""

    blocks: BlockPool
    slots: BlockPool | None
    live: dict[int, _Live] = field(default_factory=dict)

    def room(self, k: int) -> bool:
        """Whether ``k`` blocks (and a slot, for hybrids) are free."""
        return self.blocks.free_count >= k and (self.slots is None or self.slots.free_count > 0)

    def take(self, req: int, k: int, tokens: int, until: int) -> _Live:
        """Allocate ``k`` blocks and a slot for ``req`` (the caller made room)."""
        slot = self.slots.allocate(1, req)[0] if self.slots else -1
        held = self.live[req] = _Live(req, self.blocks.allocate(k, req), slot, tokens, until)
        return held

    def grow(self, held: _Live, tokens: int, bs: int) -> None:
        """Append ``tokens`` decoded tokens, a new block whenever the last one is full;
        finishes the oldest requests (maybe this one) when no block is free."""
        need = -(-(held.tokens + tokens) // bs) - len(held.blocks)
        while need > 0 and self.blocks.free_count < need:
            oldest = next(iter(self.live))
            self.finish(oldest)
            if oldest == held.req:
                return
        if need > 0:
            held.blocks += self.blocks.allocate(need, held.req)
        held.tokens += tokens

    def finish(self, req: int) -> None:
        held = self.live.pop(req)
        self.blocks.free(held.blocks, req)
        if self.slots is not None:
            self.slots.free([held.slot], req)

    def drain(self) -> None:
        for req in list(self.live):
            self.finish(req)


class Simulator:
    """The two instances of :class:`TraceConfig`; :meth:`step` advances one step."""

    def __init__(self, cfg: TraceConfig, record: bool = False):
        cfg.check()
        self.cfg = cfg
        self.events: list[Event] | None = [] if record else None
        self.p, self.d = self._side("P"), self._side("D")
        self.rng = np.random.default_rng(cfg.seed)
        self.now = 0
        mean_out = cfg.median_tokens * cfg.output_ratio * math.exp(cfg.sigma**2 / 2)
        self.decode_tokens = max(1, round(mean_out / cfg.live))

    def _side(self, name: str) -> Side:
        slots = BlockPool(f"{name}-slot", self.cfg.slots, self.events) if self.cfg.slots else None
        return Side(BlockPool(name, self.cfg.blocks, self.events), slots)

    def length(self, median: float) -> int:
        """A lognormal token count in ``[1, max_tokens]``."""
        x = median * math.exp(self.cfg.sigma * float(self.rng.standard_normal()))
        return min(max(round(x), 1), self.cfg.max_tokens)

    def step(self) -> list[TraceRequest]:
        """Pulls due now (in arrival order), one arrival, one decode step."""
        due = [r for r, held in self.p.live.items() if held.until <= self.now]
        pulls = [self._pull(r) for r in due]
        pulls += self._arrive()
        self._decode()
        self.now += 1
        return pulls

    def _arrive(self) -> list[TraceRequest]:
        """A new prompt on P; P pulls its oldest requests early while it has no room."""
        req, cfg = self.now, self.cfg
        tokens = self.length(cfg.median_tokens)
        k = -(-tokens // cfg.block_tokens)
        early = []
        while not self.p.room(k):
            early.append(self._pull(next(iter(self.p.live))))
        hold = int(self.rng.integers(1, 2 * cfg.live))
        self.p.take(req, k, tokens, self.now + hold)
        return early

    def _pull(self, req: int) -> TraceRequest:
        """D takes the prompt's blocks (finishing its oldest while full); P frees its own."""
        held = self.p.live[req]
        out = self.length(self.cfg.median_tokens * self.cfg.output_ratio)
        while not self.d.room(len(held.blocks)):
            self.d.finish(next(iter(self.d.live)))
        got = self.d.take(req, len(held.blocks), held.tokens, held.tokens + out)
        pulled = TraceRequest(
            req,
            held.tokens,
            np.array(held.blocks, np.int64),
            np.array(got.blocks, np.int64),
            held.slot,
            got.slot,
        )
        self.p.finish(req)
        return pulled

    def _decode(self) -> None:
        for req in list(self.d.live):
            held = self.d.live.get(req)
            if held is None:
                continue
            self.d.grow(held, self.decode_tokens, self.cfg.block_tokens)
            if req in self.d.live and held.tokens >= held.until:
                self.d.finish(req)


def simulate(
    cfg: TraceConfig, requests: int, record: bool = False
) -> tuple[list[TraceRequest], Simulator]:
    """``requests`` pulls after a warm-up in which each side handed out every block
    twice over (so ids are as fragmented as a long-running engine's); the simulator
    (its pools, and with ``record`` every allocation and free) comes back too."""
    sim = Simulator(cfg, record)
    out: list[TraceRequest] = []
    while len(out) < requests:
        warm = min(sim.p.blocks.handed, sim.d.blocks.handed) >= 2 * cfg.blocks
        out += [r for r in sim.step() if warm][: requests - len(out)]
    return out, sim
