"""Typed messages between an instance (parent) and its rank workers, over pipes.

    parent → rank   Extend | Stop | ServeKV | ConsumeKV | LoadKV | AwaitKV
    rank → parent   Regions (once, after boot) | Sampled | Failed | KVInfo | Ack | Loaded

The ``*KV`` commands run kvbridge's connector next to the rank's cache (see
:mod:`refengine.kv_rank`): a P rank serves its blocks, a D rank loads into its own.

Ranks keep no request state: every :class:`Extend` carries the positions and the block
tables, so the parent's :class:`~refengine.instance.Instance` is the one owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.adapter import LoadJob
from kvbridge.api import Mode, Outcome, Policy, RankInfo, SideConfig
from refengine.config import ModelConfig
from refengine.processes import Failed, Stop


@dataclass(frozen=True, slots=True)
class Boot:
    """Everything a rank needs to build its model slice and its cache."""

    config: ModelConfig
    side: SideConfig
    """The instance's shape; ``rank`` is global (``stage · tp + tp_rank``)."""
    rank: int = 0
    port: int = 0
    """TCP port of the gloo rendezvous on 127.0.0.1 (unused at TP 1 in process)."""


@dataclass(frozen=True, slots=True)
class Extend:
    """Run ``tokens`` at positions ``[start, start + len(tokens))``; reply :class:`Sampled`.

    ``tables[g]``: block ids of group ``g`` covering at least ``start + len(tokens)``
    tokens (a state group: its one slot).
    """

    tokens: tuple[int, ...]
    start: int
    tables: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class ServeKV:
    """P rank: register the cache with a NIXL agent and serve it; reply :class:`KVInfo`."""

    engine_id: str
    secret: bytes
    host: str = "127.0.0.1"
    """Address the rank's push channel binds; ``advertise``: the one D connects to."""
    advertise: str = ""
    transport: str = "nixl"
    """A registered transport (``kvbridge.transport``)."""


@dataclass(frozen=True, slots=True)
class ConsumeKV:
    """D rank: start a connector consumer over the cache; reply :class:`Ack`.

    ``timeout_s``: the longest one transfer may take (seconds); ``policy``: what the
    engine should do with a request whose transfer failed.
    """

    engine_id: str
    secret: bytes
    mode: Mode
    timeout_s: float
    policy: Policy
    transport: str = "nixl"


@dataclass(frozen=True, slots=True)
class PrepareKV:
    """D rank: connect the consumer to the P instance ``engine_id`` at ``endpoint`` before
    its first request (:meth:`kvbridge.api.Consumer.prepare`), waiting up to
    ``timeout_s``; reply :class:`Prepared` (a failure there is not the rank's)."""

    endpoint: str
    engine_id: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class LoadKV:
    """D rank: load ``job``'s handle into its tables (block ids per group) after the
    ``cached`` tokens D already has; reply :class:`Ack`."""

    job: LoadJob


@dataclass(frozen=True, slots=True)
class AwaitKV:
    """D rank: wait up to ``timeout_s`` seconds for the outcome of a load; reply
    :class:`Loaded` (a failed outcome if none came in time)."""

    request_id: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Regions:
    """``(address, nbytes)`` of each cache region of the rank, in layout order."""

    regions: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Sampled:
    """The greedy next token after the last position of an :class:`Extend`."""

    token: int


@dataclass(frozen=True, slots=True)
class KVInfo:
    """A P rank's layout, region addresses and agent metadata, for the P coordinator."""

    info: RankInfo


@dataclass(frozen=True, slots=True)
class Ack:
    pass


@dataclass(frozen=True, slots=True)
class Prepared:
    """What :class:`PrepareKV` did: ``error`` "" if it prepared, else why not (the first
    request then connects itself)."""

    error: str = ""


@dataclass(frozen=True, slots=True)
class Loaded:
    outcome: Outcome


KVCommand = ServeKV | ConsumeKV | PrepareKV | LoadKV | AwaitKV
Command = Extend | Stop | KVCommand
Reply = Regions | Sampled | Failed | KVInfo | Ack | Loaded | Prepared
