"""``make demo-vllm``'s work folder: a temporary one is removed at the end, error
included, unless ``--keep``; a ``--workdir`` is never removed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvbridge.integrations.vllm.demo import workdir


def _fill(work: Path) -> None:
    (work / "llama").mkdir()
    (work / "llama" / "model.safetensors").write_bytes(b"x" * 4096)
    (work / "p.log").write_text("log\n")


def test_temporary_folder_is_removed() -> None:
    with workdir(None, keep=False) as work:
        _fill(work)
        assert work.is_dir()
    assert not work.exists()


def test_temporary_folder_is_removed_on_error() -> None:
    seen: list[Path] = []
    with pytest.raises(RuntimeError), workdir(None, keep=False) as work:
        seen.append(work)
        _fill(work)
        raise RuntimeError("server failed")
    assert not seen[0].exists()


def test_keep_leaves_the_folder(capsys: pytest.CaptureFixture[str]) -> None:
    with workdir(None, keep=True) as work:
        _fill(work)
    try:
        assert (work / "p.log").read_text() == "log\n"
        assert f"kept {work}" in capsys.readouterr().out
    finally:
        shutil.rmtree(work)


def test_given_workdir_is_never_removed(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), workdir(tmp_path, keep=False) as work:
        assert work == tmp_path
        _fill(work)
        raise RuntimeError("server failed")
    assert (tmp_path / "p.log").exists()


def test_keep_flag_is_offered(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge.integrations.vllm import demo

    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    assert "--keep  " in capsys.readouterr().out
