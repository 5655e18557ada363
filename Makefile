# kiln: `make demo` sets up and runs the main job; `make test` sets up, lints and runs every test (CI's command);
# `make test-fast` runs the engine-free tests (marked in tests/conftest.py) in under a minute.
# Setup is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: setup demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) scripts/demo.py

lint: setup
	$(PY) -m ruff check .

test: setup lint
	$(PY) -m pytest -q -n 2 --dist loadgroup

test-fast: setup
	$(PY) -m pytest -q -n 2 -m fast

clean:
	rm -rf $(VENV) work .pytest_cache .hypothesis
