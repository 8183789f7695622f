# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# `make check` is the developer's fast loop (needs only .venv: no vLLM, no browser).
PYTHON ?= python3
VENV := .venv
ENGINE_VENV := .engine-venv
RAY_ONLY_VENV := .ray-only-venv
BIN := $(VENV)/bin
export VLAB_ENGINE__PYTHON ?= $(CURDIR)/$(ENGINE_VENV)/bin/python

.PHONY: demo up test check lint engine venv browser promtool ray-only clean

$(VENV)/.ok: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "is ignored: it is neither" || true
	$(BIN)/python -c "import orchestrator, api, jobs, ray, fastapi"
	touch $@

$(ENGINE_VENV)/.ok: scripts/setup_engine.sh
	PYTHON=$(PYTHON) bash scripts/setup_engine.sh $(ENGINE_VENV)

venv: $(VENV)/.ok
engine: $(ENGINE_VENV)/.ok

## ray-only: a venv with Ray only (same Ray and Python as .venv, nothing of vlab's): the
## nodes of the external-cluster tests start from it (the service ships them its code)
ray-only: venv
	bash scripts/setup_ray_only_venv.sh $(RAY_ONLY_VENV) $(BIN)/python

## browser: Debian's chromium for the dashboard tests (apt, only if missing)
browser:
	bash scripts/setup_browser.sh

## promtool: Debian's promtool for the alert-rule tests, unpacked into .venv/bin (only if missing)
promtool: venv
	bash scripts/setup_promtool.sh $(BIN)

## demo: set everything up, run the APC off/on experiment end to end, print the results
demo: venv engine
	$(BIN)/vlab demo

## up: the service in the foreground (API on :8000, orchestrator, embedded Postgres, local Ray)
up: venv engine
	$(BIN)/vlab up

## lint: ruff (lint + format check) and mypy
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## check: the fast loop: lint, type-check and the tests that need neither vLLM nor a browser
## (only .venv; tests marked engine, browser or slow are left out; see CONTRIBUTING.md)
check: venv lint
	$(BIN)/pytest -q -rs --durations=10 -m "not engine and not browser and not slow"

## test: lint, type-check and the whole test suite (real Postgres, Ray and vLLM CPU build):
## first all but the wall-clock tests in PYTEST_WORKERS processes (pytest-xdist; the
## real-vLLM tests in two groups, each one after another on one worker: tests/conftest.py),
## then the tests marked timing in TIMING_WORKERS processes (one: each timing test alone on
## the machine; beside the fault matrix, a 2-core machine at half speed failed two of them,
## which pass alone); each pass prints its slowest tests. PYTEST_WORKERS=0 /
## TIMING_WORKERS=0: one process.
PYTEST_WORKERS ?= 4
TIMING_WORKERS ?= 1
## Bytecode is written (PYTHONDONTWRITEBYTECODE set empty, where a machine sets it): the
## suite starts hundreds of Python processes that import our packages, and pytest's workers
## would each compile and assertion-rewrite every test module again.
test: venv engine browser promtool ray-only lint
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q -rs --durations=15 -n $(PYTEST_WORKERS) --dist loadgroup -m "not timing"
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q -rs --durations=10 -n $(TIMING_WORKERS) --dist loadgroup -m timing

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(RAY_ONLY_VENV) .vlab
