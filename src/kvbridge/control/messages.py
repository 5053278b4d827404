"""Typed, versioned wire messages of the side channel.

Every frame is ``HMAC-SHA256(secret, body) ‖ body`` with ``body`` a msgpack-encoded
:data:`Message`. The tag is checked before the body is decoded; frames larger than
:data:`MAX_FRAME` are refused unread.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_type_hints

import msgspec

from kvbridge.errors import LayoutError, PeerError
from kvbridge.layout.tensor import MemKind, Region, regions_at
from kvbridge.layout.view import RankLayout, View
from kvbridge.transport.ipc import Share, node_id

PROTOCOL_VERSION = 7
MAX_FRAME = 8 << 20
TAG_BYTES = 32


def _wire_form(record: type, name: str) -> type[msgspec.Struct]:
    """An array-like struct of the dataclass ``record``'s fields, types and (plain)
    defaults, in order: a record on the wire is a msgpack array of its fields."""
    hints = get_type_hints(record)
    return msgspec.defstruct(
        name,
        [
            (f.name, hints[f.name], *(() if f.default is MISSING else (f.default,)))
            for f in fields(record)
        ],
        array_like=True,
        frozen=True,
        module=__name__,
    )


def _to_wire(wire: type[msgspec.Struct], record: Any) -> Any:
    return wire(*(getattr(record, name) for name in wire.__struct_fields__))


if TYPE_CHECKING:  # a struct made at run time is no type to mypy
    WireView: TypeAlias = msgspec.Struct
    WireShare: TypeAlias = msgspec.Struct
else:
    WireView = _wire_form(View, "WireView")
    WireShare = _wire_form(Share, "WireShare")


class RankInfo(msgspec.Struct, frozen=True):
    """One P (or, for push, D) rank: its layout, region addresses, transport metadata."""

    rank: int
    regions: list[int]
    views: list[WireView]
    block_sizes: list[int]
    num_blocks: list[int]
    pools: list[int]
    bases: list[int]
    agent: bytes
    endpoint: str = ""  # this rank's own side channel (push requests), if any
    memory: str = MemKind.HOST.value  # where its regions live (a MemKind value)
    device: int = 0  # the GPU (CUDA ordinal) holding them, for device memory
    node: str = ""  # its node (boot id): a D on the same node may map ``shares``
    shares: list[WireShare] = msgspec.field(default_factory=list)  # per region, or none

    def memory_kind(self) -> MemKind:
        """:attr:`memory` checked; :class:`PeerError` for a kind this side does not know."""
        try:
            kind = MemKind(self.memory)
        except ValueError:
            raise PeerError(f"rank {self.rank}: unknown memory kind {self.memory!r}") from None
        if self.device < 0:
            raise PeerError(f"rank {self.rank}: device {self.device}")
        return kind


class Handshake(msgspec.Struct, tag="handshake", frozen=True):
    version: int
    d_engine: str


class HandshakeReply(msgspec.Struct, tag="handshake_reply", frozen=True):
    version: int
    engine_id: str
    epoch: str  # changes whenever the P instance restarts (new memory, new agents)
    compat_hash: str
    model_id: str  # what P serves; D refuses a P whose id differs from its own
    tp: int
    pp: int
    stages: list[tuple[int, int]]
    ranks: list[RankInfo]
    companions: list[tuple[str, str]] = msgspec.field(default_factory=list)
    """P instances of this P's own (``<engine id>.<name>``, endpoint), as its park, that
    a D preparing this P prepares too (an older P sends none)."""


LeaseOpName = Literal["begin", "renew", "confirm", "fail"]


class LeaseOp(msgspec.Struct, tag="lease", frozen=True):
    """D → P about one request. ``begin`` checks the handle's tables against P's and
    binds the lease to (``d_engine``, ``d_epoch``, ``d_rank``); ``confirm``, ``fail`` and
    ``renew`` of a rank that began carry the ``token`` its ``begin`` reply gave
    (:mod:`kvbridge.control.lease`)."""

    op: LeaseOpName
    request_id: str
    lease_id: str
    tables_digest: str
    d_engine: str
    d_rank: int
    d_world: int
    d_epoch: str = ""  # changes whenever the D rank restarts
    token: str = ""  # the token of this rank's ``begin`` reply ("" before it began)


class LeaseReply(msgspec.Struct, tag="lease_reply", frozen=True):
    """P's answer to a :class:`LeaseOp`; ``refused`` and ``foreign`` change nothing
    (``docs/faults.md``)."""

    state: Literal["held", "expired", "mismatch", "refused", "foreign"]
    remaining_s: float = 0.0  # seconds the lease has left (0 unless held): P's clock stays on P
    token: str = ""  # ``begin`` answered ``held``: the token this rank's later ops carry
    reason: str = ""  # refused or foreign: why (a kvbridge.control.lease.REFUSALS key)


class PushRuns(msgspec.Struct, tag="push", frozen=True):
    """D → P rank: write these runs into D and notify ``notif`` once they landed.

    ``src``, ``dst``, ``nbytes``: little-endian uint64 arrays as bytes.
    ``staged``: the destinations are contiguous spans of D's staging slot (a staged
    push): the rank may gather its sources into a registered staging area of its own
    and write a few long spans (:mod:`kvbridge.connector.movers.push_gather`).
    """

    request_id: str
    d_agent: bytes
    src: bytes
    dst: bytes
    nbytes: bytes
    notif: bytes
    staged: bool = False
    token: str = ""  # the lease token of the D rank's ``begin`` reply
    d_epoch: str = ""
    nonce: str = ""  # issued by D for this load; refused once retired (after ``last``)
    part: int = 0  # which message of the load this is (a staged push sends one per round)
    last: bool = True  # the load's last message to this rank: its nonce is then retired
    d_engine: str = ""  # the D instance (bound to its key with per-instance identities)


class PushReply(msgspec.Struct, tag="push_reply", frozen=True):
    runs: int  # descriptors posted (fewer than the runs asked for if it gathered them)


class PushRefused(msgspec.Struct, tag="push_refused", frozen=True):
    """A P rank's answer to a push it did not write (nothing was posted)."""

    request_id: str
    reason: str  # no nonce, retired nonce, unknown nonce or replayed


class PushFence(msgspec.Struct, tag="push_fence", frozen=True):
    """D → P rank after a failed push: are your writes for ``request_id`` over? From
    then on the rank refuses any push of that request from ``d_engine``."""

    request_id: str
    d_engine: str = ""  # the D instance asking (bound to its key, as in PushRuns)


class FenceReply(msgspec.Struct, tag="fence_reply", frozen=True):
    request_id: str
    ended: bool  # no write of the request is running on this rank (none can land)


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    kind: str
    message: str


Message = (
    Handshake
    | HandshakeReply
    | LeaseOp
    | LeaseReply
    | PushRuns
    | PushReply
    | PushRefused
    | PushFence
    | FenceReply
    | ErrorReply
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def seal(msg: Message, secret: bytes) -> bytes:
    body = _encoder.encode(msg)
    return hmac.new(secret, body, hashlib.sha256).digest() + body


def unseal(frame: bytes, secret: bytes) -> Message:
    """Check size and tag, then decode; :class:`PeerError` for anything wrong."""
    if len(frame) > MAX_FRAME:
        raise PeerError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME}-byte limit")
    if len(frame) <= TAG_BYTES:
        raise PeerError(f"frame of {len(frame)} bytes is too short to carry a tag")
    tag, body = frame[:TAG_BYTES], frame[TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(secret, body, hashlib.sha256).digest()):
        raise PeerError("frame authentication failed (wrong secret or altered message)")
    try:
        msg: Message = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise PeerError(f"malformed message: {e}") from None
    except RecursionError:  # msgspec skips an unknown field's value by recursing into it
        raise PeerError("malformed message: nested too deeply") from None
    return msg


def tables_digest(tables: list[list[int]], n_tokens: int) -> str:
    text = f"{n_tokens}:" + ";".join(",".join(map(str, t)) for t in tables)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def wire_layout(
    rank: int,
    layout: RankLayout,
    regions: list[Region],
    agent: bytes,
    endpoint: str = "",
    shares: list[Share] | None = None,
) -> RankInfo:
    """What a rank tells peers of ``layout``, held in ``regions`` (one memory kind), and
    how a process of its node maps them (``shares``, one per region, or none)."""
    return RankInfo(
        rank,
        list(layout.regions),
        [_to_wire(WireView, v) for v in layout.views],
        list(layout.block_sizes),
        list(layout.num_blocks),
        list(layout.pools),
        [r.addr for r in regions],
        agent,
        endpoint,
        regions[0].kind.value if regions else MemKind.HOST.value,
        regions[0].device if regions else 0,
        node_id() if shares else "",
        [_to_wire(WireShare, s) for s in shares or []],
    )


def rank_shares(info: RankInfo) -> list[Share]:
    """The peer rank's shares, one per region and as large (empty if it shares none)."""
    shares = [Share(*msgspec.structs.astuple(w)) for w in info.shares]
    sizes = [s.nbytes for s in shares]
    if shares and sizes != list(info.regions):
        raise PeerError(f"rank {info.rank}: shares of {sizes} B for regions of {info.regions} B")
    return shares


def rank_regions(info: RankInfo, layout: RankLayout) -> list[Region]:
    """The regions a peer's rank described, with their memory kind (checked)."""
    return regions_at(info.bases, layout.regions, info.memory_kind(), info.device)


def rank_layout(info: RankInfo) -> RankLayout:
    """Rebuild a :class:`RankLayout` from the wire; its checks reject views outside regions."""
    if len(info.bases) != len(info.regions):
        raise PeerError(
            f"rank {info.rank}: {len(info.bases)} bases for {len(info.regions)} regions"
        )
    try:
        return RankLayout(
            tuple(info.regions),
            tuple(View(*msgspec.structs.astuple(w)) for w in info.views),
            tuple(info.block_sizes),
            tuple(info.num_blocks),
            tuple(info.pools),
        )
    except (LayoutError, ValueError, TypeError, IndexError) as e:
        raise PeerError(f"rank {info.rank}: layout from peer rejected: {e}") from None
