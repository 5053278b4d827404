"""``kvbridge plan``: bytes by kind for every model, the JSON and table outputs, warnings,
``--model`` forms, and exit code 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbridge.cli.main import main
from kvbridge.layout.side import SideConfig
from kvbridge.plan.dry_run import dry_run
from kvbridge.spec import Group, ModelSpec, mla
from kvbridge.spec.hf import from_hf_config, load_config
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.specfile import dump_spec_file

from .test_hf_configs import MODELS, MODELS_DIR, expected

TOKENS = 9000  # past Gemma-3's 1024-token window and Llama-4's 8192-token chunk
KIND_KEYS = ("full", "sliding", "chunked", "mla", "state")


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def model(name: str) -> str:
    return str(MODELS_DIR / name)


@pytest.mark.parametrize("name", MODELS)
def test_1_to_1_moves_exactly_what_decode_needs(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = plan_json(capsys, "--model", model(name), "--tokens", str(TOKENS))
    exp, block = expected(name), 16
    per_layer = exp["kv_bytes_per_token_per_layer"]
    by_kind = out["bytes_by_kind"]
    totals = exp["totals"]
    assert by_kind["full"] + by_kind["mla"] == TOKENS * totals["kv_bytes_per_token_full_and_mla"]
    assert by_kind["state"] == totals["state_bytes_per_sequence"]
    windowed = {
        "sliding": ("sliding_window", exp["sliding_window"] and exp["sliding_window"] - 1),
        "chunked": ("chunked_attention", exp["attention_chunk_size"]),
    }
    for kind, (key, size) in windowed.items():
        layers = len(exp["layer_indices"][key])
        if not layers:
            assert by_kind[kind] == 0
            continue
        tokens = min(TOKENS, size) if kind == "sliding" else TOKENS % size
        row = per_layer[key] * layers
        assert tokens * row <= by_kind[kind] <= (tokens + 2 * block) * row
    assert out["bytes_total"] == sum(by_kind[k] for k in KIND_KEYS)
    (rank,) = out["decode_ranks"]
    assert rank["bytes"] == out["bytes_total"]
    assert rank["descriptors"] == out["descriptors_total"]


@pytest.mark.parametrize("name", MODELS)
def test_2_to_1_moves_what_1_to_1_moves(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    one = plan_json(capsys, "--model", model(name), "--tokens", "300")
    two = plan_json(capsys, "--model", model(name), "--tokens", "300", "--prefill", "tp=2")
    assert two["bytes_by_kind"] == one["bytes_by_kind"]
    sources = two["decode_ranks"][0]["sources"]
    assert [s["rank"] for s in sources] == [0, 1]
    assert sum(s["bytes"] for s in sources) == one["bytes_total"]


def test_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(
        capsys,
        *("--model", model("qwen3-next-80b-a3b"), "--tokens", "5000", "--cached-tokens", "100"),
        *("--prefill", "tp=2,pp=2,block=16,layout=hnd", "--decode", "tp=4,block=32,layout=nhd"),
        *("--shuffle-blocks", "3"),
    )
    assert set(out["bytes_by_kind"]) == set(KIND_KEYS)
    assert out["prefill"] == {"tp": 2, "pp": 2, "block": 16, "layout": "hnd"}
    assert out["decode"] == {"tp": 4, "pp": 1, "block": 32, "layout": "nhd"}
    assert [r["rank"] for r in out["decode_ranks"]] == [0, 1, 2, 3]
    for r in out["decode_ranks"]:
        assert set(r) >= {"rank", "bytes", "descriptors", "sources"}
        assert r["bytes"] == sum(s["bytes"] for s in r["sources"])
        assert r["descriptors"] == sum(s["descriptors"] for s in r["sources"])
        assert {s["rank"] for s in r["sources"]} <= set(range(4))
    assert out["bytes_total"] == sum(r["bytes"] for r in out["decode_ranks"])
    assert out["descriptors_total"] == sum(r["descriptors"] for r in out["decode_ranks"])
    # 2 KV heads on 4 D ranks: every head reaches two ranks, each counted
    exp = expected("qwen3-next-80b-a3b")["totals"]
    assert out["bytes_by_kind"]["full"] == 2 * 4900 * exp["kv_bytes_per_token_full_and_mla"]
    assert out["bytes_by_kind"]["state"] == exp["state_bytes_per_sequence"]


def test_head_split_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-3.1-8B 1→2: each D rank gets 4 of 8 KV heads of 32 layers."""
    out = plan_json(
        capsys, "--model", model("llama-3.1-8b"), "--tokens", "5000", "--decode", "tp=2"
    )
    assert [r["bytes"] for r in out["decode_ranks"]] == [5000 * 32 * 2 * 4 * 256] * 2


def test_falcon_replicated_groups_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """Falcon-H1 1→2: x and heads split, Mamba-2's single B/C group reaches both ranks."""
    out = plan_json(capsys, "--model", model("falcon-h1-7b"), "--tokens", "100", "--decode", "tp=2")
    conv = 3 * (12 * 128 + 2 * 256) * 2
    ssm = 12 * 128 * 256 * 2
    for r in out["decode_ranks"]:
        assert r["bytes_by_kind"]["state"] == 44 * (conv + ssm)
        assert r["bytes_by_kind"]["full"] == 44 * 100 * 2 * 1 * 128 * 2


def test_full_size_jamba_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """Jamba 1→2: each D rank gets half of the 8192 Mamba-1 channels and 4 of 8 KV heads."""
    out = plan_json(
        capsys, "--model", model("jamba-1.5-mini"), "--tokens", "100", "--decode", "tp=2"
    )
    conv, ssm = 3 * 4096 * 2, 4096 * 16 * 2
    for r in out["decode_ranks"]:
        assert r["bytes_by_kind"]["state"] == 28 * (conv + ssm)
        assert r["bytes_by_kind"]["full"] == 4 * 100 * 2 * 4 * 128 * 2


def test_cached_prefix_and_shuffled_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--model", model("llama-3.1-8b"), "--tokens", "5000")
    base = plan_json(capsys, *args)
    cached = plan_json(capsys, *args, "--cached-tokens", "1000")
    shuffled = plan_json(capsys, *args, "--shuffle-blocks", "1")
    assert cached["bytes_total"] == base["bytes_total"] * 4000 // 5000
    assert shuffled["bytes_total"] == base["bytes_total"]
    # per layer: one run over the 312 full blocks (consecutive ids coalesce) and K of the
    # 8 tokens in the last block (it continues them), then V of those 8 tokens (NHD
    # keeps it apart from K)
    assert base["descriptors_total"] == 32 * 2
    assert shuffled["descriptors_total"] > 32 * 300


def test_human_output_and_layout_warning(capsys: pytest.CaptureFixture[str]) -> None:
    sides = ["--prefill", "tp=2,pp=1,block=16,layout=nhd", "--decode", "tp=4,layout=nhd"]
    code = main(["plan", "--model", model("llama-3.1-8b"), "--tokens", "5000", *sides])
    text = capsys.readouterr().out
    assert code == 0
    for needle in ("D rank 3 (stage 0, tp 3)", "P1", "full", "625.0 MiB", "warnings"):
        assert needle in text
    assert "NHD on P and D with a head split (TP 2→4) yields 512 B runs" in text
    assert "HND on P and D keeps" in text


def test_kv_dtype_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--model", model("deepseek-v3"), "--tokens", "1000")
    bf16 = plan_json(capsys, *args)
    fp8 = plan_json(capsys, *args, "--kv-dtype", "fp8")
    assert fp8["bytes_by_kind"]["mla"] * 2 == bf16["bytes_by_kind"]["mla"] == 1000 * 70272


def test_model_as_config_path_or_spec_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "nemotron-3-nano-30b"
    spec = from_hf_config(load_config(MODELS_DIR / name), name).spec
    (tmp_path / "spec.json").write_text(dump_spec_file(spec))
    outs = [
        plan_json(capsys, "--model", path, "--tokens", "700", "--decode", "tp=2")
        for path in (
            model(name),
            str(MODELS_DIR / name / "config.json"),
            str(tmp_path / "spec.json"),
        )
    ]
    assert outs[0]["bytes_by_kind"] == outs[1]["bytes_by_kind"] == outs[2]["bytes_by_kind"]
    assert outs[0]["descriptors_total"] == outs[2]["descriptors_total"]


BAD_ARGS = {
    "tp does not split": (["--decode", "tp=3"], "num_key_value_heads=8 cannot be split over TP 3"),
    "unknown key": (["--prefill", "tp=2,tpp=1"], "'tpp=1' is not key=value"),
    "bad layout": (["--decode", "layout=xyz"], "layout='xyz'"),
    "bad number": (["--decode", "block=x"], "block='x' is not an integer"),
    "zero tp": (["--prefill", "tp=0"], "tp=0 must be ≥ 1"),
    "too many stages": (["--prefill", "pp=40"], "pp=40"),
    "cached > tokens": (["--cached-tokens", "6000"], "--cached-tokens"),
    "bad dtype": (["--kv-dtype", "int3"], "--kv-dtype"),
}


@pytest.mark.parametrize("case", BAD_ARGS)
def test_bad_input_exits_2(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra, needle = BAD_ARGS[case]
    code = main(["plan", "--model", model("llama-3.1-8b"), "--tokens", "5000", *extra])
    assert code == 2
    assert needle in capsys.readouterr().err


def test_malformed_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(MODELS_DIR / "qwen3-next-80b-a3b")
    del cfg["linear_value_head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "--tokens", "10"]) == 2
    assert "linear_value_head_dim: missing" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert main(["plan", "--model", str(tmp_path), "--tokens", "10"]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "nowhere"), "--tokens", "10"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_consecutive_ids_coalesce_across_unequal_block_sizes() -> None:
    """One MLA layer, 1→1, P block 16 → D block 32, consecutive ids: both sides hold the
    64 tokens contiguously, so one run does (tiles of several blocks are merged in
    source order when ids continue)."""
    spec = ModelSpec("one", (mla(0, 576),), (Group("attn", (0,), 16),))
    info = ModelInfo(spec, "test", (0,))
    (rank,) = dry_run(info, SideConfig(block_size=16), SideConfig(block_size=32), tokens=64)
    assert rank.summary.descriptors == 1
