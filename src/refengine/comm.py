"""What a rank exchanges with the other ranks of its instance during one forward.

Global rank ``r = stage·tp + tp_rank`` (kvbridge's ``Parallel`` numbering):

    stage 0   ranks 0 … tp-1        embed → its layers ──send hidden──┐
    stage 1   ranks tp … 2tp-1      ┌─recv hidden (from r - tp)◄──────┘
              …                     its layers → (last stage) logits → sampled token
    all ranks                       ◄── broadcast of the token from rank (pp-1)·tp

Row-parallel partial sums are all-reduced within the stage's TP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvbridge.api import Parallel
from refengine.errors import EngineError


class Comm:
    """A rank's peers; this base is the only rank of its instance (TP 1, PP 1)."""

    first = last = True

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def receive(self, rows: int, width: int) -> torch.Tensor:
        raise EngineError("a single rank has no previous stage")

    def send(self, x: torch.Tensor) -> None:
        raise EngineError("a single rank has no next stage")

    def share_token(self, token: int) -> int:
        return token


class GlooComm(Comm):
    """A rank of a gloo process group of ``par.world`` ranks (already initialised)."""

    def __init__(self, par: Parallel, rank: int) -> None:
        stage, _ = par.coords(rank)
        tp, pp = par.tp, par.pp
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        self.group = groups[stage] if pp > 1 else None  # PP 1: the default (world) group
        self.rank, self.tp, self.pp = rank, tp, pp
        self.first, self.last = stage == 0, stage == pp - 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def receive(self, rows: int, width: int) -> torch.Tensor:
        """Hidden states ``[rows, width]`` float64 from this TP rank of the stage before."""
        x = torch.empty(rows, width, dtype=torch.float64)
        dist.recv(x, src=self.rank - self.tp)
        return x

    def send(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.rank + self.tp)

    def share_token(self, token: int) -> int:
        """The last stage's sampled token, on every rank (``token`` is ignored elsewhere)."""
        if self.pp == 1:
            return token
        t = torch.tensor([token], dtype=torch.int64)
        dist.broadcast(t, src=(self.pp - 1) * self.tp)
        return int(t.item())
