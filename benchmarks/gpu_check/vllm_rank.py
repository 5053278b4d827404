"""A rank's side of the vLLM-like path: one raw agent at a time (one UCX thread count),
its prepared lists per peer rank, and the timed READ (D) or WRITE (P) of a request."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.gpu_check import messages as m
from benchmarks.gpu_check.rank import RankState
from benchmarks.gpu_check.vllm_agent import RawAgent
from benchmarks.gpu_check.vllm_like import GroupRuns, indices, list_rows, pair_runs

TIMEOUT_S = 120.0


@dataclass
class VllmSide:
    """``lists[peer] = (this rank's list, the peer's list)``; ``runs[peer]``: the pair's
    descriptor runs (peer: a P rank on D, a D rank on P)."""

    agent: RawAgent
    threads: int
    lists: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    runs: dict[int, list[GroupRuns]] = field(default_factory=dict)

    def close(self) -> None:
        self.agent.close()


def open_agent(st: RankState, cmd: m.VllmOpen) -> bytes:
    """A fresh agent of ``cmd.threads`` UCX threads over this rank's regions; its metadata."""
    close(st)
    name = f"vllm-{st.role}{st.rank}-t{cmd.threads}-{os.getpid()}-{time.monotonic_ns()}"
    agent = RawAgent(name, cmd.threads, st.pools.region_list())
    st.vllm = VllmSide(agent, cmd.threads)
    return agent.metadata()


def connect(st: RankState, cmd: m.VllmConnect) -> None:
    """Add the peers this rank moves bytes with; prepare both lists of every pair."""
    side: VllmSide = st.vllm
    p_b, d_b = st.bounds
    pairs: dict[int, list[GroupRuns]] = {}
    if st.role == "D":
        pairs = pair_runs(st.specs, st.pars, p_b, d_b[st.rank], st.rank)
    else:
        for d in range(len(d_b)):
            mine = pair_runs(st.specs, st.pars, p_b, d_b[d], d).get(st.rank)
            if mine is not None:
                pairs[d] = mine
    me, peer_side = ("D", "P") if st.role == "D" else ("P", "D")
    metas = cmd.p if st.role == "D" else cmd.d
    for peer, groups in pairs.items():
        name = side.agent.add_peer(metas[peer])
        local = side.agent.prep("", list_rows(groups, me, 0))
        remote = side.agent.prep(name, list_rows(groups, peer_side, 0))
        side.lists[peer], side.runs[peer] = (local, remote), groups


def run(st: RankState, cmd: m.Run) -> m.Timing:
    """D: READ every source's descriptors; P: WRITE its descriptors to every D rank."""
    side: VllmSide = st.vllm
    req = cmd.request
    t0 = time.monotonic()
    posts = []
    for peer, groups in side.runs.items():
        p_idx, d_idx, nbytes = indices(groups, req.p_tables, req.d_tables, req.tokens)
        local, remote = side.lists[peer]
        if st.role == "D":
            posts.append(("READ", local, d_idx, remote, p_idx, nbytes))
        else:
            posts.append(("WRITE", local, p_idx, remote, d_idx, nbytes))
    host = time.monotonic() - t0
    handles = [side.agent.post(*p[:5]) for p in posts]
    side.agent.wait(handles, TIMEOUT_S)
    descs = sum(p[2].shape[0] for p in posts)
    nbytes = sum(p[5] for p in posts)
    detail: dict[str, object] = {"threads": side.threads, "op": posts[0][0] if posts else ""}
    return m.Timing(t0, time.monotonic(), nbytes, descs, 0.0, host, detail)


def close(st: RankState, _: m.VllmClose | None = None) -> None:
    if st.vllm is not None:
        st.vllm.close()
        st.vllm = None
