"""The built-in catalog: every model loads by bare name, as from its path; an unknown
name lists the known ones; ``kvbridge plan --model NAME`` works; the wheel carries it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from kvbridge import catalog
from kvbridge.cli.main import main
from kvbridge.errors import ConfigError
from kvbridge.spec import load_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", catalog.names())
def test_a_bare_name_loads_the_catalog_config(name: str) -> None:
    by_name = load_model(name)
    assert by_name.spec.name == name
    assert by_name.spec == load_model(catalog.CATALOG_DIR / name).spec


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="'llama-9'") as e:
        load_model("llama-9")
    assert all(name in str(e.value) for name in catalog.names())


def test_a_path_wins_over_the_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = json.loads(catalog.config_path("llama-3.1-8b").read_text())
    (tmp_path / "llama-3.1-8b").mkdir()
    (tmp_path / "llama-3.1-8b" / "config.json").write_text(
        json.dumps({**cfg, "num_hidden_layers": 2})
    )
    monkeypatch.chdir(tmp_path)
    assert len(load_model("llama-3.1-8b").spec.layers) == 2
    with pytest.raises(ConfigError, match="cannot read"):
        load_model("missing.json")  # a file name is never looked up in the catalog


def test_plan_takes_a_catalog_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "qwen3-8b", "--tokens", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "qwen3-8b"
    assert main(["plan", "--model", "qwen9", "--tokens", "100"]) == 2
    assert "known: deepseek-v2-lite" in capsys.readouterr().err


def test_the_package_data_covers_the_catalog() -> None:
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = globs["package-data"]["kvbridge.catalog"]
    files = {p for pat in patterns for p in catalog.CATALOG_DIR.glob(pat)}
    assert {catalog.config_path(n) for n in catalog.names()} <= files
