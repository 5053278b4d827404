"""The vLLM connector's settings: the model identity P and D must share."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.config import model_fingerprint, read_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_key_value_heads": 2}


class HFConfig:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw

    def to_dict(self) -> dict[str, Any]:
        return dict(self.kw)


def kv(**extra: Any) -> SimpleNamespace:
    return SimpleNamespace(
        kv_role="kv_both", engine_id="e", kv_connector_extra_config={"secret": "s", **extra}
    )


def test_fingerprint_ignores_where_the_model_was_loaded_from() -> None:
    a = HFConfig(**LLAMA, _name_or_path="/p/llama", transformers_version="4.1")
    b = HFConfig(**LLAMA, _name_or_path="/other/host/llama", transformers_version="4.2")
    assert model_fingerprint(a) == model_fingerprint(b)


def test_fingerprint_tells_models_of_equal_kv_shapes_apart() -> None:
    qwen = HFConfig(**{**LLAMA, "architectures": ["Qwen3ForCausalLM"]})
    assert model_fingerprint(HFConfig(**LLAMA)) != model_fingerprint(qwen)
    theta = HFConfig(**LLAMA, rope_theta=1e6)
    assert model_fingerprint(HFConfig(**LLAMA)) != model_fingerprint(theta)


def test_model_id_defaults_to_the_fingerprint_and_can_be_set() -> None:
    hf = HFConfig(**LLAMA)
    assert read_config(kv(), hf).model_id == model_fingerprint(hf)
    assert read_config(kv(model_id="llama-ft-7"), hf).model_id == "llama-ft-7"
    with pytest.raises(ConfigError, match="unknown keys"):
        read_config(kv(model="x"), hf)


def test_keys_file_and_advertise_are_read_and_a_bad_keys_file_refused(tmp_path) -> None:
    import zmq

    pub, sec = zmq.curve_keypair()
    good = tmp_path / "k.json"
    good.write_text(f'{{"server_public": "{pub.decode()}", "server_secret": "{sec.decode()}"}}')
    cfg = read_config(kv(keys_file=str(good), advertise="10.0.0.7", host="0.0.0.0"), None)
    assert (cfg.keys_file, cfg.advertise, cfg.host) == (str(good), "10.0.0.7", "0.0.0.0")
    bad = tmp_path / "bad.json"
    bad.write_text('{"server_public": "nope"}')
    with pytest.raises(ConfigError, match="40 characters"):
        read_config(kv(keys_file=str(bad)), None)


def test_prepare_lists_p_instances_as_engine_id_at_endpoint() -> None:
    cfg = read_config(kv(prepare=["p0@tcp://10.0.0.7:5600", " p1@tcp://10.0.0.8:5600"]))
    assert cfg.prepare == (("p0", "tcp://10.0.0.7:5600"), ("p1", "tcp://10.0.0.8:5600"))
    one = read_config(kv(prepare="p0@tcp://h:1,p1@tcp://h:2"))
    assert one.prepare == (("p0", "tcp://h:1"), ("p1", "tcp://h:2"))
    assert read_config(kv()).prepare == () == read_config(kv(prepare="")).prepare
    assert read_config(kv(prepare="p0@tcp://h:1,")).prepare == (("p0", "tcp://h:1"),)
    assert read_config(kv(prepare=["a@b@tcp://h:1"])).prepare == (("a@b", "tcp://h:1"),)
    for bad in (["tcp://h:1"], ["p0@h:1"], ["@tcp://h:1"], 7, ["p@tcp://a:1", "p@tcp://b:1"]):
        with pytest.raises(ConfigError, match="prepare"):
            read_config(kv(prepare=bad))


def test_num_threads_is_read_as_vllms_nixl_connector_reads_it(monkeypatch) -> None:
    """``num_threads`` (the key vLLM's NixlConnector takes) sets the UCX worker threads of
    the engine's NIXL agents; absent, the environment's default holds; out of range or not
    a number is refused at start-up."""
    assert read_config(kv(num_threads=8)).num_threads == 8
    assert read_config(kv()).num_threads is None
    for bad in (-1, 65, "many", True, 2.7):
        with pytest.raises(ConfigError, match="num_threads"):
            read_config(kv(num_threads=bad))
    from kvbridge.integrations.vllm import worker

    made: list[dict[str, Any]] = []

    def fake(kind: str, name: str, **opts: Any) -> object:
        made.append({"kind": kind, **opts})
        return object()

    monkeypatch.setattr(worker, "make_transport", fake)
    for cfg, want in [
        (read_config(kv(num_threads=2)), {"kind": "nixl", "threads": 2}),
        (read_config(kv()), {"kind": "nixl"}),
        (read_config(kv(num_threads=2, transport="loopback")), {"kind": "loopback"}),
    ]:
        side = SimpleNamespace(cfg=cfg, rank=0, _transports=[])
        worker.WorkerSide._transport(side, "D")  # type: ignore[arg-type]
        assert made[-1] == want


def test_park_blocks_and_port_are_read_and_bad_values_refused() -> None:
    """``park_blocks``: 0 (no park) or ≥ 2 (one stays empty as vLLM's null block)."""
    cfg = read_config(kv(park_blocks=64, park_port=5601))
    assert (cfg.park_blocks, cfg.park_port) == (64, 5601)
    assert (read_config(kv()).park_blocks, read_config(kv()).park_port) == (0, 0)
    with pytest.raises(ConfigError, match="park_port = port = 5600"):
        read_config(kv(park_blocks=8, park_port=5600, port=5600))
    for bad in (
        {"park_blocks": 1},
        {"park_blocks": -2},
        {"park_blocks": 2.5},
        {"park_port": 70000},
    ):
        with pytest.raises(ConfigError, match="park_"):
            read_config(kv(**bad))
