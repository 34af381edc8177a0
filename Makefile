# Two entry points: `make serve` (set up, then run the main job) and `make test` (set up, then run the tests).
# `make test-hf4` re-runs the transformers-parity tests (marker hf_parity) against transformers 4.57 in .venv-hf4.
VENV ?= .venv
VENV_HF4 ?= .venv-hf4
HF4_VERSION ?= 4.57.6
PY := $(VENV)/bin/python
PYTHON ?= python3

# First run: a few minutes, with pip's own progress (one line per package it collects, downloads and installs).
$(VENV)/.installed: pyproject.toml
	@echo "[setup 1/3] creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "[setup 2/3] upgrading pip in $(VENV)"
	$(PY) -m pip install --upgrade pip
	@echo "[setup 3/3] installing vlserve and its dependencies (torch, transformers, ...) into $(VENV)"
	$(PY) -m pip install -e '.[dev,ray,kv-cpu]'
	@touch $@
	@echo "[setup] done: $(VENV) is ready (commands: $(VENV)/bin/python, $(VENV)/bin/vlserve)"

setup: $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) -m vlserve.quickstart $(MODEL) -- $(SERVE_ARGS)

demo: $(VENV)/.installed
	$(PY) examples/offline_batch.py

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff's linter and formatter as pyproject.toml configures them (`$(PY) -m ruff format .` applies the format)
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Chromium + chromedriver for the browser tests (tests/api/test_playground.py, which skip without them): nothing to
# do when both are on PATH; otherwise apt-get installs Debian's packages (as root, or through sudo).
BROWSER_BINS := chromium chromium-browser google-chrome google-chrome-stable
browser:
	@if command -v chromedriver >/dev/null && for b in $(BROWSER_BINS); do command -v $$b && break; done | grep -q .; then \
	    echo "browser: $$(for b in $(BROWSER_BINS); do command -v $$b && break; done) and $$(command -v chromedriver)"; \
	elif command -v apt-get >/dev/null; then \
	    sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq chromium chromium-driver; \
	else \
	    echo "browser: no apt-get here; install Chromium and chromedriver by hand (the browser tests skip without them)"; \
	fi

# The system library Mooncake's transfer engine (the `kv-cpu` extra) links against: libibverbs.so.1, from Debian's
# libibverbs1; without it `import mooncake.engine` fails and the KV-transfer tests skip (or fail under
# VLSERVE_REQUIRE_MOONCAKE=1). Nothing to do when the loader finds it.
kv-libs:
	@if ldconfig -p | grep -q 'libibverbs.so.1 '; then \
	    echo "kv-libs: libibverbs.so.1 is installed"; \
	elif command -v apt-get >/dev/null; then \
	    sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq libibverbs1; \
	else \
	    echo "kv-libs: no apt-get here; install libibverbs (rdma-core) by hand (the KV-transfer tests skip without it)"; \
	fi

$(VENV_HF4)/.installed: pyproject.toml
	@echo "[setup 1/3] creating $(VENV_HF4) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV_HF4)
	@echo "[setup 2/3] upgrading pip in $(VENV_HF4)"
	$(VENV_HF4)/bin/python -m pip install --upgrade pip
	@echo "[setup 3/3] installing vlserve with transformers $(HF4_VERSION) into $(VENV_HF4)"
	$(VENV_HF4)/bin/python -m pip install -e '.[dev]' 'transformers==$(HF4_VERSION)'
	@touch $@

test-hf4: $(VENV_HF4)/.installed
	$(VENV_HF4)/bin/python -m pytest -q -m hf_parity $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) -m vlserve.bench.throughput

# `make gpu-check OUT=DIR`: on a CUDA machine, every GPU test and figure in one run (~15 minutes; split
# it with GPU_CHECK_ARGS="--only STEP ..." to fit a lease, see benchmarks/gpu_check.py) into
# DIR/report.md + DIR/report.json (+ log.txt); DRY_RUN=1 runs the same script on CPU with tiny sizes (CI does).
# It needs no venv: on a GPU machine it runs the system python3 (its torch / triton / transformers) and installs
# what else it needs from ./wheelhouse, which `make gpu-wheels` fills here (Python 3.12 manylinux wheels, pinned to
# this venv's versions; ~15 MB) and which must travel with the working tree.
OUT ?= gpu-report
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
# pip matches platform tags exactly: every glibc from 2.17 to 2.39 (the lent GPU image's Python 3.12.3 is Ubuntu 24.04's)
WHEEL_PLATFORMS := $(foreach n,$(shell seq 39 -1 17),--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64
gpu-check:
	$(GPU_PY) -m benchmarks.gpu_check --out $(OUT) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(GPU_CHECK_ARGS)

gpu-wheels: $(VENV)/.installed
	rm -rf wheelhouse && mkdir -p wheelhouse
	$(PY) -m benchmarks.gpu_check --wheel-requirements > wheelhouse/requirements.txt
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    $(WHEEL_PLATFORMS) -d wheelhouse -r wheelhouse/requirements.txt
	@du -sh wheelhouse

.PHONY: setup serve demo test lint browser kv-libs test-hf4 bench quant-fixtures quant-tools gpu-check gpu-wheels

# `make quant-fixtures` remakes tests/fixtures/quant/ with the real tools, each in its own venv because
# their torch / transformers pins exclude each other and the main venv's: llm-compressor (compressed-tensors
# fixtures) in .venv-quant, GPTQModel (GPTQ / AWQ fixtures, on the CPU; it JIT-compiles
# its CPU packing extension with the system g++ on first use) in .venv-gptq.
# QUANT_ARGS passes options to `python -m tools.make_quant_fixtures`, e.g. QUANT_ARGS='--only ct_w4a16'.
QUANT_VENV ?= .venv-quant
GPTQ_VENV ?= .venv-gptq

$(QUANT_VENV)/.installed:
	$(PYTHON) -m venv $(QUANT_VENV)
	$(QUANT_VENV)/bin/python -m pip install --upgrade pip
	$(QUANT_VENV)/bin/python -m pip install torch==2.14.0 torchvision==0.29.0 llmcompressor==0.14.0.1 \
	    compressed-tensors==0.19.0 transformers==5.17.0 msgspec
	$(QUANT_VENV)/bin/python -m pip install -e . --no-deps
	@touch $@

$(GPTQ_VENV)/.installed:
	$(PYTHON) -m venv $(GPTQ_VENV)
	$(GPTQ_VENV)/bin/python -m pip install --upgrade pip
	$(GPTQ_VENV)/bin/python -m pip install torch==2.14.1 torchvision==0.29.1 gptqmodel==7.7.0 transformers==5.24.0 msgspec
	$(GPTQ_VENV)/bin/python -m pip install -e . --no-deps
	@touch $@

quant-fixtures: $(QUANT_VENV)/.installed $(GPTQ_VENV)/.installed
	$(QUANT_VENV)/bin/python -m tools.make_quant_fixtures --gptq-python $(GPTQ_VENV)/bin/python $(QUANT_ARGS)

# `make quant-tools`: only the llm-compressor venv (.venv-quant), for examples/quantize_llmcompressor.py (README).
quant-tools: $(QUANT_VENV)/.installed
