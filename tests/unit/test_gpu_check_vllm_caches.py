"""gpu-check's vLLM-caches phase on the CPU (``python -m benchmarks.gpu_check.vllm_caches
--cpu``): P and D caches as vLLM 0.32 allocates them (pinned by
``test_gpu_check_vllm_alloc.py``), in every layout, with kernel blocks, MLA and Mamba
state SD/DS, one request moved through the vLLM integration's worker-side code, with vLLM
not importable in the phase's process (as on the GPU machine): every byte of D's
allocations must equal an expectation made through vLLM's views. The controls change one
byte of D inside the request's blocks, or outside them, after the load: the check sees it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import vllm_caches
from benchmarks.gpu_check.vllm_cases import CASES
from benchmarks.gpu_check.vllm_expect import storage

ROOT = Path(__file__).resolve().parents[2]


def test_every_case_is_byte_exact_without_vllm() -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check.vllm_caches", "--cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "vLLM importable: no" in out
    assert out.count("byte-exact") == 2 * len(CASES), out  # each from vLLM's blocks, parked
    assert out.count(", parked") == len(CASES), out
    assert out.count("device memory") == 2 * len(CASES), out  # registered as on a GPU
    assert "vllm-caches: 0 failed" in out


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_DEVICE_ON_CPU", "1")


@pytest.mark.parametrize("inside", [True, False])
def test_a_changed_byte_of_d_is_caught(on_cpu: None, inside: bool) -> None:
    """After the load, one byte of D rank 0 changes: token 0, head 0 of the request's first
    block in layer 0 (a byte the load wrote), or the allocation's first byte (block 0,
    vLLM's null block, which no request holds)."""
    case = next(c for c in CASES if c.kind == "kv" and c.d.tp == 1)
    seen: list[int] = []

    def tamper(d: vllm_caches.Engine, ids: list[int]) -> None:
        t = d.caches[0]["m.layers.0.attn"]
        split = t.shape[0] // vllm_caches.NB
        at = (t.storage_offset() + ids[0] * split * t.stride(0)) * t.element_size()
        at = int(at) if inside else 0
        storage(t)[at] ^= 0x5A
        seen.append(at)

    out = vllm_caches.run_case(case, torch.device("cpu"), tamper)
    assert seen and not out.ok and out.mismatched == 1, out
    assert vllm_caches.run_case(case, torch.device("cpu")).ok
