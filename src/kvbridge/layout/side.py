"""``SideConfig``: one instance's shape, the one record every part of kvbridge takes for it
(the reference engine's instances and servers, ``kvbridge plan``, the process harness of
the tests)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.layout.build import build_layout, get_layout
from kvbridge.layout.view import RankLayout
from kvbridge.spec.model import ModelSpec
from kvbridge.spec.parallel import Parallel


@dataclass(frozen=True, slots=True)
class SideConfig:
    """TP and PP sizes, tokens per block (every token group), the registered layout the
    ranks keep, blocks (state: slots) per group, and ``netns``: the network namespace
    the instance runs in (a simulated host; "": this one)."""

    tp: int = 1
    block_size: int = 16
    layout: str = "nhd"
    num_blocks: int = 128
    pp: int = 1
    netns: str = ""

    def __post_init__(self) -> None:
        for name in ("tp", "block_size", "num_blocks", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: expected an integer ≥ 1")
        get_layout(self.layout)  # LayoutError naming the known ones

    @property
    def parallel(self) -> Parallel:
        return Parallel(self.tp, self.pp)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def spec(self, model: ModelSpec) -> ModelSpec:
        """``model`` with this side's block size in every token group."""
        return model.with_block_sizes(self.block_size)

    def rank_layout(self, model: ModelSpec, rank: int) -> RankLayout:
        """Global ``rank``'s layout of ``model`` (block sizes set by :meth:`spec`)."""
        return build_layout(self.spec(model), self.parallel, rank, self.layout, self.num_blocks)

    def __str__(self) -> str:
        pp = f" × PP {self.pp}" if self.pp > 1 else ""
        return f"TP {self.tp}{pp}, block {self.block_size}, {self.layout}"
