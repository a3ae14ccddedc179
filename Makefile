# dlm-triton: `make serve` serves the embedded default model, `make test` runs lint + tests.
# Both build .venv first (from Debian's Python: the tritonserver stub embeds its libpython).

PYTHON ?= /usr/bin/python3.11
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
SERVE_ARGS ?=
PYTEST_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
STAMP := $(VENV)/.dlm-installed
LIBPYTHON := /usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0
# The versions the images install (docker/lock.py): the suite runs the same ones.
CONSTRAINTS := docker/constraints.txt

.PHONY: venv serve test test-busy lint format clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PYTHON) || { echo "installing $(PYTHON) (Debian python3.11)"; \
	  $(SUDO) apt-get update && $(SUDO) apt-get install -y python3.11; }
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || { echo "installing python3.11-venv"; \
	  $(SUDO) apt-get update && $(SUDO) apt-get install -y python3.11-venv; }
	@test -e $(LIBPYTHON) || { echo "installing libpython3.11 (embedded by the Triton stub)"; \
	  $(SUDO) apt-get update && $(SUDO) apt-get install -y libpython3.11; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -c $(CONSTRAINTS) torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install -c $(CONSTRAINTS) -e ".[serve,dev,quant]"
	@touch $@

serve: venv
	$(BIN)/dlm-triton serve $(SERVE_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the suite with both cores kept busy by two loops (stopped by PID on every exit path)
test-busy: venv
	tests/run_busy.sh $(MAKE) test

clean-venv:
	rm -rf $(VENV)
