"""One rank's paged cache, allocated from a kvbridge layout and read in place.

Each region of the :class:`RankLayout` is one uint8 tensor (its ``data_ptr()`` is what a
transport registers). Every (layer, stream, segment) gets a float64 view onto it made
with ``as_strided`` from the kvbridge :class:`View` strides (bytes / 8):

    segment tensor [blocks, rows, local units, unit elements]
    element (b, r, u, e) at byte  offset + seg_offset + b·block_stride + r·row_stride
                                  + u·unit_stride + 8·e            (within its region)

Rows are tokens of a block (attention, MLA) or state rows of a slot (conv, recurrent).
So the model reads and writes kvbridge's bytes directly, whatever the layout name.
"""

from __future__ import annotations

import torch

from kvbridge.api import ModelSpec, Parallel, RankLayout, View, build_layout

ITEM = 8  # bytes per float64


class PagedCache:
    def __init__(
        self, spec: ModelSpec, par: Parallel, rank: int, layout: str, num_blocks: int
    ) -> None:
        self.layout: RankLayout = build_layout(spec, par, rank, layout, num_blocks)
        self.regions = [torch.zeros(n, dtype=torch.uint8) for n in self.layout.regions]
        words = [r.view(torch.float64) for r in self.regions]
        self._segments = {
            (v.layer, v.stream): tuple(
                _segment(words[v.region], v, s) for s in range(len(v.seg_units))
            )
            for v in self.layout.views
        }

    def segments(self, layer: int, stream: str) -> tuple[torch.Tensor, ...]:
        """Float64 tensors ``[blocks, rows, local units, unit elements]``, one per segment."""
        return self._segments[(layer, stream)]

    def stream(self, layer: int, stream: str) -> torch.Tensor:
        """The single segment of a one-segment stream (K, V, latent, recurrent state)."""
        (seg,) = self._segments[(layer, stream)]
        return seg

    def addresses(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every region, in layout order."""
        return [(r.data_ptr(), r.numel()) for r in self.regions]


def _segment(words: torch.Tensor, v: View, s: int) -> torch.Tensor:
    a, b = v.seg_units[s]
    nums = (v.offset, v.block_stride, v.seg_offsets[s], v.row_strides[s], v.unit_strides[s])
    assert all(x % ITEM == 0 for x in (*nums, v.unit_bytes[s])), f"{v} is not float64-aligned"
    size = (v.blocks, v.rows, b - a, v.unit_bytes[s] // ITEM)
    stride = (v.block_stride // ITEM, v.row_strides[s] // ITEM, v.unit_strides[s] // ITEM, 1)
    return words.as_strided(size, stride, (v.offset + v.seg_offsets[s]) // ITEM)
