"""A rank: its model slice and cache (:class:`RankEngine`), and the process that runs one.

A worker process joins the instance's gloo group on 127.0.0.1, answers commands from its
pipe (``refengine.processes.serve``), and exits on :class:`Stop`, when the pipe closes, or
when its parent is gone. Collectives time out after ``COLLECTIVE_TIMEOUT_S``.
"""

from __future__ import annotations

from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from refengine.cache import PagedCache
from refengine.comm import Comm, GlooComm
from refengine.kv_rank import RankKV
from refengine.messages import (
    Boot,
    Command,
    Extend,
    Failed,
    Regions,
    Reply,
    Sampled,
    Stop,
)
from refengine.model import Model
from refengine.ops import Shard, Step
from refengine.processes import serve
from refengine.spec import model_spec

COLLECTIVE_TIMEOUT_S = 60


class RankEngine:
    """Global rank ``boot.rank`` of an instance: its stage's layers, its TP slice of them,
    their cache; ``comm`` reaches the other ranks."""

    def __init__(self, boot: Boot, comm: Comm) -> None:
        spec = model_spec(boot.config, boot.side.block_size)
        par = boot.side.parallel
        stage, tp_rank = par.coords(boot.rank)
        layers = range(*par.stage_ranges(len(spec.layers))[stage])
        self.comm = comm
        self.cache = PagedCache(spec, par, boot.rank, boot.side.layout, boot.side.num_blocks)
        self.model = Model(boot.config, spec, Shard(boot.side.tp, tp_rank), comm.all_reduce, layers)
        bases = [a for a, _ in self.cache.addresses()]
        self.kv = RankKV(spec, par, boot.rank, self.cache.layout, bases)

    def regions(self) -> Regions:
        return Regions(tuple(self.cache.addresses()))

    def handle(self, cmd: Command) -> Reply:
        if isinstance(cmd, Extend):
            return self.extend(cmd)
        assert not isinstance(cmd, Stop), "Stop is handled by the serving loop"
        return self.kv.handle(cmd)

    def close(self) -> None:
        self.kv.close()

    def extend(self, cmd: Extend) -> Sampled:
        tables = tuple(torch.tensor(t, dtype=torch.int64) for t in cmd.tables)
        step = Step(cmd.start, cmd.start + len(cmd.tokens), tables)
        if self.comm.first:
            x = self.model.embed(torch.tensor(cmd.tokens))
        else:
            x = self.comm.receive(len(cmd.tokens), self.model.embedding.shape[1])
        x = self.model.forward(x, step, self.cache)
        if not self.comm.last:
            self.comm.send(x)
            return Sampled(self.comm.share_token(-1))
        return Sampled(self.comm.share_token(int(self.model.logits(x).argmax())))


def worker_main(conn: Connection, boot: Boot) -> None:
    """Entry point of a rank process."""
    if boot.side.netns:
        from refengine.netns import enter

        enter(boot.side.netns)  # before NIXL loads (it lists interfaces from /sys)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{boot.port}",
        rank=boot.rank,
        world_size=boot.side.world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        try:
            engine = RankEngine(boot, GlooComm(boot.side.parallel, boot.rank))
        except Exception as e:
            conn.send(Failed(boot.rank, f"{type(e).__name__}: {e}"))
            return
        conn.send(engine.regions())
        try:
            serve(conn, engine.handle, boot.rank)
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()
