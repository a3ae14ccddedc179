# dlm-triton: `make serve` serves the embedded default model, `make test` runs lint + tests.
# Both build .venv first, from the system's Python: the tritonserver stub embeds the system
# libpython of the venv's version. docker/constraints.txt is resolved for Python 3.11 and 3.12,
# so the host's python3 is used when it is one of those (Debian 12: 3.11, Ubuntu 24.04: 3.12);
# otherwise Debian's python3.11, installed with apt-get.
HOST_PYTHON := $(shell /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
PYTHON_VERSION ?= $(if $(filter 3.11 3.12,$(HOST_PYTHON)),$(HOST_PYTHON),3.11)
PYTHON ?= /usr/bin/python$(PYTHON_VERSION)
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Where torch's wheels come from besides PyPI. Without an NVIDIA driver (no nvidia-smi) the
# CPU build (2.13.0+cpu, ~200 MB, preferred over PyPI's 2.13.0 as a higher local version),
# instead of PyPI's default build and its ~3 GB of CUDA libraries. Another build:
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130; PyPI's only: TORCH_INDEX_URL=
TORCH_INDEX_URL ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
SERVE_ARGS ?=
PYTEST_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
STAMP := $(VENV)/.dlm-installed
DEV_STAMP := $(VENV)/.dlm-dev-installed
LIBPYTHON := /usr/lib/$(shell uname -m)-linux-gnu/libpython$(PYTHON_VERSION).so.1.0
# The versions the images install (docker/lock.py): the suite runs the same ones.
CONSTRAINTS := docker/constraints.txt

.PHONY: venv dev-venv serve test test-busy lint format clean-venv

# serving: the server, the proxy and quantization (.[serve,quant])
venv: $(STAMP)

# testing: the serving venv plus the dev tools (pytest, ruff, Playwright, schemathesis, kubectl)
dev-venv: $(DEV_STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PYTHON) || { echo "installing $(PYTHON) (Debian python$(PYTHON_VERSION))"; \
	  $(SUDO) apt-get update && $(SUDO) apt-get install -y python$(PYTHON_VERSION); }
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || { \
	  echo "installing python$(PYTHON_VERSION)-venv"; \
	  $(SUDO) apt-get update && $(SUDO) apt-get install -y python$(PYTHON_VERSION)-venv; }
	@test -e $(LIBPYTHON) || { \
	  echo "installing libpython$(PYTHON_VERSION) (embedded by the Triton stub)"; \
	  $(SUDO) apt-get update && $(SUDO) apt-get install -y libpython$(PYTHON_VERSION); }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -c $(CONSTRAINTS) torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install -c $(CONSTRAINTS) -e ".[serve,quant]"
	@touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -c $(CONSTRAINTS) -e ".[serve,dev,quant]"
	@touch $@

serve: venv
	$(BIN)/dlm-triton serve $(SERVE_ARGS)

lint: dev-venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: dev-venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the suite with both cores kept busy by two loops (stopped by PID on every exit path)
test-busy: dev-venv
	tests/run_busy.sh $(MAKE) test

clean-venv:
	rm -rf $(VENV)
