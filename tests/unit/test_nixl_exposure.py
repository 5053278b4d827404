"""What NIXL cannot protect, fenced (issue 24, case 4): D's NIXL metadata lets whoever
holds it write into D's registered memory, and D sends it (in push mode) to the P ranks
it loads from. With per-instance identities D opens a side channel only to a P holding
the key D binds to the handle's engine id, so an instance posing as that P (a handle
naming its own endpoint) receives no frame at all, let alone D's metadata."""

from __future__ import annotations

import time

import msgspec
import zmq

from kvbridge.connector.load import Mode
from kvbridge.control.security import Keys
from tests.unit.test_connector_loopback import World
from tests.unit.test_identities import allow, new_key, outcome_of


def test_d_sends_nothing_to_an_instance_posing_as_its_p(tmp_path, capsys) -> None:
    p, d, m = (new_key(tmp_path, capsys, e) for e in ("P", "D", "M"))
    for x in (d, m):  # Mallory is a listed instance of this deployment
        allow(capsys, p, x)
        allow(capsys, x, p)
    allow(capsys, d, p)
    mallory = Keys.load(m)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = mallory.server_public, mallory.server_secret
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    w = World(mode=Mode.PUSH, p_keys=Keys.load(p), d_keys=Keys.load(d))
    try:
        handle, d_tabs = w.request("r1", 40)
        posed = msgspec.structs.replace(handle, endpoint=f"tcp://127.0.0.1:{port}")
        w.consumers[0].load(posed, d_tabs)
        out = outcome_of(w.consumers[0], timeout_s=15.0)
        assert not out.ok and "CURVE handshake failed" in (out.error or ""), out.error
        frames, end = [], time.monotonic() + 1.0
        while time.monotonic() < end:
            if sock.poll(50):
                frames.append(sock.recv_multipart())
        assert frames == []  # not even the handshake: D's metadata never left D
        w.consumers[0].load(handle, d_tabs)  # the real P's handle still loads
        assert outcome_of(w.consumers[0], timeout_s=15.0).ok
    finally:
        w.close()
        sock.close()
