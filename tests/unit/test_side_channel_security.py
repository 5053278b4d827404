"""The side channel over CURVE: a recorded session is unreadable and cannot be replayed;
keys off the allow-list get no session; explicit per-deployment keys work."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from kvbridge.connector.consumer import Consumer
from kvbridge.control.channel import Client, Server
from kvbridge.control.messages import (
    ErrorReply,
    Handshake,
    LeaseOp,
    LeaseReply,
    Message,
    unseal,
)
from kvbridge.control.security import Keys, secure_client
from kvbridge.errors import ConfigError, PeerError
from kvbridge.transport.loopback import LoopbackTransport
from tests.unit.test_connector_loopback import SECRET as SPEC_SECRET
from tests.unit.test_connector_loopback import World, check_bytes

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


def deployment_keys(tmp_path, clients: int) -> tuple[Path, list[Path]]:
    """A P keys file allowing ``clients`` D key pairs, and one file per D."""
    spub, ssec = zmq.curve_keypair()
    pairs = [zmq.curve_keypair() for _ in range(clients)]
    p_file = tmp_path / "p.json"
    p_file.write_text(
        json.dumps(
            {"server_public": spub.decode(), "server_secret": ssec.decode(),
             "allowed": [pub.decode() for pub, _ in pairs]}
        )
    )  # fmt: skip
    d_files = []
    for i, (pub, sec) in enumerate(pairs):
        f = tmp_path / f"d{i}.json"
        f.write_text(
            json.dumps(
                {"server_public": spub.decode(), "client_public": pub.decode(),
                 "client_secret": sec.decode()}
            )
        )  # fmt: skip
        d_files.append(f)
    return p_file, d_files


def test_connector_with_per_instance_keys_and_an_allow_list(tmp_path):
    """P allows one D's public key: that D loads byte-exact; a D with the right secret
    but keys P does not list is refused at the handshake, typed."""
    p_file, (d_file,) = deployment_keys(tmp_path, 1)
    w = World(p_keys=Keys.load(p_file), d_keys=Keys.load(d_file))
    try:
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("k", 40)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok, out.error
        check_bytes(w, before, 40, 0, d_tabs)
        outsider = Consumer(
            "D-out", w.d.spec, w.d.par, 0, w.d.layouts[0], list(w.d.bound(0).bases),
            LoopbackTransport("d-out", w.fabric), SPEC_SECRET,
        )  # fmt: skip
        try:
            handle, d_tabs = w.request("k2", 40)
            outsider.load(handle, d_tabs)
            end, got = time.monotonic() + 5, []
            while not got and time.monotonic() < end:
                got = outsider.poll()
                time.sleep(0.01)
            assert len(got) == 1 and not got[0].ok
            assert "CURVE handshake failed" in got[0].error, got[0].error
        finally:
            outsider.close()
    finally:
        w.close()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("[]", "JSON object"),
        ('{"server_public": "short"}', "40 characters"),
        ('{"client_public": "' + "x" * 40 + '"}', "server_public is required"),
        ('{"server_public": "' + "~" * 40 + '"}', "Z85"),
        ('{"serverpublic": 1}', "unknown keys"),
        ("{", "CURVE keys file"),
    ],
)
def test_bad_keys_files_are_refused_naming_the_problem(tmp_path, body, why):
    f = tmp_path / "k.json"
    f.write_text(body)
    with pytest.raises(ConfigError, match=why):
        Keys.load(f)


def nested_frame(depth: int) -> bytes:
    """A correctly sealed frame whose unknown field nests ``depth`` msgpack arrays."""
    body = b"\x82\xa4type\xa5lease\xa3zzz" + b"\x91" * depth + b"\xc0"
    return hmac.new(SECRET, body, hashlib.sha256).digest() + body


def test_a_deeply_nested_frame_is_refused_as_malformed(caplog):
    """100,000 nested arrays, sealed with the secret: a typed PeerError, no RecursionError
    (the server answers ``malformed`` and logs no handler bug)."""
    frame = nested_frame(100_000)
    with pytest.raises(PeerError, match="malformed message: nested too deeply"):
        unseal(frame, SECRET)
    calls: list[Message] = []
    server = serve(calls)
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        secure_client(sock, Keys.from_secret(SECRET))
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        with caplog.at_level(logging.ERROR, logger="kvbridge.control.channel"):
            sock.send(frame)
            reply = unseal(sock.recv(), SECRET)
        assert reply == ErrorReply("PeerError", "malformed message: nested too deeply")
        assert not caplog.records and calls == []
    finally:
        sock.close(0)
        server.close()
