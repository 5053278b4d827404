"""Every ``python`` block of ``docs/engine.md`` runs as a script of its own (its rank
processes import it again, as a reader's copy would), so the examples cannot drift."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "engine.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def snippets() -> list[str]:
    return BLOCK.findall(DOC.read_text())


def test_the_doc_has_its_snippets() -> None:
    assert len(snippets()) == 2


@pytest.mark.parametrize("index", range(len(snippets())))
def test_snippet_runs_as_a_script(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"engine_snippet_{index}.py"
    script.write_text(snippets()[index])
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "UCX_MODULES": "^ib",
        "NIXL_LOG_LEVEL": "WARN",
    }
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bytes in" in done.stdout
