# Two entry points: `make serve` (set up, then run the main job) and `make test` (set up, then run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) -m vlserve.testing.quickstart $(MODEL) -- $(SERVE_ARGS)

demo: $(VENV)/.installed
	$(PY) examples/offline_batch.py

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) -m vlserve.bench.throughput

.PHONY: setup serve demo test bench
