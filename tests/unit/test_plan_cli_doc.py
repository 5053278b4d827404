"""Every row of the key-numbers table in ``docs/plan-cli.md`` is what ``kvbridge plan``
computes today: bytes, descriptors, mean run and the per-kind bytes named in a note."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvbridge.cli.main import main
from kvbridge.cli.plan_run import human

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan-cli.md"
TOKENS = 5000
SIDE = re.compile(r"tp(\d+) (\S+) b(\d+)")
NOTE = re.compile(r"(full|sliding|chunked|mla|state) ([\d,]+)")


def table_rows() -> list[list[str]]:
    """The cells of each row under ``## Key numbers``."""
    text = DOC.read_text().split("## Key numbers", 1)[1]
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]


def instance(cell: str) -> str:
    """``"tp2 hnd b16"`` → ``"tp=2,layout=hnd,block=16"``."""
    m = SIDE.fullmatch(cell.strip())
    assert m, f"cannot read {cell!r}"
    return f"tp={m[1]},layout={m[2]},block={m[3]}"


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_table_has_its_six_rows() -> None:
    assert len(table_rows()) == 6


@pytest.mark.parametrize("row", table_rows(), ids=lambda r: f"{r[0]} {r[1]}")
def test_key_numbers_row_matches_the_code(
    row: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    model, sides, total, descriptors, mean_run = row
    p, d = sides.split("→")
    args = ["plan", "--model", model, "--tokens", str(TOKENS), "--json"]
    assert main([*args, "--prefill", instance(p), "--decode", instance(d)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert number(total.split(" (")[0]) == out["bytes_total"]
    assert number(descriptors) == out["descriptors_total"]
    assert mean_run == human(out["mean_run_bytes"])
    for kind, nbytes in NOTE.findall(total):
        assert number(nbytes) == out["bytes_by_kind"][kind], kind
