# Two entry points: `make serve` (set up, then run the main job) and `make test` (set up, then run the tests).
# `make test-hf4` re-runs the transformers-parity tests (marker hf_parity) against transformers 4.57 in .venv-hf4.
VENV ?= .venv
VENV_HF4 ?= .venv-hf4
HF4_VERSION ?= 4.57.6
PY := $(VENV)/bin/python
PYTHON ?= python3

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) -m vlserve.quickstart $(MODEL) -- $(SERVE_ARGS)

demo: $(VENV)/.installed
	$(PY) examples/offline_batch.py

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

$(VENV_HF4)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_HF4)
	$(VENV_HF4)/bin/python -m pip install -q --upgrade pip
	$(VENV_HF4)/bin/python -m pip install -q -e '.[dev]' 'transformers==$(HF4_VERSION)'
	touch $@

test-hf4: $(VENV_HF4)/.installed
	$(VENV_HF4)/bin/python -m pytest -q -m hf_parity $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) -m vlserve.bench.throughput

.PHONY: setup serve demo test test-hf4 bench
