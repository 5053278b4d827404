"""What crosses vLLM's process boundaries for the connector (vLLM pickles these)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvbridge.adapter import LoadJob
from kvbridge.api import PeerError, RankInfo
from kvbridge.integrations.vllm.park import Order


@dataclass
class StepMeta(KVConnectorMetadata):
    """Scheduler → workers, once per step: loads to start, P requests freed, handles
    whose blocks D does not need (its own cache holds the whole prompt) to release at P,
    and lease ops P refused."""

    loads: list[LoadJob] = field(default_factory=list)
    freed: list[tuple[str, str]] = field(default_factory=list)
    """``(P request id, how its lease ended: done, expired or aborted)``"""
    releases: list[str] = field(default_factory=list)
    save: bool = True
    """P: a request of this step leaves with a handle once it ends (prefill for remote
    decode): the workers wait for the step's KV writes in ``wait_for_save``, and only
    then."""
    refused: dict[str, int] = field(default_factory=dict)
    """P: lease ops refused since the previous step, by cause (``LeaseTable.refused``)."""
    events: dict[str, int] = field(default_factory=dict)
    """P: counts since the previous step (the park's requests and lease ends), for the
    metrics (rank 0 reports them)."""
    parks: list[Order] = field(default_factory=list)
    """P: each request's vLLM blocks and park slots per group, to copy once the step's KV
    writes are queued (:mod:`~kvbridge.integrations.vllm.park`)."""


@dataclass
class RankMeta(KVConnectorHandshakeMetadata):
    """Worker → scheduler, once: a P rank's layout, addresses and transport metadata."""

    info: bytes = b""
    park: bytes = b""
    """The rank's park as a rank of P's park instance (empty: no park)."""


def encode_info(info: RankInfo) -> bytes:
    return msgspec.msgpack.encode(info)


def decode_info(data: bytes) -> RankInfo:
    try:
        return msgspec.msgpack.decode(data, type=RankInfo)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise PeerError(f"malformed rank info from a worker: {e}") from None
