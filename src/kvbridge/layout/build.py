"""``build_layout``: one rank's :class:`RankLayout` under a registered layout.

    nhd          per layer  [blocks][K|V][tokens][heads][dim]   (or K, V in separate regions)
    hnd          per layer  [blocks][heads][K|V][tokens][dim]   a head slice is contiguous
    block-major  per group  [blocks][layers][K|V][tokens][heads][dim]
    shared-pool  the k-th layer of every group shares region k, pages of the largest block

State layers use the same orders with rows in place of tokens and slots for blocks.
Layouts live in ``layout/placements.py`` and are looked up in ``layout/registry.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvbridge.errors import LayoutError
from kvbridge.layout.pieces import Groups, interleave, piece
from kvbridge.layout.registry import get_layout
from kvbridge.layout.view import RankLayout
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel


def build_layout(
    spec: ModelSpec,
    par: Parallel,
    rank: int,
    layout: str,
    num_blocks: int | Mapping[str, int],
    kv_packed: bool = True,
    inner: str = "nhd",
) -> RankLayout:
    """Layout of global ``rank`` of an instance with parallel config ``par``.

    ``num_blocks``: blocks (state: slots) per group, one int for all or by group name.
    ``kv_packed``: per-layer layouts keep a layer's streams in one region, block by block.
    ``inner``: token order inside a block for block-major / shared-pool (``nhd``/``hnd``).
    """
    kind = get_layout(layout)
    spec.check_tp(par.tp)
    stage, tp_rank = par.coords(rank)
    lo, hi = par.stage_ranges(len(spec.layers))[stage]
    order = kind.token_order(inner)
    nblk = tuple(
        num_blocks if isinstance(num_blocks, int) else num_blocks[g.name] for g in spec.groups
    )
    if min(nblk) < 1:
        raise LayoutError(f"num_blocks {nblk} must be ≥ 1 per group")
    per_group: Groups = [[] for _ in spec.groups]
    for lay in spec.layers[lo:hi]:
        if not lay.streams:
            continue
        g = spec.group_of(lay.index)
        rows_tok = spec.groups[g].block_size
        pieces = [
            piece(lay.index, s, s.rows or rows_tok, par.tp, tp_rank, order) for s in lay.streams
        ]
        if order == "hnd" and (kv_packed or not kind.split_unpacked):
            pieces = interleave(pieces)
        per_group[g].append(pieces)
    regions, views, pools = kind.place(per_group, nblk, kv_packed)
    sizes = tuple(g.block_size for g in spec.groups)
    return RankLayout(tuple(regions), tuple(views), sizes, nblk, tuple(pools))
