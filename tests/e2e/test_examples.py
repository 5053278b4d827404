"""Every example runs and succeeds, and every Python block in the README and docs/ is an
excerpt of an example (so the documentation cannot drift from code that runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENV = {**os.environ, "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
EXPECT = {
    "p_to_d.py": r"ok=True \d+ bytes in \d+ descriptors.*51200 token-heads equal",
    "plan_only.py": r"P\s+hnd → D\s+hnd: .* descriptors",
    "engine_move_kv.py": r"\d+ bytes in \d+ descriptors; tokens \[",
    "engine_pd.py": r"\d+ bytes in \d+ descriptors, [\d.]+ ms",
}


def _run(path: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_every_example_is_listed() -> None:
    assert {p.name for p in EXAMPLES} == set(EXPECT)
    index = (ROOT / "examples" / "README.md").read_text()
    assert all(f"`{p.name}`" in index for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path) -> None:
    assert re.search(EXPECT[path.name], _run(path)), path.name


def test_the_readme_example_also_runs_over_loopback() -> None:
    assert "ok=True" in _run(ROOT / "examples" / "p_to_d.py", "--transport", "loopback")


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_python_blocks_in_docs_are_excerpts_of_examples(doc: Path) -> None:
    sources = [_lines(p.read_text()) for p in EXAMPLES]
    for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
        lines = _lines(block)
        assert any(_contains(src, lines) for src in sources), f"{doc.name}: {lines[:3]}"
