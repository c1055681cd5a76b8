# Quick start: `make demo` and `make test` work on a fresh machine with python3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default; a site with its own torch can `make setup TORCH_SPEC=` (keeps it).
TORCH_SPEC ?= torch==2.13.0
# `make setup VENV_FLAGS=--system-site-packages TORCH_SPEC=` reuses a site's own torch build.
VENV_FLAGS ?=
MONAI_SPEC ?= monai==1.6.1
DEMO_DIR ?= demo_work
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@if ! $(PY) -c "import torch" 2>/dev/null && [ -n "$(TORCH_SPEC)" ]; then \
		echo "installing $(TORCH_SPEC)"; $(PY) -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install --quiet --no-deps "$(MONAI_SPEC)" || echo "MONAI oracle not installed: its tests will skip"
	touch $@

demo: setup
	bash scripts/demo.sh "$(PY)" "$(DEMO_DIR)"

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

# Everything but the tests marked slow (torchrun, convergence, benchmark smoke runs).
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
