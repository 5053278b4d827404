"""The CPU half of ``make gpu-check`` (``python -m benchmarks.gpu_check --cpu --quick``):
P and D ranks as processes, torch CPU tensors through the device code paths, NIXL on host
memory, P's pools in /dev/shm. Every method that ran compared every byte it moved with
the pattern and found none wrong; kvbridge's consumer chose the kernel mover (P's memory
mapped through /dev/shm); the vLLM-like path ran where vLLM would read the pairing and
says why not where it would not; the table was printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(290)]

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"kvbridge", "kernel", "copy", "direct", "staged", "contig", "vllm"}


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check") / "check.json"
    env = dict(os.environ, UCX_MODULES="^ib", PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--quick"]
    proc = subprocess.run(
        [*cmd, "--budget-s", "200", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=270,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_method_that_ran_verified_every_byte(check: tuple[dict, str]) -> None:
    report, _ = check
    assert len(report["cases"]) == 5
    for case in report["cases"]:
        assert not (case["error"] or case["skipped"] or case["errors"]), case["label"]
        assert {r["method"] for r in case["rows"]} == METHODS
        for row in case["rows"]:
            if row["ms"] is None:
                continue
            assert row["mismatches"] == 0 and row["timed"] >= 1, (case["label"], row)
            assert row["verified_bytes"] >= row["nbytes"] > 0, (case["label"], row)
        assert all(s["bad"] == 0 and s["checked"] > 0 for s in case["samples"])


def test_the_kernel_mover_ran_and_was_kvbridges_choice(check: tuple[dict, str]) -> None:
    report, _ = check
    for case in report["cases"]:
        rows = {r["method"]: r for r in case["rows"]}
        assert rows["kvbridge"]["detail"]["mover"] == "kernel", case["label"]
        assert "same node" in rows["kvbridge"]["detail"]["reason"]
        for method in ("kernel", "copy", "direct", "staged", "contig"):
            assert rows[method]["ms"] > 0, (case["label"], method)


def test_the_vllm_like_path_ran_where_vllm_reads_the_pairing(check: tuple[dict, str]) -> None:
    report, _ = check
    for case in report["cases"]:
        vllm = next(r for r in case["rows"] if r["method"] == "vllm")
        if "1→2 nhd" in case["label"]:  # NHD under a head split: vLLM refuses it
            assert vllm["ms"] is None and "HND" in vllm["na"]
            continue
        assert vllm["ms"] > 0 and vllm["descriptors"] > 0, case["label"]
        expected = {f"{op} t{n}" for op in ("READ", "WRITE") for n in (0, 4, 8)}
        assert set(vllm["variants"]) == expected


def test_the_table_was_printed(check: tuple[dict, str]) -> None:
    report, text = check
    assert "×contig" in text and "vLLM/x" in text and "verified" in text
    for case in report["cases"]:
        assert text.count(case["label"]) >= len(METHODS), case["label"]
    assert "target kernel ≤ 1.5× contig copy + 50 µs" in text
    assert "target kvbridge load ≥ 80× faster than vLLM-like (8k)" in text
