# Two commands on a fresh clone:
#   make lab    set up .venv and open the course in JupyterLab
#   make test   set up .venv and run every test (unit, launcher, notebooks)
# Everything else is a step of those two, or a helper.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# extra JupyterLab flags; on a compute node use scripts/lab_on_node.py instead (a free port, loopback only)
LAB_ARGS ?=
# Jupyter refuses to start as root unless told; containers and CI machines run as root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
PYTEST_ARGS ?=
export PATH := $(abspath $(VENV))/bin:$(PATH)

# The practice cluster's config while it is up (make cluster): make lab hands it to
# the notebooks, whose Slurm cells then submit to it; a Slurm of the machine's own (SLURM_CONF already set) wins
PRACTICE_CONF := $(or $(COURSE_SLURM_DIR),/tmp/course-slurm)/slurm.conf
ifeq ($(origin SLURM_CONF),undefined)
ifneq ($(wildcard $(PRACTICE_CONF)),)
lab: export SLURM_CONF := $(PRACTICE_CONF)
endif
endif

# gpu-check needs no .venv: on a GPU machine with its own torch, the repository on PYTHONPATH is enough
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=

.PHONY: setup lab test kernel lock bench gpu-check full-here cluster cluster-down site clean help

help:
	@echo "make lab     set up the environment and open the course in JupyterLab"
	@echo "make test    set up the environment and run the whole test suite"
	@echo "make kernel  register .venv as a Jupyter kernel for a portal's JupyterLab"
	@echo "make bench   run the single-device speed-up ladder (scripts/benchmark_single.py)"
	@echo "make gpu-check  on a GPU node: every notebook, the ladder and matmul TFLOP/s, one report (runs/gpu-check)"
	@echo "make full-here  the notebooks whose full profile runs in minutes here (02, 10), on this CPU (runs/full-here)"
	@echo "make lock    regenerate constraints.txt from the installed environment"
	@echo "make cluster     a two-node Slurm on this Linux machine to practise on (root or sudo); make cluster-down ends it"
	@echo "make site    the notebooks executed, with their outputs, and the guides as a static site (runs/site/html)"

$(STAMP): pyproject.toml constraints.txt setup.cfg envs/jupyterlab/overrides.json
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else "Python >= 3.11 is needed (tomllib reads the config files; the pins were tested on 3.11); set PYTHON=/path/to/python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# uv installs the same pins in a quarter of pip's time (parallel downloads and unpacking; bytecode compiled on all
	# cores, kept: PYTHONDONTWRITEBYTECODE=1 on CI machines). uv reads no pip.conf: where a centre's mirror is set
	# there only, uv fails and pip installs the same pins. On a cluster, point UV_CACHE_DIR at $$SCRATCH or
	# $$LUSTRE: the cache holds a copy of every wheel (6 GB), more than many home quotas.
	$(PY) -m pip install --quiet -c constraints.txt uv
	$(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode -c constraints.txt -e '.[lab,test,site]' \
		|| $(PY) -m pip install --quiet -c constraints.txt -e '.[lab,test,site]'
	rm -rf notebooks/course_utils.egg-info  # left by an install before setup.cfg moved it to the root
	# JupyterLab's defaults for this environment: no news prompt, no update check
	mkdir -p $(VENV)/share/jupyter/lab/settings
	cp envs/jupyterlab/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	# DeepSpeed builds some C++ ops on first use: build them once here, not in every notebook and test (about a
	# minute on 2 cores). torch builds through ccache where it is installed (apt-get install ccache): then a new
	# clone's setup reuses an earlier clone's objects in seconds (CCACHE_BASEDIR: the clone's paths as relative ones)
	CCACHE_BASEDIR=$(CURDIR) $(PY) -c 'from course_utils.sharding import warm_deepspeed_ops; warm_deepspeed_ops()'
	@touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=$(CURDIR) notebooks/00_environment.ipynb $(ALLOW_ROOT) $(LAB_ARGS)

# each notebook is written with its outputs to runs/test-executed as it runs: make site takes those copies
test: setup
	COURSE_EXECUTED_DIR=$(CURDIR)/runs/test-executed $(PY) -m pytest tests notebooks --nbval-lax --nbval-cell-timeout=900 -p no:cacheprovider -rs --durations=15 $(PYTEST_ARGS)

kernel: setup
	$(PY) -m ipykernel install --user --name distdl-course --display-name "Distributed DL course (.venv)"

bench: setup
	$(PY) scripts/benchmark_single.py $(BENCH_ARGS)

gpu-check:
	PYTHONPATH=$(CURDIR)/notebooks$(if $(PYTHONPATH),:$(PYTHONPATH),) $(GPU_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# the notebooks whose full profile runs in minutes on a CPU (2 cores: 02 in 148 s, 10 in 304 s), as a workshop
# would run them, before a GPU sees them; the others' full-profile layouts: tests/test_full_profile.py
FULL_HERE ?= 02 10
full-here:
	PYTHONPATH=$(CURDIR)/notebooks$(if $(PYTHONPATH),:$(PYTHONPATH),) $(GPU_PYTHON) scripts/gpu_check.py --cpu \
		--profile full --notebooks $(FULL_HERE) --rerun --out runs/full-here $(GPU_CHECK_ARGS)

# constraints.txt resolved from pyproject's pins by uv, each line with the packages that pull it in ("# via"): the
# versions already in constraints.txt are kept where they still fit (LOCK_ARGS=--upgrade moves them all; without an
# index, UV_OFFLINE=1 resolves from uv's cache). uv itself is pinned beside them: make setup installs it first.
LOCK_ARGS ?=
lock: setup
	printf 'uv==%s\n' "$$($(VENV)/bin/uv --version | cut -d' ' -f2)" > $(VENV)/lock-tools.in
	$(VENV)/bin/uv pip compile pyproject.toml $(VENV)/lock-tools.in --extra lab --extra test --extra site \
		--python $(PY) --custom-compile-command "make lock" --annotation-style line -o constraints.txt $(LOCK_ARGS)
	@echo "constraints.txt resolved from pyproject.toml; review the diff before committing"

SITE_ARGS ?=

# the site (Sphinx, MyST-NB and a theme from PyPI: it builds offline) executes what is missing or stale (a GPU
# node: the full profile; a CPU: the CI profile), builds runs/site/html, checks every page in headless Chromium
site: setup
	$(PY) scripts/build_site.py $(SITE_ARGS)
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then \
		$(PY) scripts/check_site.py runs/site/html; \
	else echo "no Chromium here: the browser check skipped (apt-get install chromium; then python scripts/check_site.py)"; fi

# a Slurm controller and two nodes in network namespaces, the test suite's cluster (slurm/practice_cluster.py)
cluster:
	$(PYTHON) slurm/practice_cluster.py up

cluster-down:
	$(PYTHON) slurm/practice_cluster.py down

clean:
	rm -rf $(VENV) runs notebooks/runs .pytest_cache
