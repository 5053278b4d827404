"""Per-instance identities on the side channel: each P and D instance has its own CURVE
key pair (``kvbridge keys``), each lists its peers' public keys by engine id, and an
engine id a frame claims must be the one bound to the key of its session."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbridge.cli.main import main
from kvbridge.connector.consumer import Consumer
from kvbridge.connector.load import Mode, Outcome
from kvbridge.connector.producer import Producer
from kvbridge.control.channel import Client
from kvbridge.control.messages import (
    PROTOCOL_VERSION,
    FenceReply,
    Handshake,
    HandshakeReply,
    LeaseOp,
    PushFence,
    PushRuns,
    tables_digest,
)
from kvbridge.control.security import Keys
from kvbridge.errors import ConfigError, PeerError
from kvbridge.integrations.vllm.config import read_config
from kvbridge.transport.loopback import LoopbackTransport
from tests.unit.test_connector_loopback import SECRET, SPEC, World, check_bytes


def new_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], engine_id: str) -> Path:
    """A key file made by ``kvbridge keys new``; its printed line is ``ID PUBLIC``."""
    path = tmp_path / f"{engine_id}.json"
    assert main(["keys", "new", engine_id, str(path)]) == 0
    assert capsys.readouterr().out.split() == [engine_id, Keys.load(path).server_public.decode()]
    return path


def allow(capsys: pytest.CaptureFixture[str], file: Path, peer: Path) -> None:
    """``kvbridge keys allow FILE "$(kvbridge keys show PEER)"``."""
    assert main(["keys", "show", str(peer)]) == 0
    line = capsys.readouterr().out.strip()
    assert main(["keys", "allow", str(file), line]) == 0
    n = len(Keys.load(file).peers)
    said = {1: "1 peer", 2: "2 peers", 3: "3 peers"}[n]
    assert capsys.readouterr().out == f"{Keys.load(file).engine_id}: {said}\n"


def outsider(w: World, engine_id: str, keys: Keys) -> Consumer:
    """One more D rank-0 consumer, with its own engine id and keys."""
    return Consumer(
        engine_id, w.d.spec, w.d.par, 0, w.d.layouts[0], list(w.d.bound(0).bases),
        LoopbackTransport(f"d-{engine_id}", w.fabric), SECRET, keys=keys,
    )  # fmt: skip


def outcome_of(consumer: Consumer, timeout_s: float = 5.0) -> Outcome:
    end, got = time.monotonic() + timeout_s, []
    while not got and time.monotonic() < end:
        got = consumer.poll()
        time.sleep(0.01)
    assert len(got) == 1, got
    return got[0]


@pytest.mark.parametrize("mode", [Mode.PULL, Mode.PUSH])
def test_cli_made_identities_load_and_carry_a_byte_exact_load(tmp_path, capsys, mode):
    """P lists D, D lists P (push: D's runs go to P ranks' own channels, same keys)."""
    p, d = new_key(tmp_path, capsys, "P"), new_key(tmp_path, capsys, "D")
    allow(capsys, p, d)
    allow(capsys, d, p)
    assert oct(p.stat().st_mode & 0o777) == "0o600"
    p_keys, d_keys = Keys.load(p), Keys.load(d)
    assert dict(p_keys.peers) == {"D": d_keys.server_public}
    assert dict(d_keys.peers) == {"P": p_keys.server_public}
    w = World(p_keys=p_keys, d_keys=d_keys, mode=mode)
    try:
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("k", 40)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert out.ok, out.error
        check_bytes(w, before, 40, 0, d_tabs)
    finally:
        w.close()


def test_a_d_whose_key_p_does_not_list_is_refused_at_once(tmp_path, capsys):
    p, d, stranger = (new_key(tmp_path, capsys, e) for e in ("P", "D", "D2"))
    allow(capsys, p, d)
    for x in (d, stranger):
        allow(capsys, x, p)  # the stranger knows P's key; P does not know the stranger's
    w = World(p_keys=Keys.load(p), d_keys=Keys.load(d))
    d2 = outsider(w, "D2", Keys.load(stranger))
    try:
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("k", 40)
        t0 = time.monotonic()
        d2.load(handle, d_tabs)
        out = outcome_of(d2)
        assert not out.ok and "CURVE handshake failed" in out.error, out.error
        assert time.monotonic() - t0 < 3.0
        w.consumers[0].load(handle, d_tabs)  # the refused load changed nothing at P
        (good,) = w.wait()
        assert good.ok, good.error
        check_bytes(w, before, 40, 0, d_tabs)
    finally:
        d2.close()
        w.close()


def test_a_listed_d_claiming_another_engine_id_is_refused(tmp_path, capsys):
    """Mallory's key is on P's list (as "M"); frames she sends claiming "D" are refused
    with IdentityError before P's handler sees them, so she cannot end D's lease."""
    p, d, m = (new_key(tmp_path, capsys, e) for e in ("P", "D", "M"))
    for x in (d, m):
        allow(capsys, p, x)
        allow(capsys, x, p)
    w = World(p_keys=Keys.load(p), d_keys=Keys.load(d))
    impostor = outsider(w, "D", Keys.load(m))  # M's key, D's engine id
    mallory = Client(w.producer.endpoint, SECRET, 2.0, Keys.load(m), server="P")
    try:
        reply = mallory.call(Handshake(PROTOCOL_VERSION, "M"))  # her own id: served
        assert isinstance(reply, HandshakeReply)
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("k", 40)
        impostor.load(handle, d_tabs)
        out = outcome_of(impostor)
        assert not out.ok and "IdentityError" in out.error, out.error
        assert "claims engine id 'D'" in out.error and "bound to 'M'" in out.error
        digest = tables_digest(handle.block_tables, handle.n_tokens)
        for op in ("begin", "fail", "confirm"):
            with pytest.raises(PeerError, match="IdentityError: frame claims engine id 'D'"):
                mallory.call(LeaseOp(op, "k", handle.lease_id, digest, "D", 0, 1))
        w.consumers[0].load(handle, d_tabs)
        (good,) = w.wait()
        assert good.ok, good.error
        check_bytes(w, before, 40, 0, d_tabs)
    finally:
        mallory.close()
        impostor.close()
        w.close()


def test_a_listed_d_cannot_fence_or_push_for_another_ds_load(tmp_path, capsys):
    """Push mode, M's key on P's list: a ``PushFence``/``PushRuns`` claiming "D" is
    refused (IdentityError) at every P rank; M's fence under her own id acts on M's loads
    only, so D's load of the same request is written and succeeds byte-exact."""
    p, d, m = (new_key(tmp_path, capsys, e) for e in ("P", "D", "M"))
    for x in (d, m):
        allow(capsys, p, x)
        allow(capsys, x, p)
    w = World(p_keys=Keys.load(p), d_keys=Keys.load(d), mode=Mode.PUSH)
    ranks = [Client(x.info.endpoint, SECRET, 2.0, Keys.load(m), server="P") for x in w.workers]
    try:
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("k", 40)
        made_up = PushRuns("k", b"x", b"", b"", b"", b"n", nonce="n1", d_engine="D")
        for mallory in ranks:
            for msg in (PushFence("k", "D"), made_up):
                with pytest.raises(PeerError, match="IdentityError: frame claims engine id 'D'"):
                    mallory.call(msg)
            assert mallory.call(PushFence("k", "M")) == FenceReply("k", True)
        w.consumers[0].load(handle, d_tabs)
        (good,) = w.wait()
        assert good.ok and good.mover == "push", good
        check_bytes(w, before, 40, 0, d_tabs)
        assert all(sum(x.ledger.refused.values()) == 0 for x in w.workers)
    finally:
        for c in ranks:
            c.close()
        w.close()


def test_renews_use_the_key_of_the_engine_id_now_at_the_endpoint(tmp_path, capsys):
    """P restarts at the same endpoint under another engine id (its own key): D's renews
    of a load queued for the new P use the new P's key, so its lease (2 s) outlives a
    3 s handshake; a channel kept for the old engine id would fail every renew."""
    p, p2, d = (new_key(tmp_path, capsys, e) for e in ("P", "P2", "D"))
    for x in (p, p2):
        allow(capsys, x, d)
        allow(capsys, d, x)
    w = World(lease_s=2.0, p_keys=Keys.load(p), d_keys=Keys.load(d))
    consumer, held = w.consumers[0], [1.5]
    get = consumer.peers.get

    def held_get(handle, since=None):  # type: ignore[no-untyped-def]
        time.sleep(held[0])  # a slow handshake: the renewer keeps the lease meanwhile
        return get(handle, since)

    consumer.peers.get = held_get  # type: ignore[method-assign]
    try:
        handle, d_tabs = w.request("first", 40)  # renewed through a channel to "P"
        consumer.load(handle, d_tabs)
        assert w.wait()[0].ok
        port = int(w.producer.endpoint.rsplit(":", 1)[1])
        w.producer.close()
        w.producer = Producer("P2", SPEC, w.p.par, SECRET, 2.0, port=port, keys=Keys.load(p2))
        for x in w.workers:
            w.producer.add_rank(x.info)
        assert w.producer.endpoint.endswith(f":{port}")
        held[0] = 3.0
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("second", 40)
        consumer.load(handle, d_tabs)
        (out,) = w.wait(timeout=15)
        assert out.ok, out.error
        check_bytes(w, before, 40, 0, d_tabs)
    finally:
        w.close()


def test_d_contacts_only_a_p_holding_the_key_it_binds_to_that_engine_id(tmp_path, capsys):
    p, d, fake_p = (new_key(tmp_path, capsys, e) for e in ("P", "D", "P-elsewhere"))
    allow(capsys, p, d)
    w = World(p_keys=Keys.load(p), d_keys=Keys.load(d))  # D lists no P yet
    try:
        handle, d_tabs = w.request("k", 40)
        w.consumers[0].load(handle, d_tabs)
        (out,) = w.wait()
        assert not out.ok and "no public key for instance 'P'" in out.error, out.error
        key = Keys.load(fake_p).server_public.decode()  # "P" bound to a key P lacks
        d_keys = Keys.add_peers(d, {"P": key})
        wrong = outsider(w, "D", d_keys)
        try:
            handle, d_tabs = w.request("k2", 40)
            wrong.load(handle, d_tabs)
            out = outcome_of(wrong)
            assert not out.ok and "CURVE handshake failed" in out.error, out.error
        finally:
            wrong.close()
    finally:
        w.close()


def identity_body(**change: object) -> str:
    keys = Keys.from_secret(b"x")
    body = {
        "engine_id": "P",
        "public": keys.server_public.decode(),
        "secret": keys.server_secret.decode(),
        "peers": {"D": keys.client_public.decode()},
    }
    return json.dumps({**body, **change})


ONE_KEY = Keys.from_secret(b"x").client_public.decode()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (identity_body(public=Keys.from_secret(b"y").server_public.decode()), "not the key of"),
        (identity_body(peers=["k"]), "peers must be an object"),
        (identity_body(engine_id=""), "non-empty"),
        (identity_body(peers={"D": "short"}), "40 characters"),
        (identity_body(server_public="x"), "an identity needs exactly"),
        (identity_body(peers={"D": ONE_KEY, "E": ONE_KEY}), "its own public key"),
    ],
)
def test_bad_identity_files_are_refused_naming_the_problem(tmp_path, body, why):
    f = tmp_path / "k.json"
    f.write_text(body)
    with pytest.raises(ConfigError, match=why):
        Keys.load(f)


def test_a_key_file_is_never_written_through_a_planted_link(tmp_path, monkeypatch):
    """The secret goes to a new file of a random name (created exclusively, links not
    followed): a link planted at a name that could be guessed gets nothing."""
    import kvbridge.control.security as security

    target = tmp_path / "elsewhere"
    target.write_text("mine")
    path = tmp_path / "id.json"
    (tmp_path / f".id.json.{os.getpid()}.tmp").symlink_to(target)  # a pid is guessable
    first = Keys.new_identity(path, "D")
    assert target.read_text() == "mine" and first.engine_id == "D"
    monkeypatch.setattr(security.secrets, "token_hex", lambda n: "guessed")
    for name in ("id.json", "id2.json"):  # both guessed: refused, nothing written
        planted = tmp_path / f".{name}.guessed.tmp"
        planted.symlink_to(target)
    with pytest.raises(ConfigError, match=r"temporary file .* exists"):
        Keys.add_peers(path, {"P": ONE_KEY})
    with pytest.raises(ConfigError, match=r"temporary file .* exists"):
        Keys.new_identity(tmp_path / "id2.json", "D")
    assert target.read_text() == "mine" and planted.is_symlink()
    assert Keys.load(path) == first and not (tmp_path / "id2.json").exists()


def test_vllm_makes_the_key_file_at_first_start_bound_to_its_engine_id(tmp_path):
    path = tmp_path / "id.json"

    def kv(engine_id: str) -> SimpleNamespace:
        extra = {"secret": "s", "keys_file": str(path)}
        return SimpleNamespace(
            kv_role="kv_both", engine_id=engine_id, kv_connector_extra_config=extra
        )

    assert read_config(kv("prefill-0"), None).keys_file == str(path)
    first = Keys.load(path)
    assert first.engine_id == "prefill-0" and first.peers == ()
    read_config(kv("prefill-0"), None)  # the second start keeps it
    assert Keys.load(path) == first
    with pytest.raises(ConfigError, match="identity of 'prefill-0', this engine is 'other'"):
        read_config(kv("other"), None)
    assert main(["keys", "new", "prefill-0", str(path)]) == 2  # never overwritten
    assert Keys.load(path) == first
