"""Long commands say how far they are on stderr, ``bench plan --quick`` is honoured, and
the demo's table gives latency and marks transfers too small for GB/s to mean much."""

from __future__ import annotations

import json

import pytest

from kvbridge.cli.main import main
from refengine.demo_report import LATENCY_BOUND, Row, Summary, render_json, render_text


def test_bench_plan_quick_prints_progress_and_leaves_out_the_large_cases(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "plan", "--quick", "--calls", "3", "--json"]) == 0
    out = capfd.readouterr()
    rows = json.loads(out.out)
    assert len(rows) == 8 and {r["tokens"] for r in rows} == {1024}
    lines = out.err.splitlines()
    assert [line.split()[2] for line in lines] == [f"[{i}/8]" for i in range(1, 9)]
    assert all(line.startswith("bench plan [") and " µs, " in line for line in lines)


def test_bench_plan_calls_are_not_raised_behind_the_users_back() -> None:
    from benchmarks import plan_bench

    seen: list[int] = []
    real = plan_bench.best_median_us

    def spy(fn: object, calls: int, batches: int = 5) -> float:
        seen.append(calls)
        return real(fn, calls, batches)  # type: ignore[arg-type]

    plan_bench.best_median_us = spy  # type: ignore[assignment]
    try:
        plan_bench.cases(7, quick=True)
    finally:
        plan_bench.best_median_us = real
    assert seen and set(seen) == {7}


def row(name: str, nbytes: int, ms: float) -> Row:
    return Row(name, 20, 0, nbytes, 4, ms, True, False)


def test_demo_table_has_latency_and_marks_latency_bound_rows() -> None:
    small, large = row("r1", 14_000, 17.0), row("r2", 4 * LATENCY_BOUND, 2.0)
    summary = Summary("kimi-linear", "TP 2", "TP 1", "pull", 20, [small, large], 3.0)
    text = render_text(summary)
    header, first, second = text.splitlines()[:3]
    assert "latency ms" in header and "GB/s" in header
    assert first.split()[-3:] == ["17.0", "0.00082*", "match"]
    assert second.split()[-3:] == ["2.0", "2.1", "match"]
    assert "latency-bound" in text and "not the bandwidth" in text
    out = render_json(summary)
    assert [r["latency_bound"] for r in out["requests"]] == [True, False]
    only_large = render_text(Summary("k", "a", "b", "pull", 20, [large], 1.0))
    assert "latency-bound" not in only_large


def test_bench_transfer_reports_each_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real cases need NIXL processes and minutes (run `kvbridge bench transfer --quick`
    by hand); here each case is faked."""
    from benchmarks import transfer_bench

    def fake(case: transfer_bench.Case) -> dict[str, object]:
        return {"descriptors": 32, "gbps": 5.5, "contiguous_gbps": 6.1, "memcpy_gbps": 12.0}

    monkeypatch.setattr(transfer_bench, "run_case", fake)
    lines: list[str] = []
    rows = transfer_bench.run_all(quick=True, progress=lines.append)
    assert len(rows) == len(lines) == 6
    assert lines[0] == (
        "[1/6] 1024 tokens TP 1→1 nhd consecutive: 32 descriptors, gbps 5.5, "
        "contiguous_gbps 6.1, memcpy_gbps 12.0"
    )
    assert len(transfer_bench.run_all(progress=lines.append)) == 12


def test_large_plans_report_each_rank_and_plan_the_same(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvbridge.cli import plan_run

    argv = ["plan", "--model", "qwen3-next-80b-a3b", "--tokens", "3000", "--json"]
    argv += ["--prefill", "tp=2,pp=2", "--decode", "tp=4", "--shuffle-blocks", "3"]
    assert main(argv) == 0
    quiet = capsys.readouterr()
    monkeypatch.setattr(plan_run, "PROGRESS_DESCRIPTORS", 0)
    assert main(argv) == 0
    loud = capsys.readouterr()
    assert json.loads(loud.out) == json.loads(quiet.out)
    assert "planned" not in quiet.err
    lines = [ln for ln in loud.err.splitlines() if "planned" in ln]
    assert [ln.split()[4] for ln in lines] == ["1/4", "2/4", "3/4", "4/4"]
