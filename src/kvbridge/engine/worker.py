"""A rank: its model slice and cache (:class:`RankEngine`), and the process that runs one.

A worker process joins the instance's gloo group on 127.0.0.1, answers commands from its
pipe, and exits on :class:`Stop`, when the pipe closes, or when its parent is gone (it
checks every ``POLL_S`` seconds). Collectives time out after ``COLLECTIVE_TIMEOUT_S``.
"""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kvbridge.engine.cache import PagedCache
from kvbridge.engine.messages import Boot, Extend, Failed, Regions, Reply, Sampled, Stop
from kvbridge.engine.model import Model, Reduce
from kvbridge.engine.ops import Shard, Step
from kvbridge.engine.spec import model_spec
from kvbridge.spec import Parallel

POLL_S = 0.5
COLLECTIVE_TIMEOUT_S = 60


class RankEngine:
    def __init__(self, boot: Boot, reduce: Reduce) -> None:
        spec = model_spec(boot.config, boot.block_size)
        par = Parallel(tp=boot.tp)
        self.cache = PagedCache(spec, par, boot.rank, boot.layout, boot.num_blocks)
        self.model = Model(boot.config, spec, Shard(boot.tp, boot.rank), reduce)

    def regions(self) -> Regions:
        return Regions(tuple(self.cache.addresses()))

    def extend(self, cmd: Extend) -> Sampled:
        tables = tuple(torch.tensor(t, dtype=torch.int64) for t in cmd.tables)
        step = Step(cmd.start, cmd.start + len(cmd.tokens), tables)
        logits = self.model.forward(torch.tensor(cmd.tokens), step, self.cache)
        return Sampled(int(logits.argmax()))


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def worker_main(conn: Connection, boot: Boot) -> None:
    """Entry point of a rank process."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{boot.port}",
        rank=boot.rank,
        world_size=boot.tp,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        try:
            engine = RankEngine(boot, all_reduce)
        except Exception as e:
            conn.send(Failed(boot.rank, f"{type(e).__name__}: {e}"))
            return
        conn.send(engine.regions())
        serve(conn, engine, boot.rank)
    finally:
        dist.destroy_process_group()


def serve(conn: Connection, engine: RankEngine, rank: int) -> None:
    parent = multiprocessing.parent_process()
    while parent is None or parent.is_alive():
        if not conn.poll(POLL_S):
            continue
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if isinstance(cmd, Stop):
            return
        reply: Reply
        try:
            reply = engine.extend(cmd)
        except Exception as e:
            reply = Failed(rank, f"{type(e).__name__}: {e}")
        conn.send(reply)
