#!/usr/bin/env bash
# `make gpu-check`: run the check on a GPU machine without network. Its Python (3.12) and
# CUDA torch are used as they are; NIXL, msgspec and pyzmq come from the folder `make
# gpu-wheels` filled (GPU_WHEELS, default .gpu-wheels), unpacked into a temporary
# directory that, with src/, goes on PYTHONPATH (nothing is installed). The JSON lands in
# $OUT if set (the device tool brings $OUT back), else in build/, the table beside it.
#   PY (default python3), GPU_WHEELS, BUDGET_S (default 240), extra arguments: passed on.
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
for t in "$wheels"/*-site.tar.xz; do tar -xJf "$t" -C "$site"; done
for w in "$wheels"/*.whl; do "$py" -m zipfile -e "$w" "$site"; done
export PYTHONPATH="$site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export UCX_MODULES='^ib' NIXL_LOG_LEVEL=WARN
out=${OUT:-build}
mkdir -p "$out"
"$py" -m benchmarks.gpu_check --budget-s "${BUDGET_S:-240}" --json "$out/gpu_check.json" "$@" \
  | tee "$out/gpu_check.txt"
