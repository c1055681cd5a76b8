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

# `make test-compat`: the whole suite on the HPC site's stack (torch 2.3, numpy 1.26, scipy 1.11,
# held by constraints-compat.txt as a site holds them). torch 2.3.0 from PyPI is a CUDA build that
# runs on the CPU: about 3 GB to download the first time.
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
# The site's interpreter is Python 3.10: use one where it is installed (pyenv carries one on these
# machines), else python3; the recipe prints which.
# (A pyenv shim answers `command -v` for a version it will not run: ask each candidate to run.)
COMPAT_PYTHON ?= $(shell for p in python3.10 $(HOME)/.pyenv/versions/3.10*/bin/python3.10; do \
	$$p -c '' >/dev/null 2>&1 && { command -v $$p; exit 0; }; done; echo $(PYTHON))
# The site guide's MONAI for torch 2.3 (MONAI 1.6 needs torch >= 2.8); it needs numpy < 2.
COMPAT_MONAI_SPEC ?= monai==1.4.0

# `make test-openvino`: the tests of the OpenVINO backend with OpenVINO and NNCF installed, in a
# venv of their own that sees .venv's packages (a .pth file), so `make test` stays PyTorch-only
# and no pip run touches .venv's torch.
OPENVINO_VENV ?= .venv-openvino
OPENVINO_PY := $(OPENVINO_VENV)/bin/python
OPENVINO_TESTS ?= tests/test_openvino.py

# `make gpu-check`: on one CUDA GPU, within 10 minutes, the CUDA tests, a short convergence run, the
# throughput ladder and the predicted MLPerf time to train, their numbers in $(GPU_CHECK_DIR)/summary.md;
# without CUDA its CPU smoke path (tiny shapes, under a minute), which says so.
GPU_CHECK_DIR ?= gpu_check

.PHONY: setup demo demo-convergence test test-slow test-all test-compat test-deploy test-deploy-jobs test-openvino gpu-check clean

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

# The same chain, training until the demo's target (mean Dice 0.6) or 60 epochs: tens of minutes
# on 2 CPU cores, minutes on a GPU.
demo-convergence: setup
	DEMO_EPOCHS=60 bash scripts/demo.sh "$(PY)" "$(DEMO_DIR)"

# The suite but the tests marked slow: ten minutes at most on an idle 2-core machine (CI runs it first).
test: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

# The tests marked slow (torchrun, convergence, benchmark smoke runs, the larger end-to-end runs):
# CI runs them after `make test`, so every test runs somewhere.
test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS) tests

# Both in one pytest run (what `make test` was before the slow set moved out).
test-all: setup
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

$(COMPAT_VENV)/.installed: requirements.txt requirements-test.txt constraints-compat.txt
	@echo "test-compat: $$($(COMPAT_PYTHON) --version) ($(COMPAT_PYTHON))"
	$(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet -c constraints-compat.txt torch numpy scipy
	$(COMPAT_PY) -m pip install --quiet -c constraints-compat.txt -r requirements.txt -r requirements-test.txt
	$(COMPAT_PY) -m pip install --quiet --no-deps "$(COMPAT_MONAI_SPEC)" || echo "MONAI oracle not installed: its tests will skip"
	touch $@

test-compat: $(COMPAT_VENV)/.installed
	@echo "test-compat on $$($(COMPAT_PY) --version), torch $$($(COMPAT_PY) -c 'import torch; print(torch.__version__)')"
	$(COMPAT_PY) -m pytest -q $(PYTEST_ARGS) tests

# `make test-deploy`: the deployment for real (root; see README "Run on a cluster"): the SLURM
# jobs under a two-node SLURM started on this machine (scripts/cluster/start.sh), the
# container image built on a stand-in site base and run (scripts/container/build_and_check.sh).
# tests/deploy is not collected by `make test`.
test-deploy: setup
	UNET3D_DEPLOY_TESTS=1 $(PY) -m pytest -q -rs $(PYTEST_ARGS) tests/deploy

# `make test-deploy-jobs`: the SLURM job tests only (a quicker check while editing the job
# scripts; CI runs the whole `make test-deploy`).
test-deploy-jobs: setup
	UNET3D_DEPLOY_TESTS=1 $(PY) -m pytest -q -rs $(PYTEST_ARGS) tests/deploy/test_slurm_jobs.py

$(OPENVINO_VENV)/.installed: $(VENV)/.installed requirements-openvino.txt
	$(PY) -m venv $(VENV_FLAGS) $(OPENVINO_VENV)
	$(OPENVINO_PY) -c "import site" && $(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(OPENVINO_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/base_venv.pth"
	$(OPENVINO_PY) -m pip install --quiet -r requirements-openvino.txt || echo "OpenVINO not installed: its tests will skip"
	touch $@

test-openvino: $(OPENVINO_VENV)/.installed
	@echo "test-openvino: $$($(OPENVINO_PY) -c 'import openvino; print("OpenVINO", openvino.__version__)' 2>/dev/null || echo 'no OpenVINO')"
	$(OPENVINO_PY) -m pytest -q $(PYTEST_ARGS) $(OPENVINO_TESTS)

gpu-check: setup
	$(PY) -m benchmarks.gpu_check --out "$(GPU_CHECK_DIR)"

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(OPENVINO_VENV) $(DEMO_DIR) .pytest_cache
