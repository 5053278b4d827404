"""The scheduler side of parking (:mod:`~kvbridge.integrations.vllm.park`): which vLLM
blocks each request prefilled for remote decode holds, read from the scheduler's outputs
as vLLM's workers read them, and the park's slots (vLLM block ids ``1 … n-1``; 0 stands
for vLLM's null block, as in vLLM's pool)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvbridge.integrations.vllm.park import Order

BlockIds = list[list[int]]
"""vLLM block ids, one list per KV cache group."""
Slots = tuple[list[np.ndarray], list[np.ndarray]]
"""Per group: vLLM blocks followed, and the park slot of each (0: none)."""


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
        self.ordered: dict[str, Slots] = {}
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
        out: list[Order] = []
        for rid, computed in done.items():
            if computed + counts.get(rid, 0) < self.prompt[rid]:
                continue  # a chunk of its prompt: later
            n = self.prompt.pop(rid)
            blocks = self.blocks.pop(rid)
            if rid in self.held or rid in self.ordered:
                continue  # its id still parked: served from vLLM's blocks
            took = self._take(blocks, n)
            if took is not None:
                self.ordered[rid] = took
                tabs, slots = took
                copied = [np.where(s != 0, b, 0) for b, s in zip(tabs, slots, strict=True)]
                out.append(Order(rid, copied, slots))
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

    def _take(self, followed: list[list[int]], n: int) -> Slots | None:
        """A slot for each block D may read (none for a null one, or one before a
        window), or None if too few are free; by numpy, per group."""
        blocks = [np.asarray(tab, dtype=np.int64) for tab in followed]
        wanted = []
        for g, tab in enumerate(blocks):
            keep = self.keep(g, n)
            at = np.arange(len(tab))
            wanted.append((tab != 0) & (at >= keep.start) & (at < keep.stop))
        need = sum(int(w.sum()) for w in wanted)
        if need > len(self.free):
            return None
        self.taken += need
        slots = []
        for w in wanted:
            k = int(w.sum())
            row = np.zeros(len(w), dtype=np.int64)
            row[w] = self.free[len(self.free) - k :][::-1]
            del self.free[len(self.free) - k :]
            slots.append(row)
        return blocks, slots

    def settle(
        self, request_id: str, block_ids: Sequence[Sequence[int]], ok: bool
    ) -> list[np.ndarray] | None:
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
        used = np.concatenate([*(m[m != 0] for m in mapped or ()), np.zeros(0, np.int64)])
        taken = np.concatenate([s[s != 0] for s in slots])
        self.free.extend(taken[~np.isin(taken, used)].tolist())
        if mapped is not None:
            self.held[request_id] = used.tolist()
        return mapped

    def ended(self, request_id: str) -> None:
        """The park lease of ``request_id`` ended: its slots are free."""
        self.free.extend(self.held.pop(request_id, ()))


def _mapped(
    final: Sequence[Sequence[int]], blocks: list[np.ndarray], slots: list[np.ndarray]
) -> list[np.ndarray] | None:
    """``final`` with each block replaced by its slot (null where vLLM's is, or where
    no slot was taken: a block D does not read); None if a block is not the one
    followed at its place, or there are more than followed."""
    if len(final) != len(blocks):
        return None
    out = []
    for fin, tab, sl in zip(final, blocks, slots, strict=True):
        got = np.asarray(fin, dtype=np.int64)
        if len(got) > len(tab):
            return None
        live = got != 0
        if np.any(got[live] != tab[: len(got)][live]):
            return None
        out.append(np.where(live, sl[: len(got)], 0))
    return out
