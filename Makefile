# labkit: the two quick-start commands are `make demo` and `make test`.
# Both create .venv (Python 3.11+) if needed. Without a GPU (no nvidia-smi), torch is the CPU
# build of 2.13.0: taken from the local wheel cache if pip has one, else from PyTorch's CPU
# index. With a GPU, pip takes the CUDA build of the same release from PyPI.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: venv demo test lab bench browser cluster-tools cluster-clean clean-venv
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PIP) install -q "torch==$(TORCH_VERSION)"
else
	$(PIP) install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" --index-url $(TORCH_CPU_INDEX)
endif
	$(PIP) install -q -e ".[test]"
	touch $@

demo: venv
	$(VENV)/bin/labkit demo

# Two pytest-xdist workers: tests/conftest.py keeps each file's tests on one worker (the demo's two
# files and the real-cluster files each on one) and runs a test marked `exclusive` (a bound on
# seconds, a timeout, a slowed rank measured against the others) with no other test beside it.
# PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
test: venv browser cluster-tools
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope

# Real Slurm (two virtual nodes), munge, Open MPI and network namespaces for the real-cluster
# tests (tests/cluster/test_real_cluster.py, tests/cluster/test_real_hosts.py; labkit/testing/realcluster.py
# starts and stops the daemons by pid from pytest fixtures). Debian's packages, installed only
# when missing and when running as root; otherwise those tests are skipped with one line.
CLUSTER_TOOLS := slurmctld slurmd sbatch munged mpiexec ip nsenter unshare
CLUSTER_PACKAGES := slurmctld slurmd slurm-client munge openmpi-bin libopenmpi-dev iproute2 util-linux
cluster-tools:
	@missing=; for t in $(CLUSTER_TOOLS); do PATH="$$PATH:/usr/sbin:/sbin" command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	[ -z "$$missing" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(CLUSTER_PACKAGES); } || \
	  echo "missing$$missing (needs root + apt): the real-cluster tests will be skipped"

# Stop what `python -m labkit.testing up` started (by pid) and delete the network hosts.
cluster-clean: venv
	$(PY) -m labkit.testing down

# JupyterLab from .venv on the notebooks (as root too). The jupytext .py scripts are the source;
# their paired .ipynb (outputs included) are made or refreshed here and stay out of git.
# etc/jupyter turns ipyparallel's Clusters panel (server and lab extension) off: it adopts every
# cluster it finds in the profile, labkit's too, and prints each stopped engine's whole log here.
lab: venv
	$(VENV)/bin/jupytext --sync --quiet notebooks/*.py
	JUPYTER_CONFIG_PATH="$(CURDIR)/etc/jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	  $(VENV)/bin/jupyter lab --ServerApp.root_dir=notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)

# Headless Chromium for the browser tests (tests/test_notebooks.py, driven by the playwright package
# of the test extra; no browser download): Debian's package, installed only when missing and when
# running as root; otherwise those tests are skipped, saying so.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "chromium not installed (needs root + apt): the browser test will be skipped"

bench: venv
	$(PIP) install -q -e ".[test,bench]"
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
