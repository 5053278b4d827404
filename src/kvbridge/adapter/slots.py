"""The state-slot choice: a state group (Mamba, linear attention) keeps one running
state per request, in one block of the request's table for that group."""

from __future__ import annotations

from collections.abc import Mapping

from kvbridge.api import Tables


def state_tables(
    tables: Tables, state_blocks: Mapping[int, int], mode: str, n_computed: int
) -> Tables:
    """``tables`` with each state group ``g`` (``state_blocks[g]``: its block size in
    tokens) cut to its one state slot: the block holding the running state after
    ``n_computed`` tokens, block 0 in ``mode`` ``"none"`` and block ``(n-1) // size``
    in ``"align"`` (earlier entries: null or checkpoints). A group whose slot is missing
    (a null block, a short table) gets an empty table, which the plan refuses: that
    request fails alone. Checked tables stay checked (a slice of their ids)."""
    if not state_blocks:
        return tables
    ids = list(tables.ids)
    for g, bs in state_blocks.items():
        i = 0 if mode == "none" else max(n_computed - 1, 0) // bs
        tab = ids[g]
        ids[g] = tab[i : i + 1] if i < len(tab) and tab[i] != 0 else tab[:0]
    return Tables(tuple(ids), tables.limits, tables.seal)
