# The two commands of the README:
#   make demo   set up, then run the built-in demo model (or MODEL=dir; ARGS="--max-tokens 128" passes flags)
#   make test   set up with the test extras, then run the test suite
#
# TORCH picks the PyTorch wheel installed before the package. The default pin
# resolves to the CPU build on CPU machines set up like ours; a CUDA user passes
# e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# or installs torch into .venv first (an installed torch is kept).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
MODEL ?=
ARGS ?=
# the test run's junit report (every skip and its reason; .ci/run fails on a skip it does not allow)
TEST_REPORT ?= .pytest_cache/junit.xml

.PHONY: setup setup-test demo test bench clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e .
	$(PY) -m expertcache.kernels
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test

demo: setup
	$(VENV)/bin/expertcache demo $(MODEL) $(ARGS)

test: setup-test
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -rs --junitxml=$(TEST_REPORT)

clean:
	rm -rf $(VENV)
