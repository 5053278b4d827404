"""The ``kvbridge`` command line a newcomer meets first: what ``--help`` and ``plan``
import, every flag checked with a message naming it, and where a side's omitted keys
come from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cli import args as types
from kvbridge.cli.main import main
from kvbridge.layout import layout_names

SRC = Path(__file__).resolve().parents[2] / "src"
HEAVY = ("torch", "vllm", "aiohttp", "numpy")
PROBE = """
import json, sys
from kvbridge.cli.main import main
code = main(sys.argv[1:])
print("MODULES " + json.dumps([m for m in {heavy} if m in sys.modules]))
sys.exit(code)
"""


def imported(*argv: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after ``kvbridge ARGV``."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "UCX_MODULES": "^ib"}
    probe = PROBE.format(heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("MODULES "), done.stdout[-2000:]
    return list(json.loads(line.removeprefix("MODULES ")))


def test_help_imports_nothing_heavy() -> None:
    assert imported("--help") == []
    for command in ("plan", "bench", "demo", "proxy"):
        assert imported(command, "--help") == [], command


def test_top_level_help_is_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvbridge --help``: what the tool does and one line per command, no docstring."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and "register(sub)" not in out
    assert "prefill instance (P)" in out and "decode" in out
    lines = out.splitlines()
    for command in ("plan", "bench", "demo", "proxy", "keys"):
        assert any(line.split()[:1] == [command] for line in lines), command


def test_plan_imports_numpy_but_not_torch() -> None:
    argv = ("plan", "--model", "llama-3.1-8b", "--tokens", "5000", "--decode", "tp=2", "--json")
    assert imported(*argv) == ["numpy"]


BAD_FLAGS = {
    "negative calls": (["bench", "plan", "--calls", "-3"], "argument --calls: -3 must be"),
    "zero calls": (["bench", "plan", "--calls", "0"], "argument --calls: 0 must be"),
    "calls on transfer": (["bench", "transfer", "--calls", "5"], "--calls"),
    "negative seed": (["plan", "--shuffle-blocks", "-1"], "argument --shuffle-blocks: -1"),
    "seed not a number": (["plan", "--shuffle-blocks", "x"], "argument --shuffle-blocks"),
    "fractional tokens": (["plan", "--tokens", "1.5e0"], "argument --tokens: '1.5e0'"),
    "tokens text": (["plan", "--tokens", "many"], "argument --tokens: 'many'"),
    "negative cached": (["plan", "--cached-tokens", "-1"], "argument --cached-tokens"),
    "side key": (["plan", "--decode", "tp=6,blk=3"], "argument --decode: 'blk=3'"),
    "side twice": (["plan", "--prefill", "tp=2,tp=4"], "argument --prefill: tp given twice"),
    "side no value": (["plan", "--decode", "tp"], "argument --decode: 'tp' is not key=value"),
    "side zero": (["plan", "--decode", "pp=0"], "argument --decode: pp=0 must be ≥ 1"),
    "side layout": (["plan", "--prefill", "layout=hdn"], "argument --prefill: layout='hdn'"),
    "memory size": (["plan", "--max-memory", "lots"], "argument --max-memory: 'lots'"),
    "demo new tokens": (["demo", "--new-tokens", "-3"], "argument --new-tokens: -3"),
    "demo cached": (["demo", "--cached", "-1"], "argument --cached: -1"),
    "demo side": (["demo", "--decode", "tp=6,block=x"], "argument --decode: block='x'"),
    "demo preset": (["demo", "--preset", "gpt"], "argument --preset: invalid choice"),
    "proxy port": (["proxy", "--prefill", "u", "--decode", "u", "--port", "0"], "--port: 0"),
}
PLAN_BASE = ["--model", "llama-3.1-8b", "--tokens", "100"]


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_bad_flag_exits_2_naming_it(case: str, capfd: pytest.CaptureFixture[str]) -> None:
    argv, needle = BAD_FLAGS[case]
    if argv[0] == "plan" and "--tokens" not in argv:
        argv = [*argv, *PLAN_BASE]
    elif argv[0] == "plan":
        argv = [*argv, "--model", "llama-3.1-8b"]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert needle in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "value"),
    [("5000", 5000), ("1_000", 1000), ("1e7", 10**7), ("2.5e3", 2500), ("+4", 4)],
)
def test_counts_accept_integral_notations(text: str, value: int) -> None:
    assert types.positive(text) == value


def test_sizes() -> None:
    assert types.size("4GiB") == types.size("4G") == 4 << 30
    assert types.size("512MiB") == 512 << 20
    assert types.size("1000") == 1000


def test_side_type_accepts_every_registered_layout() -> None:
    for name in layout_names():
        assert types.side(f"layout={name}").given == (("layout", name),)


def test_plan_side_takes_block_and_layout_from_the_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", *PLAN_BASE, "--prefill", "tp=2,block=32,layout=hnd", "--decode", "tp=4"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["decode"] == {"tp": 4, "pp": 1, "block": 32, "layout": "hnd"}
    assert out["prefill"] == {"tp": 2, "pp": 1, "block": 32, "layout": "hnd"}
    assert "--decode: block=32, layout=hnd taken from --prefill" in captured.err
    # given on both sides: nothing taken, nothing said
    assert main([*argv[:-1], "tp=4,block=16,layout=nhd", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["decode"]["block"] == 16
    assert "taken from" not in captured.err


def test_demo_side_keeps_the_demo_defaults() -> None:
    from kvbridge.api import SideConfig
    from kvbridge.cli import demo_cmd
    from refengine import demo as demo_run

    assert demo_run._side(types.side("tp=6"), demo_cmd.DEFAULT_DECODE) == SideConfig(
        6, 32, "block-major"
    )
    assert demo_run._side(types.side("layout=nhd"), demo_cmd.DEFAULT_PREFILL) == SideConfig(
        2, 16, "nhd"
    )


def test_demo_names_match_the_engine() -> None:
    from kvbridge.cli import demo_cmd
    from kvbridge.connector.consumer import Mode
    from refengine import PRESETS

    assert tuple(sorted(PRESETS)) == demo_cmd.PRESET_NAMES
    assert tuple(m.value for m in Mode) == demo_cmd.MODES
