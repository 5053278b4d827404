"""The built-in layouts: how each places the pieces of a group's layers in regions.

nhd, hnd     per layer  one region per layer (or per stream, unpacked)
block-major  per group  [blocks][layers][...]: all layers of a block adjacent
shared-pool  the k-th layer of every group shares region k, pages of the largest block
"""

from __future__ import annotations

from kvbridge.errors import LayoutError
from kvbridge.layout.pieces import Built, Groups, place, view_of
from kvbridge.layout.registry import LayoutKind, register_layout
from kvbridge.layout.view import View


def _per_layer(groups: Groups, nblk: tuple[int, ...], packed: bool) -> Built:
    regions: list[int] = []
    views: list[View] = []
    for g, layers in enumerate(groups):
        for pieces in layers:
            if packed:
                stride = sum(p.nbytes for p in pieces)
                for p, off in place(pieces, 0):
                    views.append(view_of(p, len(regions), off, stride, nblk[g]))
                regions.append(stride * nblk[g])
            else:
                for p in pieces:
                    views.append(view_of(p, len(regions), 0, p.nbytes, nblk[g]))
                    regions.append(p.nbytes * nblk[g])
    return regions, views, list(range(len(groups)))


def _block_major(groups: Groups, nblk: tuple[int, ...], packed: bool) -> Built:
    regions: list[int] = []
    views: list[View] = []
    for g, layers in enumerate(groups):
        stride = sum(p.nbytes for pieces in layers for p in pieces)
        off = 0
        for pieces in layers:
            for p, at in place(pieces, off):
                views.append(view_of(p, len(regions), at, stride, nblk[g]))
            off += sum(p.nbytes for p in pieces)
        regions.append(max(stride, 1) * nblk[g])
    return regions, views, list(range(len(groups)))


def _shared_pool(groups: Groups, nblk: tuple[int, ...], packed: bool) -> Built:
    if len(set(nblk)) != 1:
        raise LayoutError(f"shared-pool needs one block count for all groups, got {nblk}")
    page = max(sum(p.nbytes for p in pieces) for layers in groups for pieces in layers)
    depth = max(len(layers) for layers in groups)
    views: list[View] = []
    for layers in groups:
        for k, pieces in enumerate(layers):
            for p, at in place(pieces, 0):
                views.append(view_of(p, k, at, page, nblk[0]))
    return [page * nblk[0]] * depth, views, [0] * len(groups)


register_layout(LayoutKind("nhd", _per_layer, order="nhd", split_unpacked=True))
register_layout(LayoutKind("hnd", _per_layer, order="hnd", split_unpacked=True))
register_layout(LayoutKind("block-major", _block_major))
register_layout(LayoutKind("shared-pool", _shared_pool))
