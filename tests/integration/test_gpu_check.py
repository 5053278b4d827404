"""The CPU half of ``make gpu-check`` (``python -m benchmarks.gpu_check --cpu --quick``):
P and D ranks as processes, torch CPU tensors through the device code paths, NIXL on host
memory, P's pools in /dev/shm. Every method that ran compared every byte it moved with
the pattern and found none wrong; kvbridge's consumer chose the kernel mover (P's memory
mapped through /dev/shm), and, as across nodes with nothing of P mapped, chose a NIXL
mover by its own measurement; the vLLM-like path ran where vLLM would read the pairing and
says why not where it would not; the ordering case ran once (a late KV write: stale bytes
without ``written``, exact with it); every D rank reported its Triton facts; the table was
printed. Without processes: the GPU verdicts (a Triton fall back, a kvbridge load that
did not take the kernel mover) fail the case there and stay remarks on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.gpu_check import facts
from benchmarks.gpu_check.cases import QUICK_CASES
from benchmarks.gpu_check.driver import CaseResult, Sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(290)]

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"kvbridge", "queued", "nixl", "kernel", "copy", "direct", "staged", "contig", "vllm"}


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
    assert text.count("kvbridge stages, median ms: queue") == len(report["cases"])
    assert text.count("kvbridge cold: first on the pair") == len(report["cases"])
    assert text.count("(prepared ahead: ") == len(report["cases"])  # Consumer.prepare
    assert all(c["prepare_ms"] > 0 for c in report["cases"])
    for case in report["cases"]:
        k = next(r for r in case["rows"] if r["method"] == "kvbridge")
        # warm loads started on the rank's thread; the same loads queued whole, in turn
        assert {"queue", "plan", "handoff", "lease", "transfer"} <= k["stages_ms"].keys(), k
        assert k["first_pair_ms"] > 0 and k["first_request_ms"] > 0, k
        q = next(r for r in case["rows"] if r["method"] == "queued")
        assert q["detail"]["mover"] == "kernel" and q["ms"] > 0, q
        assert "handoff" not in q["stages_ms"] and q["stages_ms"]["queue"] > 0, q
    assert text.count("kvbridge queued stages, median ms: queue") == len(report["cases"])
    assert "target kvbridge load ≥ 80× faster than vLLM-like (8k)" in text


def test_the_nixl_only_row_is_the_connectors_own_choice_over_nixl(check) -> None:
    """As across nodes: D maps nothing of P, AUTO measures READ and WRITE per pair and
    the load goes over NIXL, byte-exact, its choice and why in the row."""
    report, text = check
    for case in report["cases"]:
        n = next(r for r in case["rows"] if r["method"] == "nixl")
        assert n["ms"] > 0 and n["mismatches"] == 0 and n["timed"] >= 1, n
        assert n["detail"]["mover"] in ("pull", "push"), n
        reason = n["detail"]["reason"]
        assert reason.startswith("auto: ") and "no kernel mover: D maps nothing" in reason, n
        assert ("priced" in reason or "never" in reason) and "µs/desc" in reason, n
        assert n["descriptors"] > 0 and "transfer" in n["stages_ms"], n
    assert text.count("kvb. NIXL only") == len(report["cases"])
    assert text.count("kvbridge NIXL only stages, median ms: queue") == len(report["cases"])


def test_the_ordering_case_ran_once_and_written_kept_the_bytes(check: tuple[dict, str]) -> None:
    report, text = check
    ran = [c for c in report["cases"] if c["ordering"].get("variants")]
    assert len(ran) == 1, [c["ordering"] for c in report["cases"]]
    o = ran[0]["ordering"]
    by = {v["variant"]: v for v in o["variants"]}
    assert set(by) == {"no wait", "written(event)"}
    assert by["written(event)"]["mismatches"] == 0 and by["written(event)"]["checked"] > 0
    assert by["no wait"]["mismatches"] > 0, o  # the thread writes only after D's load
    assert all(v["mover"] == "kernel" for v in o["variants"])
    assert "hazard reproduced" in o["note"] and "ordering, late KV write (CPU" in text


def test_every_d_rank_reported_its_triton_facts(check: tuple[dict, str]) -> None:
    report, text = check
    for case in report["cases"]:
        assert [f["rank"] for f in case["triton"]] == list(range(case["case"]["d_tp"]))
        for f in case["triton"]:
            assert {"enabled", "imports", "failed", "built", "ran"} <= f.keys()
            assert not f["cuda"] and f["verdict"].startswith("n/a on CPU"), f
        assert case["remarks"] == [], case["label"]  # every load took the kernel mover
    assert "triton D0: n/a on CPU" in text


def _run(gpu: bool, movers: tuple[str, ...] = ("kernel",), shares: bool = True) -> Any:
    """The parts of a :class:`CaseRun` the verdicts read."""
    res = CaseResult(QUICK_CASES[0])
    for i, mover in enumerate(movers):
        detail: dict[str, object] = {"mover": mover, "reason": f"why {mover}"}
        res.samples.append(Sample("kvbridge", "pull", i, 1, 0.001, 1, 1, 0, 0, 0, 1, detail))
    info = SimpleNamespace(shares=[object()] if shares else [])
    return SimpleNamespace(
        res=res, opts=SimpleNamespace(gpu=gpu), ready=([SimpleNamespace(info=info)], [])
    )


def _triton(**kw: object) -> dict[str, object]:
    f = dict(rank=0, cuda=True, enabled=True, imports=True, import_error="", version="3.5",
             known=True, failed=False, built=True, ran=True, warnings=[])  # fmt: skip
    return {**f, **kw}


def test_a_triton_fall_back_fails_on_the_gpu_only() -> None:
    run = _run(gpu=True)
    facts.check_triton(run, [_triton(), _triton(rank=1, failed=True, ran=False, warnings=["x"])])
    assert "D1: FELL BACK to torch copies (x)" in run.res.errors["triton"]
    assert run.res.triton[0]["verdict"].startswith("fused kernel ran (triton 3.5)")
    for off in (_triton(enabled=False, built=False, ran=False), _triton(cuda=False)):
        run = _run(gpu=True)
        facts.check_triton(run, [off])
        assert not run.res.errors, off


def test_the_kernel_forms_are_reported_and_a_fixed_form_failure_fails() -> None:
    ready = [{"row": 4096, "dtype": "int64", "device": "cuda:0", "compile_s": 0.412}]
    good = {"launches": {"generic": 4, "fixed": 9}, "fixed_ready": ready}
    run = _run(gpu=True)
    facts.check_triton(run, [_triton(kernels=good)])
    assert not run.res.errors
    assert run.res.triton[0]["verdict"] == (
        "fused kernel ran (triton 3.5); copies: 4 generic, 9 fixed-length"
        " (1 lengths compiled: 4096×int64; slowest compile 412 ms)"
    )
    run = _run(gpu=True)
    facts.check_triton(run, [_triton(kernels={**good, "fixed_failed": True})])
    assert "FIXED-LENGTH FORM FAILED" in run.res.errors["triton"]


def test_a_kvbridge_load_off_the_kernel_mover_fails_on_the_gpu() -> None:
    run = _run(gpu=True, movers=("kernel", "pull"))
    facts.check_mover(run)
    assert "request 1 took 'pull', not the kernel mover: why pull" in run.res.errors["kvbridge"]
    for gpu, shares in ((False, True), (True, False)):  # CPU, or P shares nothing: a remark
        run = _run(gpu=gpu, movers=("push",), shares=shares)
        facts.check_mover(run)
        assert not run.res.errors and "why push" in run.res.remarks[0]
