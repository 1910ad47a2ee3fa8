# weightsync: `make help` lists the targets.
SHELL := /bin/bash
# The virtual environment and built binaries live outside the repository so that every clone
# (and CI on the same machine) reuses them; torch alone is several GiB.
CACHE ?= $(HOME)/.cache/weightsync
VENV ?= $(CACHE)/venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.weightsync-deps-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
export WEIGHTSYNC_CACHE := $(CACHE)

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

.PHONY: setup
setup: $(STAMP) ## Create the virtual environment (torch, kopf, test tools) and install weightsync into it
	@# The editable install points at this clone, wherever it is.
	@$(PY) -m pip install -q --no-deps -e . >/dev/null

.PHONY: demo
demo: setup ## Train and transfer the example job as local processes, one per pod (CPU, ~2 minutes)
	$(VENV)/bin/weightsync run examples/tcp-job.yaml

.PHONY: test
test: setup ## Run every test; builds the local control plane's binaries once (cached in $(CACHE))
	$(PY) -m pytest -ra $(PYTEST_ARGS)

.PHONY: bench
bench: setup ## Transfer benchmark: planned M-to-N over TCP vs. gloo broadcast vs. raw sockets
	$(VENV)/bin/weightsync bench
