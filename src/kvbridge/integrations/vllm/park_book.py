"""The scheduler side of parking (:mod:`~kvbridge.integrations.vllm.park`): which vLLM
blocks each request prefilled for remote decode holds, read from the scheduler's outputs
as vLLM's workers read them, and the park's slots (vLLM block ids ``1 … n-1``; 0 stands
for vLLM's null block, as in vLLM's pool)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.integrations.vllm.park import BlockIds

Order = tuple[str, BlockIds, BlockIds]
"""``(request id, vLLM blocks, park slots)``: copy each block to its slot, per group."""


Keep = Callable[[int, int], range]
"""``keep(group, n)``: the positions of the group's block table D may read after P
prefilled ``n`` tokens (a sliding window's last blocks, a state group's one slot)."""


class ParkBook:
    def __init__(self, slots: int, groups: int, keep: Keep | None = None):
        self.free = list(range(slots - 1, 0, -1))
        self.groups = groups
        self.keep: Keep = keep or (lambda g, n: range(1 << 62))
        self.prompt: dict[str, int] = {}
        """Requests prefilled for remote decode, not yet ordered: tokens to prefill."""
        self.blocks: dict[str, BlockIds] = {}
        """Their vLLM blocks as the scheduler's outputs gave them to the workers."""
        self.ordered: dict[str, tuple[BlockIds, BlockIds]] = {}
        """Copied in a step (blocks, slots), the request not ended yet."""
        self.held: dict[str, list[int]] = {}
        """Slots under a park lease, by request id."""
        self.taken = 0
        """Slots taken so far (blocks copied into the park), all requests."""

    def watch(self, request_id: str, n_prompt: int) -> None:
        self.prompt[request_id] = n_prompt
        self.blocks.pop(request_id, None)

    def orders(self, scheduled: Any) -> list[Order]:
        """The copies of this step (vLLM's ``SchedulerOutput``): every watched request
        whose prompt it completes, while slots last."""
        counts: dict[str, int] = getattr(scheduled, "num_scheduled_tokens", None) or {}
        done = self._follow(scheduled)
        out = []
        for rid, computed in done.items():
            if computed + counts.get(rid, 0) < self.prompt[rid]:
                continue  # a chunk of its prompt: later
            n = self.prompt.pop(rid)
            blocks = self.blocks.pop(rid)
            if rid in self.held or rid in self.ordered:
                continue  # its id still parked: served from vLLM's blocks
            slots = self._take(blocks, n)
            if slots is not None:
                self.ordered[rid] = (blocks, slots)
                copied = [
                    [b if s else 0 for b, s in zip(*t, strict=True)]
                    for t in zip(blocks, slots, strict=True)
                ]
                out.append((rid, copied, slots))
        return out

    def _follow(self, scheduled: Any) -> dict[str, int]:
        """Update watched requests' blocks from ``scheduled``; ``{id: tokens computed
        before this step}`` of those in it."""
        out = {}
        for r in getattr(scheduled, "scheduled_new_reqs", None) or ():
            if r.req_id in self.prompt:
                self.blocks[r.req_id] = [list(b) for b in r.block_ids]
                out[r.req_id] = int(r.num_computed_tokens)
        cached: Any = getattr(scheduled, "scheduled_cached_reqs", None)
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        for i, rid in enumerate(getattr(cached, "req_ids", None) or ()):
            if rid not in self.prompt:
                continue
            new = cached.new_block_ids[i]
            if rid in resumed:
                self.blocks[rid] = [list(b) for b in new] if new is not None else []
            elif rid not in self.blocks:
                continue  # never seen new: not followed (never parked)
            elif new is not None:
                for have, more in zip(self.blocks[rid], new, strict=True):
                    have.extend(more)
            out[rid] = int(cached.num_computed_tokens[i])
        return {rid: c for rid, c in out.items() if len(self.blocks[rid]) == self.groups}

    def _take(self, blocks: BlockIds, n: int) -> BlockIds | None:
        """A slot for each block D may read (none for a null one, or one before a
        window), or None if too few are free."""
        keep = [self.keep(g, n) for g in range(len(blocks))]
        need = sum(
            1 for g, tab in enumerate(blocks) for i, b in enumerate(tab) if b and i in keep[g]
        )
        if need > len(self.free):
            return None
        self.taken += need
        return [
            [self.free.pop() if b and i in keep[g] else 0 for i, b in enumerate(tab)]
            for g, tab in enumerate(blocks)
        ]

    def settle(
        self, request_id: str, block_ids: Sequence[Sequence[int]], ok: bool
    ) -> BlockIds | None:
        """At ``request_finished``: the parked copy of ``block_ids`` (vLLM's blocks at the
        end) as park slots, if ``ok`` (the request ended prefilled) and the blocks are
        those copied (null where vLLM dropped one); None otherwise, its slots back."""
        self.prompt.pop(request_id, None)
        self.blocks.pop(request_id, None)
        copied = self.ordered.pop(request_id, None)
        if copied is None:
            return None
        blocks, slots = copied
        mapped = _mapped(block_ids, blocks, slots) if ok else None
        used = {s for tab in mapped or () for s in tab if s}
        self.free.extend(s for tab in slots for s in tab if s and s not in used)
        if mapped is not None:
            self.held[request_id] = sorted(used)
        return mapped

    def ended(self, request_id: str) -> None:
        """The park lease of ``request_id`` ended: its slots are free."""
        self.free.extend(self.held.pop(request_id, ()))


def _mapped(final: Sequence[Sequence[int]], blocks: BlockIds, slots: BlockIds) -> BlockIds | None:
    """``final`` with each block replaced by its slot (null where vLLM's is, or where
    no slot was taken: a block D does not read); None if a block is not the one
    followed at its place, or there are more than followed."""
    if len(final) != len(blocks):
        return None
    out = []
    for fin, tab, sl in zip(final, blocks, slots, strict=True):
        if len(fin) > len(tab):
            return None
        row = []
        for i, b in enumerate(fin):
            if b and b != tab[i]:
                return None
            row.append(sl[i] if b else 0)
        out.append(row)
    return out
