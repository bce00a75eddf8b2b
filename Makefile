# Two commands: `make demo` and `make test`. Each sets itself up from a fresh clone and is idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The install stamp is rebuilt when the metadata changes; torch is pinned first so the local CPU wheel
# (or the CUDA build already on a GPU machine) is used instead of a bare range pulling CUDA packages.
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python -m pytest -q --benchmark-disable -p no:cacheprovider

demo: $(STAMP)
	$(BIN)/python -m trainer demo

bench: $(STAMP)
	$(BIN)/python -m pytest bench -q --benchmark-only --benchmark-columns=min,median,max

clean:
	rm -rf $(VENV) runs .pytest_cache .benchmarks
