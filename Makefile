# kiln: `make demo` sets up and runs the main job; `make test` sets up, lints and runs every test (CI's command,
# which also builds the wheel and runs it from a fresh venv, and builds the manual with mkdocs --strict); `make
# test-fast` runs the engine-free tests (marked in tests/conftest.py) in under a minute; `make wheel` builds what
# users install (dist/, kernels prebuilt); `make docs` regenerates docs/build-config.md and builds the manual.
# Setup is idempotent: the venv is rebuilt only when pyproject.toml or setup.py (the package layout) changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: setup demo test test-fast lint wheel docs clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,triton]'
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

# the kernels are compiled into the wheel against .venv's torch (no isolated build environment to make; a plain
# `pip install .` gets them too, from pyproject.toml's build requirements: see setup.py)
wheel: setup
	$(PY) -m pip wheel -q --no-build-isolation --no-deps -w dist .

# the BuildConfig reference page is generated from the dataclass; the site goes to build/site
docs: setup
	$(PY) scripts/build_config_reference.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) work build dist .pytest_cache .hypothesis
