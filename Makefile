# ddplab: `make help` lists every goal.
# Variables: EXPERIMENT, NPROC, NNODES, BENCH_NODES, ARGS, VENV, PYTHON, PYTEST_ARGS, TEST_WORKERS, CONTAINER_WORKERS; images: REGISTRY, IMAGE_TAG,
# WITH_ONECCL, TORCH_INDEX_URL, INTEL_INDEX_URL (see docs/containers.md).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON     ?= python3
VENV       ?= .venv
EXPERIMENT ?= experiments/quickstart.yaml
NPROC      ?= 2
ARGS       ?=
PYTEST_ARGS ?= --durations=25
# pytest-xdist workers for `make test`: one per core and one more, at most 4 (each test starts 2-4
# processes of its own, and ~13% of their time waits on servers and timeouts: on 2 cores a third
# worker fills it; docs/testing.md). The container tier runs three at a time: its tests wait on
# servers, healthchecks and containers more than they compute.
CONTAINER_WORKERS ?= 3
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n + 1 < 4 ? n + 1 : 4 )))
UI_PORT    ?= 5000
UI_ADDRESS  = http://127.0.0.1:$(UI_PORT)/\#/experiments?workflowType=machine_learning
# The embedded store at the repository root, unless the caller points elsewhere.
export MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlflow.db

BIN   := $(VENV)/bin
STAMP := $(VENV)/.ddplab-setup

.PHONY: help setup lock run ui docs test test-unit test-distributed test-e2e test-container lint bench bench-startup doctor \
	clean-runs images image-cpu image-cuda image-mlflow run-cpu-oneccl run-cuda-nccl run-multinode \
	multinode-down lint-docker image-mpi run-mpi-multinode mpi-down test-mpi test-browser test-kit k8s-validate \
	k8s-emulate k8s-render k8s-apply scan study bench-collectives image-slurm slurm-up slurm-down setup-ccl \
	clean-images image-cpu-intel image-postgres k8s-secrets gpu-kit bench-peers

gpu-kit: $(STAMP) ## The GPU proof kit in .gpu-kit/: MLflow's client + SQL store wheels for CPython 3.12 (no torch; size printed; docs/benchmarks.md)
	$(BIN)/python tools/gpu_kit.py

# The peers are an optional extra (pyproject: peers), installed on first use where missing (a dev
# venv has them: the dev extra locks them for the script-mode tests).
bench-peers: $(STAMP) ## ddplab beside a plain torchrun script, Lightning Fabric/Trainer and Accelerate on the same job: docs/results/bench-peers.md
	@$(BIN)/python -c "import lightning, accelerate" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[peers]"
	$(BIN)/python benchmarks/bench_peers.py $(ARGS)

help: ## Show this help
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}'

# Every package from the hashed lock (make lock), then ddplab itself, editable. uv (pinned and
# hashed in that lock; pip installs it first) downloads, unpacks and compiles in parallel: the
# 6.4 GB venv took 61 s against pip's 88 s (docs/environment.md). uv reads none of pip's settings:
# tools/uv_sources.py hands it the indexes and wheel folders pip is configured with, and where uv
# still cannot install, pip installs the lock.
UV_REQ := $(VENV)/uv-requirement.txt
$(STAMP): pyproject.toml requirements-dev.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@awk '/^uv==/ {p = 1} p {print; if (!/\\$$/) exit}' requirements-dev.lock > $(UV_REQ)
	$(BIN)/python -m pip install -q --require-hashes -r $(UV_REQ)
	sources=$$($(BIN)/python tools/uv_sources.py) && eval "$(BIN)/uv pip install -q --python $(BIN)/python \
	    --compile-bytecode --require-hashes $$sources -r requirements-dev.lock \
	    && $(BIN)/uv pip install -q --python $(BIN)/python $$sources --no-deps -e ." \
	  || { echo "make setup: uv could not install (above); pip installs the same lock" >&2; \
	       $(BIN)/python -m pip install -q --require-hashes -r requirements-dev.lock \
	       && $(BIN)/python -m pip install -q --no-deps -e .; }
	@touch $@

setup: $(STAMP) ## Create .venv with ddplab and the dev tools from requirements-dev.lock (runs by itself when needed)

lock: $(STAMP) ## Regenerate the hashed locks (requirements.lock, requirements-dev.lock) from pyproject.toml and constraints.txt
	$(BIN)/python tools/lock.py

CCL_STAMP := $(VENV)/lib/ddplab-ccl/BUILD.json
$(CCL_STAMP): $(STAMP) src/ddplab/ccl/csrc/ddplab_ccl.cpp src/ddplab/ccl/build.py
	$(BIN)/python -m ddplab.ccl.build

setup-ccl: $(CCL_STAMP) ## Build ddplab's oneCCL backend `ccl` into .venv (oneCCL from PyPI; needs g++, libfabric1)

# ddplab run checks everything it can in one process first (one line, exit 2), then execs torchrun.
run: $(STAMP) ## Run the main job: EXPERIMENT (quickstart, or your script.py) with NPROC (2) local ranks via torchrun
	$(BIN)/ddplab run --nproc-per-node $(NPROC) $(EXPERIMENT) $(ARGS)

# --app-name ddplab: MLflow's server app, opening on the runs (src/ddplab/tracking/mlflow_app.py).
# Without MLflow's job runner (seven more processes for GenAI jobs ddplab runs none of), unless set.
ui: $(STAMP) ## Open the MLflow UI over the same store; prints its address (UI_PORT, default 5000)
	@echo "MLflow UI, runs view: $(UI_ADDRESS)"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=$${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false} $(BIN)/mlflow server --app-name ddplab --workers 1 --backend-store-uri "$(MLFLOW_TRACKING_URI)" \
		--host 127.0.0.1 --port $(UI_PORT)

doctor: $(STAMP) ## Preflight checks for EXPERIMENT on this machine
	$(BIN)/ddplab doctor $(EXPERIMENT) $(ARGS)

# Its tests start some 800 Python processes that import ddplab. Where PYTHONDONTWRITEBYTECODE
# is set (our build machines set it), none cached ddplab's bytecode: each compiled ~60 modules.
test: $(STAMP) $(CCL_STAMP) ## Build ddplab's ccl (setup-ccl), then the tiers that need no Docker or Open MPI: unit, distributed, end-to-end
	@$(BIN)/python -m compileall -q src tests > /dev/null
	$(BIN)/pytest -m "not container and not mpi and not browser and not kit" -n $(TEST_WORKERS) --maxschedchunk 1 $(PYTEST_ARGS)

test-kit: $(STAMP) ## The GPU proof kit built as for a bare GPU machine and run on CPU: its CPU steps finish, its CUDA ones refuse in one line
	$(BIN)/pytest -m kit $(PYTEST_ARGS)

test-mpi: $(STAMP) ## Native mpirun tests (needs Open MPI: apt-get install openmpi-bin)
	$(BIN)/pytest -m mpi $(PYTEST_ARGS)

test-browser: $(STAMP) ## The MLflow UI of `make ui` in a real browser (needs Debian's chromium: apt-get install chromium)
	$(BIN)/pytest -m browser $(PYTEST_ARGS)

test-unit: $(STAMP) ## Unit tests only (no process group, no Docker, no mpirun)
	$(BIN)/pytest -m "not distributed and not e2e and not container and not mpi and not browser" $(PYTEST_ARGS)

test-distributed: $(STAMP) $(CCL_STAMP) ## Multi-process tests on CPU (gloo, and ddplab's ccl)
	$(BIN)/pytest -m distributed $(PYTEST_ARGS)

test-e2e: $(STAMP) $(CCL_STAMP) ## End-to-end tests with the README's own commands (make run, torchrun, ddplab)
	$(BIN)/pytest -m e2e $(PYTEST_ARGS)

# Three at a time: these tests wait on containers more than they compute (docs/testing.md).
test-container: $(STAMP) ## Container tests on a real Docker engine (needs `make images`), CONTAINER_WORKERS (3) at a time
	$(BIN)/pytest -m container -n $(CONTAINER_WORKERS) --dist loadgroup $(PYTEST_ARGS)

docs: $(STAMP) ## Regenerate docs/config-reference.md from the experiment schema (src/ddplab/config.py)
	$(BIN)/python tools/config_doc.py

lint: $(STAMP) ## Lint the Python code (ruff) and type-check the package (mypy, settings in pyproject.toml)
	$(BIN)/ruff check src tests benchmarks tools docker
	$(BIN)/mypy

STUDY ?= experiments/studies/ch09-threads-vs-processes.yaml
study: $(STAMP) ## Run a study (STUDY=file): its jobs, one parent run, the report (docs/studies.md)
	$(BIN)/ddplab study run $(STUDY) $(ARGS)

bench: $(STAMP) ## Benchmarks (prints ratios measured side by side)
	$(BIN)/python benchmarks/bench_core.py $(ARGS)

bench-script: $(STAMP) ## Script mode's observation against plain torchrun on the book's chapter 9 script (steady step time, interleaved): docs/results/bench-script.md
	$(BIN)/python benchmarks/bench_script.py $(ARGS)

bench-startup: $(STAMP) ## What tracking adds to a short job's set-up and teardown (tracked vs untracked, interleaved)
	$(BIN)/python benchmarks/bench_startup.py $(ARGS)

BENCH_NODES ?= 1
bench-collectives: $(STAMP) ## Time and check every collective on NPROC ranks (x BENCH_NODES torchrun nodes on this host); the support matrix (ARGS: --sizes 1M,64M ...)
	$(BIN)/python benchmarks/local_nodes.py --nnodes $(BENCH_NODES) --nproc $(NPROC) -- -m ddplab bench collectives $(ARGS)

clean-runs: ## Delete the local MLflow store, artifacts and checkpoints (asks first)
	@read -p "Delete mlflow.db, mlruns/ and checkpoints/? [y/N] " a && [ "$$a" = y ] && rm -rf mlflow.db mlruns checkpoints || echo kept

# ---- containers (docs/containers.md) ----
REGISTRY        ?= ddplab
K8S_DIR         ?= k8s
IMAGE_TAG       ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo dev)
GIT_SHA         ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
WITH_ONECCL     ?= 0
ONECCL_VERSION  ?= 2.7.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
CUDA_TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cu130
INTEL_INDEX_URL ?= https://pytorch-extension.intel.com/release-whl/stable/cpu/us/
CPU_IMAGE    := $(REGISTRY)/cpu-oneccl
CUDA_IMAGE   := $(REGISTRY)/cuda-nccl
MLFLOW_IMAGE := $(REGISTRY)/mlflow
POSTGRES_IMAGE := $(REGISTRY)/postgres
MPI_IMAGE    := $(REGISTRY)/openmpi
SLURM_IMAGE  := $(REGISTRY)/slurm
MPI_RUNTIME  ?= cpu
SLOTS        ?= 1
COMPOSE_MPI  := docker compose -f compose/mpi.yml
NNODES       ?= 2
DOCKER_ARGS  ?=
COMPOSE      := docker compose -f compose/multinode.yml
# Same path inside and out: MLflow records absolute artifact paths, and both sides must agree.
DOCKER_RUN   := docker run --rm --init --network host --shm-size 2g --user $$(id -u):$$(id -g) \
	--group-add 0 -v "$(CURDIR)":"$(CURDIR)" -w "$(CURDIR)" -e MLFLOW_TRACKING_URI $(DOCKER_ARGS)
build = docker build -f docker/$(1)/Dockerfile --build-arg GIT_SHA=$(GIT_SHA) \
	--build-arg IMAGE_REF=$(2):$(IMAGE_TAG) -t $(2):$(IMAGE_TAG) -t $(2):latest $(3) .
# The images compose can build are built BY compose, with its files' build sections and the
# Makefile's arguments: one definition, and one builder (BuildKit), so `make images` and
# `docker compose ... up` share one layer cache instead of building torch's layer twice.
compose_build = WITH_ONECCL=$(WITH_ONECCL) ONECCL_VERSION=$(ONECCL_VERSION) \
	TORCH_INDEX_URL=$(TORCH_INDEX_URL) INTEL_INDEX_URL=$(INTEL_INDEX_URL) GIT_SHA=$(GIT_SHA) \
	DDPLAB_$(1)_IMAGE=$(2):$(IMAGE_TAG) $(4) docker compose -f compose/$(3) build $(5) \
	&& docker tag $(2):$(IMAGE_TAG) $(2):latest
RUNTIME_IMAGE = $(REGISTRY)/$(if $(filter cuda,$(MPI_RUNTIME)),cuda-nccl,cpu-oneccl):latest

images: image-cpu image-cuda image-mlflow image-postgres image-mpi image-slurm ## Build every image (tags: git revision and latest)

image-cpu: ## Build the CPU image: the native torch, ddplab's ccl (TORCH_INDEX_URL=https://pypi.org/simple offline)
	$(call compose_build,CPU,$(CPU_IMAGE),multinode.yml,,node)

INTEL_IMAGE := $(REGISTRY)/cpu-intel
image-cpu-intel: ## Build Intel's stack apart (IPEX 2.7 + oneccl_bindings_for_pytorch on torch 2.7.1): ddplab/cpu-intel
	$(call build,cpu-oneccl,$(INTEL_IMAGE),--build-arg TORCH_VERSION=2.7.1 --build-arg TORCHVISION_VERSION=0.22.1 \
	  --build-arg IPEX_VERSION=2.7.0 --build-arg WITH_ONECCL=$(if $(filter 0,$(WITH_ONECCL)),auto,$(WITH_ONECCL)) \
	  --build-arg ONECCL_VERSION=$(ONECCL_VERSION) --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL) \
	  --build-arg INTEL_INDEX_URL=$(INTEL_INDEX_URL) --build-arg DDPLAB_TORCH_STACK=intel)

image-cuda: ## Build the CUDA image (torch's CUDA build brings the CUDA runtime and NCCL)
	$(call build,cuda-nccl,$(CUDA_IMAGE),--build-arg TORCH_INDEX_URL=$(CUDA_TORCH_INDEX_URL))

image-mlflow: ## Build the MLflow tracking server image
	$(call compose_build,MLFLOW,$(MLFLOW_IMAGE),tracking.yml,,tracking-secrets)

image-postgres: ## Build the PostgreSQL image of the team tracking server (compose/tracking.yml)
	$(call compose_build,POSTGRES,$(POSTGRES_IMAGE),tracking.yml,,postgres)

image-mpi: ## Build the Open MPI image on the CPU image (MPI_RUNTIME=cuda: on the CUDA image)
	@docker image inspect $(RUNTIME_IMAGE) >/dev/null 2>&1 || $(MAKE) image-$(MPI_RUNTIME)
	@# mpi.yml builds the worker FROM $$DDPLAB_CPU_IMAGE: here, the runtime image asked for.
	$(call compose_build,MPI,$(MPI_IMAGE),mpi.yml,DDPLAB_CPU_IMAGE=$(RUNTIME_IMAGE),worker)

image-slurm: ## Build the Slurm image (slurmctld, slurmd, MUNGE) on the CPU image
	@docker image inspect $(CPU_IMAGE):latest >/dev/null 2>&1 || $(MAKE) image-cpu
	$(call compose_build,SLURM,$(SLURM_IMAGE),slurm.yml,DDPLAB_CPU_IMAGE=$(CPU_IMAGE):latest,slurmctld)

# Every build tags the git revision, so each commit's images stay until removed (GBs apiece).
BUILD_CACHE_KEEP ?= 20GB
clean-images: ## Remove ddplab images of other revisions (keeps :latest and :IMAGE_TAG), dangling layers, build cache past BUILD_CACHE_KEEP
	@old=$$(docker images --format '{{.Repository}}:{{.Tag}}' \
	  | grep -E '^$(REGISTRY)/(cpu-oneccl|cpu-intel|cuda-nccl|mlflow|postgres|openmpi|slurm):' \
	  | grep -vE ':(latest|$(IMAGE_TAG))$$' || true); \
	if [ -n "$$old" ]; then docker rmi $$old || echo "make clean-images: kept the images above: containers still use them (docker ps -a)"; \
	else echo "make clean-images: no images of other revisions"; fi
	docker image prune -f
	docker builder prune -f --keep-storage $(BUILD_CACHE_KEEP)

slurm-up: ## Start the one-host Slurm cluster (compose/slurm.yml), follow its sbatch job, exit with its code (slurm-down)
	docker compose -f compose/slurm.yml up submit
	$(call login_hint,docker compose -f compose/slurm.yml)
	@docker compose -f compose/slurm.yml ps -a --format '{{.Service}} {{.ExitCode}}' submit | \
	  awk '$$2 != 0 {bad = 1; print "the sbatch job exited with " $$2} END {exit bad}'

slurm-down: ## Stop the Slurm cluster and delete its volumes
	docker compose -f compose/slurm.yml down -v

run-cpu-oneccl: ## Run EXPERIMENT with NPROC ranks via torchrun in the CPU image, backend ccl
	@docker image inspect $(CPU_IMAGE):latest >/dev/null 2>&1 || $(MAKE) image-cpu
	$(DOCKER_RUN) $(CPU_IMAGE):latest torchrun --standalone --nproc-per-node $(NPROC) -m ddplab \
	  train $(EXPERIMENT) --set dist.backend=ccl --set dist.allow_backend_fallback=true $(ARGS)

run-cuda-nccl: ## Run EXPERIMENT with NPROC GPUs via torchrun in the CUDA image, backend nccl
	@docker info --format '{{json .Runtimes}}' | grep -q nvidia || command -v nvidia-container-cli >/dev/null \
	  || { echo "error: no NVIDIA container runtime here: install the NVIDIA Container Toolkit (docs/containers.md)" >&2; exit 1; }
	@docker image inspect $(CUDA_IMAGE):latest >/dev/null 2>&1 || $(MAKE) image-cuda
	$(DOCKER_RUN) --gpus all $(CUDA_IMAGE):latest torchrun --standalone --nproc-per-node $(NPROC) \
	  -m ddplab train $(EXPERIMENT) --set dist.backend=nccl --set dist.device=cuda $(ARGS)

# A bare `up` returns only once every container stopped, and the MLflow server does not;
# `--exit-code-from` stops everything at the first one-shot service's exit. `up SERVICE` starts
# what it needs, shows the job's own containers and returns when they end (Ctrl-C stops them,
# MLflow stays up); then their exit codes, and the UI's login.
login_hint = @$(1) logs --no-log-prefix tracking-secrets 2>/dev/null | grep "MLflow login" || true
run-multinode: ## Simulate NNODES nodes with compose, exit with the nodes' code; the MLflow UI stays up on localhost:5000 (multinode-down)
	@docker image inspect $(CPU_IMAGE):latest >/dev/null 2>&1 || $(MAKE) image-cpu
	NNODES=$(NNODES) $(COMPOSE) up node
	$(call login_hint,$(COMPOSE))
	@$(COMPOSE) ps -a --format '{{.Service}} {{.ExitCode}}' node | \
	  awk '$$2 != 0 {bad = 1; print "node exited with " $$2} END {exit bad}'

multinode-down: ## Stop the compose simulation and delete its volumes
	$(COMPOSE) down -v

run-mpi-multinode: ## mpirun across NNODES worker containers x SLOTS ranks (compose/mpi.yml), exit with the launcher's code (mpi-down)
	@docker image inspect $(MPI_IMAGE):latest >/dev/null 2>&1 || $(MAKE) image-mpi
	NNODES=$(NNODES) SLOTS=$(SLOTS) $(COMPOSE_MPI) up launcher
	$(call login_hint,$(COMPOSE_MPI))
	@$(COMPOSE_MPI) ps -a --format '{{.Service}} {{.ExitCode}}' launcher | \
	  awk '$$2 != 0 {bad = 1; print "launcher exited with " $$2} END {exit bad}'

mpi-down: ## Stop the MPI simulation and delete its volumes
	$(COMPOSE_MPI) down -v

lint-docker: $(STAMP) ## Lint every Dockerfile (hadolint) and the compose files
	$(BIN)/hadolint docker/*/Dockerfile
	$(COMPOSE) config --quiet
	$(COMPOSE_MPI) config --quiet
	docker compose -f compose/slurm.yml config --quiet

# ---- Kubernetes (docs/kubernetes.md) ----
k8s-apply: ## Apply k8s/ (K8S_DIR=build/k8s: k8s-render's copy) for the operator the cluster runs: Trainer v2 (trainer-v2/) or v1, saying which
	@K8S_DIR=$(K8S_DIR) bash tools/k8s_apply.sh

k8s-validate: $(STAMP) ## Validate k8s/ against the real CRDs and Kubernetes' schema (no cluster)
	$(BIN)/pytest tests/test_k8s.py $(PYTEST_ARGS)

k8s-emulate: $(STAMP) ## Run the v1 CPU, elastic and MPI jobs' and the v2 TrainJobs' pods as the operators would, on Docker
	$(BIN)/pytest tests/test_k8s_emulation.py $(PYTEST_ARGS)

CHECKOV_VERSION ?= 3.3.30
TOOLS := .tools

# checkov pins its own dependencies (they clash with mlflow's), so it gets a venv of its own.
$(TOOLS)/checkov/bin/checkov:
	$(PYTHON) -m venv $(TOOLS)/checkov
	$(TOOLS)/checkov/bin/pip install -q "checkov==$(CHECKOV_VERSION)"

scan: $(TOOLS)/checkov/bin/checkov ## Security scan of k8s/ and docker/ (checkov; skips justified in place)
	$(TOOLS)/checkov/bin/checkov -d k8s --framework kubernetes --compact --quiet
	$(TOOLS)/checkov/bin/checkov -d docker --framework dockerfile --compact --quiet

k8s-secrets: ## The namespace and the tracking server's generated Secrets, once (kept when present: the database keeps the admin's password)
	kubectl apply -f k8s/00-namespace.yaml
	@if kubectl -n ddplab get secret mlflow-server >/dev/null 2>&1; then \
	  echo "k8s-secrets: Secret mlflow-server exists in namespace ddplab: kept"; \
	else python3 docker/mlflow/make_secrets.py --k8s ddplab | kubectl create -f -; fi

k8s-render: ## Copy k8s/ to build/k8s/ with images from REGISTRY and IMAGE_TAG
	@rm -rf build/k8s && mkdir -p build && cp -r k8s build/k8s
	find build/k8s -name '*.yaml' -exec sed -i 's#image: ddplab/\([a-z-]*\):latest#image: $(REGISTRY)/\1:$(IMAGE_TAG)#' {} +
	@echo "rendered build/k8s/ with $(REGISTRY)/*:$(IMAGE_TAG); make k8s-apply K8S_DIR=build/k8s"
