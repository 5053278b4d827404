"""An instance: ``tp · pp`` ranks sharing block tables, driven request by request.

Request lifecycle (one record per request, transitions checked):

    prefill ───────────────────────────────► RUNNING ──decode──► RUNNING
    reserve(n_cached) ──► WAITING_KV ──start_decode(first token)──┘
                           (KV for tokens [n_cached, n) arrives from P meanwhile)

``tokens`` holds the prompt and every sampled token; ``computed`` counts the tokens
whose K/V (and state) are in this instance's cache. RUNNING: ``computed == len - 1``,
the last token is fed by the next decode step.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.api import RankLayout, SideConfig
from refengine.blocks import BlockAllocator, Tables
from refengine.config import ModelConfig, preset
from refengine.errors import EngineError
from refengine.messages import Boot, Extend, KVCommand, Reply, Sampled
from refengine.ranks import LocalRanks, ProcessRanks
from refengine.spec import model_spec


class Status(enum.Enum):
    WAITING_KV = "waiting for KV"
    RUNNING = "running"


@dataclass(slots=True)
class Request:
    tokens: list[int]
    computed: int
    tables: Tables
    status: Status


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What P hands on: the first sampled token and the blocks holding the prompt's KV."""

    first_token: int
    n_tokens: int
    tables: tuple[tuple[int, ...], ...]


class Instance:
    """A model on ``tp · pp`` ranks with its own block size, layout name and pool size.

    ``processes``: one worker process per rank (TP over gloo); default: in this process
    when ``tp == pp == 1`` (its cache is then this process's memory), else processes.
    ``pp``: pipeline stages of ``tp`` ranks each (contiguous layer ranges, as kvbridge's
    ``Parallel`` splits them); ranks are numbered ``stage · tp + tp_rank``.
    ``num_blocks``: blocks per group (state groups: sequence slots); ``timeout_s``: the
    longest wait for the ranks' answer to one command; ``netns``: the network namespace
    the rank processes run in (a simulated host, :mod:`refengine.netns`).
    ``side``: all of these shape arguments as one :class:`SideConfig` (then they are
    ignored).
    """

    def __init__(
        self,
        model: str | ModelConfig,
        tp: int = 1,
        block_size: int = 16,
        layout: str = "nhd",
        num_blocks: int = 64,
        processes: bool | None = None,
        timeout_s: float = 120.0,
        pp: int = 1,
        netns: str = "",
        side: SideConfig | None = None,
    ) -> None:
        self.config = preset(model)
        self.side = side or SideConfig(tp, block_size, layout, num_blocks, pp, netns)
        self.spec = model_spec(self.config, self.side.block_size)
        self.parallel = self.side.parallel
        self._layouts = [self.side.rank_layout(self.spec, r) for r in range(self.side.world)]
        state = tuple(self.spec.is_state_group(g) for g in range(len(self.spec.groups)))
        self._blocks = BlockAllocator(self._layouts[0], state)
        self._requests: dict[str, Request] = {}
        boot = Boot(self.config, self.side)
        in_process = self.parallel.world == 1 if processes is None else not processes
        self._ranks = LocalRanks(boot) if in_process else ProcessRanks(boot, timeout_s)
        self.in_process = in_process
        for r, lay in enumerate(self._layouts):
            assert tuple(n for _, n in self.regions(r)) == lay.regions, f"rank {r} regions"

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def world(self) -> int:
        """Ranks of the instance: ``tp · pp``."""
        return self.parallel.world

    @property
    def pids(self) -> tuple[int, ...]:
        """Process id of every rank (empty when the rank runs in this process)."""
        return self._ranks.pids

    def layout(self, rank: int) -> RankLayout:
        return self._layouts[rank]

    def regions(self, rank: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of rank ``rank``'s regions (addresses in its process)."""
        return list(self._ranks.regions[rank].regions)

    def tables(self, req_id: str) -> list[list[int]]:
        """Block ids per spec group of a request (a copy)."""
        return [list(t) for t in self._request(req_id).tables]

    def tokens(self, req_id: str) -> list[int]:
        """Prompt and sampled tokens of a request (a copy)."""
        return list(self._request(req_id).tokens)

    def computed(self, req_id: str) -> int:
        """Tokens of the request whose KV is in this instance's cache."""
        return self._request(req_id).computed

    def prefill(self, req_id: str, prompt: Sequence[int]) -> Prefilled:
        """Compute the prompt's KV and sample the first token."""
        req = self._admit(req_id, prompt)
        first = self._extend(req, len(prompt))
        req.tokens.append(first)
        req.status = Status.RUNNING
        tables = tuple(tuple(t) for t in req.tables)
        return Prefilled(first, len(prompt), tables)

    def reserve(self, req_id: str, prompt: Sequence[int], n_cached: int = 0) -> list[list[int]]:
        """D side: blocks for the prompt; the first ``n_cached`` tokens are computed here
        (a stand-in for a prefix-cache hit), the rest is expected from P. → block ids."""
        if not 0 <= n_cached < len(prompt):
            raise EngineError(f"n_cached={n_cached} must be in [0, {len(prompt)})")
        req = self._admit(req_id, prompt)
        if n_cached:
            self._extend(req, n_cached)
        req.status = Status.WAITING_KV
        return self.tables(req_id)

    def start_decode(self, req_id: str, first_token: int) -> None:
        """The prompt's KV has arrived; ``first_token`` (sampled by P) is fed next."""
        req = self._request(req_id, Status.WAITING_KV)
        req.computed = len(req.tokens)
        req.tokens.append(first_token)
        req.status = Status.RUNNING

    def decode(self, req_id: str, steps: int) -> list[int]:
        """``steps`` greedy tokens after the request's last token."""
        req = self._request(req_id, Status.RUNNING)
        out = []
        for _ in range(steps):
            token = self._extend(req, len(req.tokens))
            req.tokens.append(token)
            out.append(token)
        return out

    def call_ranks(self, cmd: KVCommand) -> list[Reply]:
        """Send a connector command to every rank (see :mod:`refengine.kv_rank`);
        one reply per rank, in rank order. A failed rank raises :class:`EngineError`."""
        return self._ranks.call(cmd)

    def free(self, req_id: str) -> None:
        self._blocks.release(self._request(req_id).tables)
        del self._requests[req_id]

    def close(self) -> None:
        self._ranks.close()

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _admit(self, req_id: str, prompt: Sequence[int]) -> Request:
        if req_id in self._requests:
            raise EngineError(f"request {req_id!r} already exists")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab]
        if not prompt or bad:
            raise EngineError(f"prompt of {len(prompt)} tokens; out of vocab: {bad[:5]}")
        tables: Tables = [[] for _ in self.spec.groups]
        self._blocks.grow(tables, len(prompt))
        req = Request(list(prompt), 0, tables, Status.WAITING_KV)
        self._requests[req_id] = req
        return req

    def _extend(self, req: Request, upto: int) -> int:
        """Compute tokens ``[computed, upto)`` and return the greedy next token."""
        self._blocks.grow(req.tables, upto)
        cmd = Extend(tuple(req.tokens[req.computed : upto]), req.computed, _frozen(req.tables))
        replies = self._ranks.call(cmd)
        tokens = {r.token for r in replies if isinstance(r, Sampled)}
        if len(tokens) != 1 or len(replies) != self.world:
            raise EngineError(f"ranks disagree on the next token: {replies}")
        req.computed = upto
        return tokens.pop()

    def _request(self, req_id: str, status: Status | None = None) -> Request:
        req = self._requests.get(req_id)
        if req is None:
            raise EngineError(f"no request {req_id!r}")
        if status is not None and req.status is not status:
            raise EngineError(f"request {req_id!r} is {req.status.value}, not {status.value}")
        return req


def _frozen(tables: Tables) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t) for t in tables)
