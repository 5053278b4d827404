"""``make demo-vllm``'s work folder: a temporary one is removed after a successful run
unless ``--keep``, kept when the run fails; a ``--workdir`` is never removed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.vllm_demo import run_in


def _fill(work: Path, rc: int = 0) -> int:
    (work / "llama").mkdir()
    (work / "llama" / "model.safetensors").write_bytes(b"x" * 4096)
    (work / "p.log").write_text("log\n")
    return rc


def test_temporary_folder_is_removed_after_success(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Path] = []
    assert run_in(None, False, lambda w: seen.append(w) or _fill(w)) == 0
    assert not seen[0].exists()
    assert "kept" not in capsys.readouterr().out


def test_temporary_folder_is_kept_when_the_run_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A mismatch or a dead server returns 1: the logs stay, and the folder is named."""
    seen: list[Path] = []
    assert run_in(None, False, lambda w: seen.append(w) or _fill(w, rc=1)) == 1
    try:
        assert (seen[0] / "p.log").read_text() == "log\n"
        assert f"kept {seen[0]}" in capsys.readouterr().out
    finally:
        shutil.rmtree(seen[0])


def test_temporary_folder_is_kept_when_the_run_raises(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[Path] = []

    def run(work: Path) -> int:
        seen.append(work)
        _fill(work)
        raise SystemExit("demo: server did not answer")

    with pytest.raises(SystemExit):
        run_in(None, False, run)
    try:
        assert (seen[0] / "p.log").exists()
        assert f"kept {seen[0]}" in capsys.readouterr().out
    finally:
        shutil.rmtree(seen[0])


def test_temporary_folder_is_removed_on_ctrl_c() -> None:
    seen: list[Path] = []

    def run(work: Path) -> int:
        seen.append(work)
        _fill(work)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_in(None, False, run)
    assert not seen[0].exists()


def test_keep_leaves_the_folder(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Path] = []
    assert run_in(None, True, lambda w: seen.append(w) or _fill(w)) == 0
    try:
        assert (seen[0] / "p.log").read_text() == "log\n"
        assert f"kept {seen[0]}" in capsys.readouterr().out
    finally:
        shutil.rmtree(seen[0])


def test_given_workdir_is_never_removed(tmp_path: Path) -> None:
    def run(work: Path) -> int:
        assert work == tmp_path
        _fill(work)
        raise RuntimeError("server failed")

    with pytest.raises(RuntimeError):
        run_in(tmp_path, False, run)
    assert (tmp_path / "p.log").exists()


def test_keep_flag_is_offered(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import vllm_demo as demo

    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    assert "--keep  " in capsys.readouterr().out
