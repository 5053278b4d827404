"""The side channel over CURVE: a recorded session is unreadable and cannot be replayed;
keys off the allow-list get no session; explicit per-deployment keys work."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from kvbridge.control.channel import Client, Server
from kvbridge.control.messages import ErrorReply, Handshake, LeaseOp, LeaseReply, Message
from kvbridge.control.security import Keys
from kvbridge.errors import PeerError

SECRET = b"security-test"


class Relay:
    """A TCP relay between one client and a server that records what the client sent
    (an eavesdropper on the link)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        self.received = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        up = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(conn, up, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(up, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        while data := src.recv(65536):
            (self.sent if record else self.received).extend(data)
            dst.sendall(data)


def serve(calls: list[Message], keys: Keys | None = None) -> Server:
    def handler(msg: Message) -> Message:
        calls.append(msg)
        if isinstance(msg, Handshake):  # stands for P's reply with its NIXL metadata
            return ErrorReply("Metadata", "nixl-agent-blob-5e7d")
        return LeaseReply("held", 1.0)

    return Server(handler, SECRET, keys=keys)


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_a_recorded_session_is_unreadable_and_replays_are_refused():
    calls: list[Message] = []
    server = serve(calls)
    relay = Relay(port_of(server.endpoint))
    client = Client(relay.endpoint, SECRET, timeout_s=3)
    try:
        op = LeaseOp("begin", "request-7f3a", "lease-91c2", "digest", "D", 0, 1)
        assert isinstance(client.call(op), LeaseReply)
        assert len(calls) == 1
        time.sleep(0.2)
        recorded = bytes(relay.sent)
        assert len(recorded) > 100
        for plain in (b"request-7f3a", b"lease-91c2", b"begin", b"digest"):
            assert plain not in recorded  # encrypted on the wire
        for _ in range(3):  # replay the client's bytes on fresh connections
            with socket.create_connection(("127.0.0.1", port_of(server.endpoint))) as s:
                s.sendall(recorded)
                time.sleep(0.3)
        assert len(calls) == 1, calls  # nothing replayed was accepted
        assert isinstance(client.call(op), LeaseReply) and len(calls) == 2
        with pytest.raises(PeerError, match="nixl-agent-blob-5e7d"):
            client.call(Handshake(4, "D"))
        time.sleep(0.2)
        assert b"nixl-agent-blob-5e7d" not in bytes(relay.received)  # replies too
    finally:
        client.close()
        server.close()


def test_keys_off_the_allow_list_get_no_session():
    pub, sec = zmq.curve_keypair()
    base = Keys.from_secret(SECRET)
    calls: list[Message] = []
    server = serve(calls)
    try:
        stranger = Keys(base.server_public, b"", pub, sec, frozenset())
        client = Client(server.endpoint, SECRET, timeout_s=10, keys=stranger)
        t0 = time.monotonic()
        with pytest.raises(PeerError, match=r"CURVE handshake failed.*AUTH"):
            client.call(LeaseOp("renew", "r", "l", "d", "D", 0, 1))
        assert time.monotonic() - t0 < 2.0
        client.close()
        assert calls == []
    finally:
        server.close()


def test_explicit_keys_with_an_allow_list():
    spub, ssec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    keys = Keys(spub, ssec, cpub, csec, frozenset({cpub}))
    calls: list[Message] = []
    server = serve(calls, keys)
    try:
        client = Client(server.endpoint, SECRET, timeout_s=2, keys=keys)
        assert isinstance(client.call(LeaseOp("renew", "r", "l", "d", "D", 0, 1)), LeaseReply)
        client.close()
        derived = Client(server.endpoint, SECRET, timeout_s=1)  # the secret alone is not enough
        with pytest.raises(PeerError, match="CURVE handshake failed"):
            derived.call(LeaseOp("renew", "r", "l", "d", "D", 0, 1))
        derived.close()
        assert len(calls) == 1
    finally:
        server.close()
