#!/usr/bin/env bash
# `make gpu-check`: run the check on a GPU machine without network. Its Python (3.12) and
# CUDA torch are used as they are; NIXL, msgspec and pyzmq come from the folder `make
# gpu-wheels` filled (GPU_WHEELS, default .gpu-wheels), unpacked by Python (tarfile,
# zipfile: no xz binary needed) into a temporary directory that, with src/, goes on
# PYTHONPATH (nothing is installed). First, where pytest and hypothesis import, the unit
# tests of the device copies run on CUDA twice, Triton on (with the Triton kernel's own
# tests: ~40 small compiles on a cold cache) and off (UNIT_TIMEOUT_S each, default 90;
# UNIT_TESTS=0 skips them), their result lines in $OUT/unit_*.txt; then the kernel's two
# forms side by side (benchmarks.bench_triton_forms, $OUT/triton_forms.txt), and vLLM's GPU
# caches moved through the connector's worker side ($OUT/vllm_caches.txt). The JSON
# lands in $OUT if set (the device tool brings $OUT back), else in build/, the table beside.
#   PY (default python3), GPU_WHEELS, BUDGET_S (default 260), extra arguments: passed on.
# Worst case with the defaults: unpack ~10 s + unit tests 2 x 100 s + the kernel forms'
# benchmark ~10 s + the vLLM-caches phase ~5 s (45 s at most) + 260 s + 45 s grace ~ 530 s
# (570 s if that phase hangs; the device tool allows 600 s a call).
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PY:-python3}
wheels=${GPU_WHEELS:-.gpu-wheels}
if ! ls "$wheels"/*-site.tar.xz >/dev/null 2>&1; then
  echo "gpu-check: no NIXL tarball in $wheels/ (run 'make gpu-wheels' where there is network)" >&2
  exit 2
fi
site=$(mktemp -d "${TMPDIR:-/tmp}/kvbridge-gpu-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
unpack=0
"$py" - "$site" "$wheels"/*-site.tar.xz <<'PYEOF' || unpack=$?
import sys, tarfile
for path in sys.argv[2:]:
    try:
        tar = tarfile.open(path)  # xz through Python's lzma module
    except tarfile.TarError as e:  # e.g. a Python built without lzma (ReadError)
        sys.exit(f"gpu-check: {path}: {e}")
    with tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(sys.argv[1], filter="data")
        else:
            tar.extractall(sys.argv[1])
PYEOF
if [ "$unpack" != 0 ]; then  # last resort: tar with an xz binary, where there is one
  for t in "$wheels"/*-site.tar.xz; do tar -xJf "$t" -C "$site"; done
fi
for w in "$wheels"/*.whl; do
  if [ -e "$w" ]; then "$py" -m zipfile -e "$w" "$site"; fi
done
export PYTHONPATH="$site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export UCX_MODULES='^ib' NIXL_LOG_LEVEL=WARN
out=${OUT:-build}
mkdir -p "$out"

unit_tests() {  # the device copies' unit tests on CUDA, Triton on and off; never fails
  local limit=${UNIT_TIMEOUT_S:-90} run=() t rc tests
  if ! "$py" -c 'import pytest' 2>/dev/null; then
    echo "gpu-check: pytest not available: unit tests on CUDA skipped"
    return 0
  fi
  if ! "$py" -c 'import hypothesis' 2>/dev/null; then
    echo "gpu-check: hypothesis not available: unit tests on CUDA skipped"
    return 0
  fi
  if command -v timeout >/dev/null; then run=(timeout -k 10 "$limit"); fi
  for t in 1 0; do
    rc=0 tests=(tests/unit/test_device_copies.py)
    if [ "$t" = 1 ]; then tests+=(tests/unit/test_triton_copy.py); fi
    log="$out/unit_device_copies_triton$t.log"
    KVBRIDGE_TRITON=$t ${run[@]+"${run[@]}"} "$py" -m pytest -q -p no:cacheprovider -rfEs \
      "${tests[@]}" >"$log" 2>&1 || rc=$?
    { echo "gpu-check: unit tests, KVBRIDGE_TRITON=$t: exit $rc$([ "$rc" = 124 ] && echo \
        " (timed out after $limit s)")"
      grep -E '^(FAILED|ERROR|SKIPPED)' "$log" | head -n 20 || true
      tail -n 1 "$log"
    } | tee "$out/unit_device_copies_triton$t.txt"
  done
}
if [ "${UNIT_TESTS:-1}" != 0 ]; then unit_tests; fi
# the copy kernel's two forms, GPU time side by side (a few seconds; never fails the check)
forms=() vlimit=()
if command -v timeout >/dev/null; then forms=(timeout -k 5 60) vlimit=(timeout -k 5 45); fi
${forms[@]+"${forms[@]}"} "$py" -m benchmarks.bench_triton_forms 2>&1 | tee "$out/triton_forms.txt" || true

# vLLM's GPU caches (benchmarks/gpu_check/vllm_caches.py: caches as vLLM 0.32 allocates
# them in every KVCacheLayout, MLA, Mamba SD/DS, one request each through the connector's
# worker-side code, every byte compared; ~5 s, at most 45 s); a failure fails the command
vllm_rc=0
${vlimit[@]+"${vlimit[@]}"} "$py" -m benchmarks.gpu_check.vllm_caches 2>&1 \
  | tee "$out/vllm_caches.txt" || vllm_rc=$?

check_rc=0
"$py" -m benchmarks.gpu_check --budget-s "${BUDGET_S:-260}" --json "$out/gpu_check.json" "$@" \
  | tee "$out/gpu_check.txt" || check_rc=$?
if [ "$check_rc" != 0 ]; then exit "$check_rc"; fi
if [ "$vllm_rc" != 0 ]; then
  echo "gpu-check: the vLLM-caches phase failed (exit $vllm_rc): $out/vllm_caches.txt" >&2
  exit 1
fi
