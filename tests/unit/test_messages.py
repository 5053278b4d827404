"""A rank's layout on the wire: its bytes are those of protocol 7, and it round-trips."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.control.messages import RankInfo, rank_layout, rank_shares, wire_layout
from kvbridge.errors import PeerError
from kvbridge.layout.tensor import MemKind, regions_at
from kvbridge.layout.view import RankLayout, View
from kvbridge.transport.ipc import Share

V0 = View(0, "k", 0, 0, 256, 4, 2, ((0, 2),), (0,), (32,), (16,), (16,))
V1 = View(
    1,
    "v",
    0,
    512,
    256,
    4,
    2,
    ((0, 1), (1, 2)),
    (0, 128),
    (32, 32),
    (16, 16),
    (16, 16),
    (2, 2),
    (8, 8),
)
LAYOUT = RankLayout((1024,), (V0, V1), (4,), (2,), (0,))
SHARE = Share("shm", b"/dev/shm/x", 0, 1024, 7)

# msgpack of ``_info()`` as protocol 7 encoded it (views as arrays of 14 fields)
PROTOCOL_7 = bytes.fromhex(
    "8da472616e6b03a7726567696f6e7391cd0400a57669657773929e00a16b0000cd0100040291920002910091"
    "209110911090909e01a17600cd0200cd01000402929200019201029200cc8092202092101092101092020292"
    "0808ab626c6f636b5f73697a65739104aa6e756d5f626c6f636b739102a5706f6f6c739100a5626173657391"
    "cd1000a56167656e74c4056167656e74a8656e64706f696e74a97463703a2f2f783a31a66d656d6f7279a468"
    "6f7374a664657669636500a46e6f6465a46e6f6465a67368617265739195a373686dc40a2f6465762f73686d"
    "2f7800cd040007"
)


def _info() -> RankInfo:
    regions = regions_at([4096], LAYOUT.regions, MemKind.HOST, 0)
    info = wire_layout(3, LAYOUT, regions, b"agent", "tcp://x:1", [SHARE])
    return msgspec.structs.replace(info, node="node")


def test_a_rank_info_encodes_to_the_bytes_of_protocol_7() -> None:
    assert msgspec.msgpack.encode(_info()) == PROTOCOL_7


def test_a_layout_and_its_shares_round_trip_through_the_wire() -> None:
    info = msgspec.msgpack.decode(PROTOCOL_7, type=RankInfo)
    assert rank_layout(info) == LAYOUT
    assert rank_layout(info).views[1].seg_units == ((0, 1), (1, 2))
    assert rank_shares(info) == [SHARE]


def test_a_view_of_twelve_fields_has_no_pieces() -> None:
    raw = msgspec.msgpack.decode(PROTOCOL_7)
    raw["views"] = [v[:12] for v in raw["views"]]
    info = msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=RankInfo)
    assert [v.pieces for v in rank_layout(info).views] == [(), ()]


def test_a_malformed_view_is_refused() -> None:
    raw = msgspec.msgpack.decode(PROTOCOL_7)
    raw["views"][0][7] = [[0, 1, 2]]  # a segment of three bounds
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=RankInfo)
    raw["views"][0][7] = [[0, 99]]  # units past the region
    info = msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=RankInfo)
    with pytest.raises(PeerError, match="layout from peer rejected"):
        rank_layout(info)
