"""Block tables and the allocator that fills them, one free list per pool.

A request holds one table per spec group: ``ceil(tokens / block_size)`` block ids for a
token group, exactly one slot id for a state group. Groups that share a pool (layout
``shared-pool``) draw from one free list, so their ids never collide. All ranks of an
instance use the same ids.
"""

from __future__ import annotations

from collections import deque

from kvbridge.api import RankLayout
from refengine.errors import EngineError

Tables = list[list[int]]


class BlockAllocator:
    def __init__(self, layout: RankLayout, state_groups: tuple[bool, ...]) -> None:
        self.pools = layout.pools
        self.block_sizes = layout.block_sizes
        self.state_groups = state_groups
        sizes = dict(zip(layout.pools, layout.num_blocks, strict=True))
        self.free = {pool: deque(range(n)) for pool, n in sizes.items()}

    def blocks_needed(self, group: int, n_tokens: int) -> int:
        if self.state_groups[group]:
            return 1
        return -(-n_tokens // self.block_sizes[group])

    def grow(self, tables: Tables, n_tokens: int) -> None:
        """Extend every table so it covers ``n_tokens`` tokens; all or nothing."""
        extra = [self.blocks_needed(g, n_tokens) - len(t) for g, t in enumerate(tables)]
        for pool, free in self.free.items():
            want = sum(e for g, e in enumerate(extra) if self.pools[g] == pool)
            if want > len(free):
                raise EngineError(f"pool {pool}: {want} blocks needed, {len(free)} free")
        for g, table in enumerate(tables):
            free = self.free[self.pools[g]]
            table.extend(free.popleft() for _ in range(extra[g]))

    def release(self, tables: Tables) -> None:
        for g, table in enumerate(tables):
            self.free[self.pools[g]].extend(table)
            table.clear()
