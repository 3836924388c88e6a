# The README's two commands. Both create .venv and install what they need on a fresh machine.
#   make run   start the gateway (router + embedded reference replicas) and print how to call it
#   make test  install with dev extras, build the native extension, lint, and run the tests (then the slow ones)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The reference engine needs torch. 2.13.0 is the CPU build this project is developed on; on a GPU machine
# point TORCH_SPEC at the build you want (any torch >= 2.4 works), or install torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: run test install install-dev build lint pytest pytest-slow proto bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.torch: | $(VENV)/bin/python
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	touch $@

# Build the package (and the psrl._kvx extension) in place; CUDA sources compile when nvcc is found.
build: $(VENV)/.torch
	$(PIP) install --quiet "scikit-build-core>=0.10" "pybind11>=2.12"
	$(PIP) install --quiet --no-build-isolation -e .

install: build

install-dev: $(VENV)/.torch
	$(PIP) install --quiet "scikit-build-core>=0.10" "pybind11>=2.12"
	$(PIP) install --quiet --no-build-isolation -e ".[dev]"

run: install
	$(PY) -m psrl.gateway

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy psrl

pytest: install-dev
	$(PY) -m pytest $(PYTEST_ARGS)

# Second stage: the tests marked slow (minutes each; the default run deselects them).
pytest-slow: install-dev
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test: lint pytest pytest-slow

proto: install-dev
	$(PY) proto/gen_stubs.py

bench: $(VENV)/.torch
	$(PIP) install --quiet "scikit-build-core>=0.10" "pybind11>=2.12"
	$(PIP) install --quiet --no-build-isolation -e ".[bench]"
	$(PY) bench/kv_migrate.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
