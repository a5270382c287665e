# ddplab: `make help` lists every goal. Variables: EXPERIMENT, NPROC, ARGS, VENV, PYTHON.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON     ?= python3
VENV       ?= .venv
EXPERIMENT ?= experiments/quickstart.yaml
NPROC      ?= 2
ARGS       ?=
PYTEST_ARGS ?=
UI_PORT    ?= 5000
# The embedded store at the repository root, unless the caller points elsewhere.
export MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlflow.db

BIN   := $(VENV)/bin
STAMP := $(VENV)/.ddplab-setup

.PHONY: help setup run ui test test-unit test-distributed test-e2e lint bench doctor clean-runs

help: ## Show this help
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $@

setup: $(STAMP) ## Create .venv with ddplab and the dev tools (runs by itself when needed)

run: $(STAMP) ## Run the main job: EXPERIMENT (quickstart) with NPROC (2) local ranks via torchrun
	$(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m ddplab train $(EXPERIMENT) $(ARGS)

ui: $(STAMP) ## Open the MLflow UI on http://127.0.0.1:5000 (UI_PORT) over the same store
	$(BIN)/mlflow ui --backend-store-uri "$(MLFLOW_TRACKING_URI)" --host 127.0.0.1 --port $(UI_PORT)

doctor: $(STAMP) ## Preflight checks for EXPERIMENT on this machine
	$(BIN)/ddplab doctor $(EXPERIMENT) $(ARGS)

test: $(STAMP) ## Run every test tier (unit, distributed, end-to-end)
	$(BIN)/pytest $(PYTEST_ARGS)

test-unit: $(STAMP) ## Unit tests only (no process group, seconds)
	$(BIN)/pytest -m "not distributed and not e2e and not container" $(PYTEST_ARGS)

test-distributed: $(STAMP) ## Multi-process tests on CPU (gloo)
	$(BIN)/pytest -m distributed $(PYTEST_ARGS)

test-e2e: $(STAMP) ## End-to-end tests with the README's own commands
	$(BIN)/pytest -m e2e $(PYTEST_ARGS)

lint: $(STAMP) ## Lint the Python code
	$(BIN)/ruff check src tests benchmarks

bench: $(STAMP) ## Benchmarks (prints ratios measured side by side)
	$(BIN)/python benchmarks/bench_core.py $(ARGS)

clean-runs: ## Delete the local MLflow store, artifacts and checkpoints (asks first)
	@read -p "Delete mlflow.db, mlruns/ and checkpoints/? [y/N] " a && [ "$$a" = y ] && rm -rf mlflow.db mlruns checkpoints || echo kept
