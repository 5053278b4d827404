"""Resource guards of the command line: ``plan``'s memory estimate (an upper bound of what
planning allocates, checked under tracemalloc), the refusal naming ``--tokens`` and
``--max-memory``, the context-length warning, and the demo's request limit enforced
before any process starts (and real: the colocated check holds exactly that much)."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

from kvbridge.cli.main import main
from kvbridge.cli.plan_run import Report, context_length, estimate, warnings
from kvbridge.layout.side import SideConfig
from kvbridge.plan.dry_run import dry_run
from kvbridge.spec.load import load_model

CASES = [
    ("llama-3.1-8b", SideConfig(), SideConfig(), 1),
    ("llama-3.1-8b", SideConfig(tp=2), SideConfig(tp=4), None),
    ("qwen3-next-80b-a3b", SideConfig(tp=2, layout="hnd"), SideConfig(tp=4, block_size=32), 3),
    ("deepseek-v3", SideConfig(), SideConfig(block_size=32), 2),
    ("gemma-3-4b-it", SideConfig(), SideConfig(tp=2, block_size=32, layout="hnd"), 5),
]


@pytest.mark.parametrize(("name", "p", "d", "seed"), CASES)
def test_estimate_bounds_what_planning_allocates(
    name: str, p: SideConfig, d: SideConfig, seed: int | None
) -> None:
    info = load_model(name)
    tokens = 30_000
    est = estimate(info, p, d, tokens, seed)
    tracemalloc.start()
    try:
        ranks = dry_run(info, p, d, tokens, 0, seed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    most = max(r.summary.descriptors for r in ranks)
    assert most <= est.descriptors <= 2 * most + 64
    assert peak <= est.bytes, (peak, est)


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", "--model", "llama-3.1-8b", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_over_the_memory_limit_is_refused_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The plan below would post 640 M descriptors per D rank (tens of GiB)."""
    argv = ["--tokens", "1e7", "--shuffle-blocks", "1", "--prefill", "tp=2", "--decode", "tp=4"]
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        code, out, err = plan(capsys, *argv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 2 and out == ""
    assert "--tokens 10000000 --shuffle-blocks 1: planning would need about" in err
    assert "over the limit of 4.0 GiB (--max-memory)" in err
    assert peak < 256 << 20 and time.perf_counter() - t0 < 60


def test_tokens_1e12_is_refused_not_a_memory_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = plan(capsys, "--tokens", "1e12")
    assert code == 2 and "--tokens 1000000000000" in err and "--max-memory" in err


def test_max_memory_flag_moves_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan(capsys, "--tokens", "5000", "--shuffle-blocks", "1", "--json")[0] == 0
    code, _, err = plan(capsys, "--tokens", "5000", "--shuffle-blocks", "1", "--max-memory", "1KiB")
    assert code == 2 and "over the limit of 1.0 KiB (--max-memory)" in err


def test_layout_advice_skips_alternatives_over_the_limit() -> None:
    info = load_model("llama-3.1-8b")
    p, d = SideConfig(tp=2), SideConfig(tp=4)
    report = Report(info, p, d, 5000, 0, None, dry_run(info, p, d, 5000))
    assert any("HND on P and D keeps" in w for w in warnings(report, None))
    assert not any("keeps" in w for w in warnings(report, 1024))


def test_context_length_warning(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan(capsys, "--tokens", "131072", "--json")
    assert code == 0 and not any("context length" in w for w in json.loads(out)["warnings"])
    code, out, _ = plan(capsys, "--tokens", "131073", "--json")
    (warning,) = [w for w in json.loads(out)["warnings"] if "context length" in w]
    assert "--tokens 131073 exceeds the model's context length of 131072" in warning


def test_context_length_sources(tmp_path: Path) -> None:
    assert context_length("llama-3.1-8b") == 131072
    assert context_length("llama-4-scout") == 262144  # in text_config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    assert context_length(str(tmp_path)) is None
    assert context_length(str(tmp_path / "spec.toml")) is None
    assert context_length("no-such-model") is None


def test_demo_refuses_long_requests_before_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from refengine import demo as demo_run

    def never(*a: object, **k: object) -> None:
        raise AssertionError("P started for a request the demo must refuse")

    monkeypatch.setattr(demo_run, "PrefillServer", never)
    assert main(["demo", "--new-tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--new-tokens 100000: a built-in prompt has" in err and "> 1024 tokens" in err
    prompts = tmp_path / "p.txt"
    prompts.write_text("short\n" + "x" * 1100 + "\n")
    assert main(["demo", "--prompts", str(prompts), "--preset", "llama"]) == 2
    err = capsys.readouterr().err
    assert f"--prompts {prompts}: prompt 2 has 1101 tokens" in err


def test_demo_limit_is_what_the_colocated_check_holds() -> None:
    from refengine import EngineError, generate
    from refengine.demo import MAX_TOKENS, REFERENCE_BLOCK

    prompt = [1 + i % 200 for i in range(MAX_TOKENS - 8)]
    assert len(generate("llama", prompt, n_new_tokens=8)) == 8
    with pytest.raises(EngineError, match="blocks needed"):
        generate("llama", prompt, n_new_tokens=8 + REFERENCE_BLOCK + 1)


@pytest.mark.parametrize(
    ("argv", "lead"),
    [
        (["--prefill", "tp=5"], "--prefill tp=5: 6 linear-attention heads cannot be split"),
        (["--decode", "tp=4,block=16"], "--decode tp=4,block=16: 6 linear-attention heads"),
        (["--prefill", "pp=9"], "--prefill pp=9: pp=9 exceeds the 6 layers"),
        (["--preset", "deepseek", "--decode", "tp=8"], "--decode tp=8: 12 MLA heads"),
    ],
)
def test_demo_refuses_a_side_the_preset_cannot_run_before_printing(
    argv: list[str], lead: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from refengine import demo as demo_run

    def never(*a: object, **k: object) -> None:
        raise AssertionError("P started for a side the demo must refuse")

    monkeypatch.setattr(demo_run, "PrefillServer", never)
    assert main(["demo", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()], err  # no banner, one line
    assert err.startswith(f"kvbridge: error: ConfigError: {lead}"), err


def test_demo_side_check_accepts_what_the_engine_runs() -> None:
    from kvbridge.cli.args import side
    from refengine import preset
    from refengine.demo import check_side

    for tp in (1, 2, 3, 6):
        check_side(preset("kimi-linear"), "--decode", side(f"tp={tp}"), SideConfig(tp=tp))
    check_side(preset("llama"), "--prefill", side("pp=2"), SideConfig(tp=2, pp=2))
