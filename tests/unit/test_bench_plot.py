"""``kvbridge bench ... --plot FILE.png``: the figures draw exactly the bench's rows, and
the flag is refused, naming it, where it cannot work (no NIXL, no bench run here)."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="pip install 'kvbridge[plot]'")

from benchmarks.plan_bench import PlanCase, as_dicts
from benchmarks.plot import TRANSFER_MEASURES, Series, check_target, draw
from benchmarks.transfer_bench import Case
from kvbridge.cli.main import main
from kvbridge.errors import ConfigError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CASES = [  # (layout, d_tp, tokens, ids, descriptors, GB/s kvbridge, contiguous, memcpy)
    ("nhd", 1, 1024, "consecutive", 32, 5.58, 6.12, 12.4),
    ("nhd", 1, 1024, "shuffled", 2048, 4.85, 6.18, 13.5),
    ("hnd", 2, 1024, "consecutive", 2048, 4.62, 6.16, 9.1),
    ("hnd", 2, 1024, "shuffled", 2048, 4.08, 5.75, 8.0),
    ("block-major", 1, 8192, "consecutive", 1, 2.78, 2.95, 10.1),
    ("block-major", 1, 8192, "shuffled", 512, 4.87, 5.01, 11.3),
]


def transfer_row(case: tuple[Any, ...]) -> dict[str, Any]:
    """A row with the keys, in the order, that ``transfer_bench._d_main`` sends."""
    layout, d_tp, tokens, ids, desc, gbps, contig, memcpy = case
    total = tokens * 32 * 2 * 8 * 128 * 2 // d_tp
    return {
        **asdict(Case(layout, 1, d_tp, tokens, ids)),
        "bytes": total,
        "descriptors": desc,
        "bytes_per_descriptor": total // desc,
        "gbps": gbps,
        "contiguous_gbps": contig,
        "memcpy_gbps": memcpy,
        "plan_us": 16.2,
        "post_us": 97.9,
        "host_us": 114.1,
    }


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 20_000, len(data)  # axes, points and labels, not an empty canvas


def points(drawn: list[Series], key: str, tokens: int) -> tuple[list[float], list[float]]:
    (series,) = [s for s in drawn if s.key == key and f"{tokens} tokens" in s.label]
    return series.x, series.y


def test_transfer_plot_draws_the_rows(tmp_path: Path) -> None:
    rows = [transfer_row(c) for c in CASES]
    out = tmp_path / "transfer.png"
    drawn = draw("transfer", rows, out)
    assert_png(out)
    assert len(drawn) == 2 * (len(TRANSFER_MEASURES) + 1)  # two token counts
    for tokens in (1024, 8192):
        mine = [r for r in rows if r["tokens"] == tokens]
        sizes = [float(r["bytes_per_descriptor"]) for r in mine]
        for key in [k for k, _, _ in TRANSFER_MEASURES] + ["descriptors"]:
            assert points(drawn, key, tokens) == (sizes, [float(r[key]) for r in mine])


def test_plan_plot_draws_the_rows(tmp_path: Path) -> None:
    cases = [
        PlanCase("llama-3.1-8b", 1024, 1, d, lay, "shuffled", us, n, 1 << 27, (1 << 27) / n, 9.0, f)
        for d, lay, us, n, f in ((1, "nhd", 18.1, 2048, 8.3), (2, "nhd", 121.1, 65536, 8.9))
    ]
    rows: list[dict[str, Any]] = as_dicts(cases)
    out = tmp_path / "plan.png"
    drawn = draw("plan", rows, out)
    assert_png(out)
    assert [(s.key, s.y) for s in drawn] == [("plan_us", [18.1, 121.1]), ("floor_us", [8.3, 8.9])]


@pytest.mark.parametrize(
    "name, needle", [("figure.jpg", "must end in .png"), ("nowhere/figure.png", "does not exist")]
)
def test_unwritable_target_refused(tmp_path: Path, name: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        check_target(tmp_path / name)


def test_missing_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(ConfigError, match=r"pip install 'kvbridge\[plot\]'"):
        draw("transfer", [transfer_row(CASES[0])], tmp_path / "t.png")
    fake = tmp_path / "site" / "matplotlib"  # and in the bench's own process
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('no matplotlib here')\n")
    monkeypatch.setenv("PYTHONPATH", f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert main(["bench", "transfer", "--quick", "--plot", str(tmp_path / "t.png")]) == 2
    assert "pip install 'kvbridge[plot]'" in capfd.readouterr().err


@pytest.mark.parametrize("argv", [["vllm"], ["vllm", "--quick"], ["plan", "--calls", "5"]])
def test_refused_plot_exits_2_naming_the_flag(
    tmp_path: Path, argv: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / ("figure.png" if argv[0] == "vllm" else "figure.svg")
    assert main(["bench", *argv, "--plot", str(target)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "--plot" in err, err
    assert "Traceback" not in err
    assert not target.exists()
