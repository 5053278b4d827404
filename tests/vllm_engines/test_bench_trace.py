"""``kvbridge bench vllm --trace`` on its smallest case: small pools churned by the seeded
warm-up really hand out fragmented block ids, kvbridge still answers the colocated tokens
there, and it posts no more descriptors per joint run of block ids than vLLM's
NixlConnector.

Four engines of their own (their pools are small on purpose, so the shared ones do not
fit), two warm-up batches and two timed requests per connector."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import vllm_bench as bench
from benchmarks.vllm_pool import joint_runs, runs
from benchmarks.vllm_trace import run_trace_case

pytestmark = pytest.mark.vllm


def test_runs_count_stretches_of_consecutive_ids_and_skip_state_slots() -> None:
    assert runs([[4, 5, 6, 9, 10, 2]]) == 3
    assert runs([[7, 6, 5]]) == 3  # a pool's reversed ids: no two continue each other
    assert runs([[0, 0, 3, 4], [17]]) == 1  # null blocks and a one-slot state group left out
    assert joint_runs([[4, 5, 6, 7]], [[10, 11, 3, 4]]) == 2
    assert joint_runs([[4, 6, 7]], [[10, 11, 12]]) == 2


def test_trace_llama_fragmented_pools(models: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(bench.SITECUSTOMIZE)
    (case,) = [c for c in bench.CASES if c.name == "llama 128->128"]
    rows = run_trace_case(case, models, str(site), calls=2, rounds=2, progress=print)
    got = {r["connector"]: r for r in rows}
    kvb, nixl = got["kvbridge"], got["nixl"]

    assert kvb["output"] == "match"
    assert kvb["loaded"] == kvb["timed"] == 2
    assert nixl["loaded"] == nixl["timed"] == 2  # else its medians cover other requests
    # the warm-up went through each connector, so D's pool was churned by loads too
    loaded, sent = map(int, kvb["warm_loads"].split("/"))
    assert sent > 0 and loaded == sent
    # a 768-token request holds 6 blocks of 128 on D; a fresh pool gives one run
    assert kvb["blocks"] == 6
    assert kvb["d_runs"] > 1 and kvb["p_runs"] > 1
    assert kvb["joint"] >= max(kvb["d_runs"], kvb["p_runs"])
    for r in (kvb, nixl):
        assert r["descriptors"] > 0 and r["KiB"] > 0
        assert r["ttft_ms"] > 0 and r["transfer_ms"] > 0 and not math.isnan(r["transfer_ms"])
    # each pair has its own engines, so their tables differ a little (92 vs 94 descriptors
    # for 23 vs 23.5 joint runs has been seen): compare descriptors per joint run
    assert kvb["joint"] > 0 and nixl["joint"] > 0
    assert kvb["descriptors"] / kvb["joint"] <= nixl["descriptors"] / nixl["joint"]
