# Spillway developer entry points. Everything installs what it needs on first use:
# a virtual environment under ~/.cache/spillway/venv and the Go-built Kubernetes
# binaries under ~/.cache/spillway/bin (both reused on later runs).
SHELL := /bin/bash
VENV ?= $(HOME)/.cache/spillway/venv
PYTEST_ARGS ?=

.PHONY: crd help venv tools lint test test-unit test-contract test-integration demo cluster-up cluster-down

help:
	@echo "make demo   - local control plane with fake GPU nodes (the local demo)"
	@echo "make test   - lint + every test tier (unit, contract, integration)"
	@echo "make cluster-up / cluster-down - start or stop the local cluster only"

venv:
	@EXTRAS=test,engine tools/venv.sh >/dev/null

tools:
	@tools/build.sh >/dev/null

lint: venv
	$(VENV)/bin/ruff check .

test: venv tools lint
	$(VENV)/bin/pytest tests $(PYTEST_ARGS)

test-unit: venv
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

test-contract: venv
	$(VENV)/bin/pytest tests/contract $(PYTEST_ARGS)

test-integration: venv tools
	$(VENV)/bin/pytest tests/integration $(PYTEST_ARGS)

demo: venv tools
	$(VENV)/bin/python -m e2e.demo $(DEMO_ARGS)

cluster-up: venv tools
	@e2e/cluster/up --no-build

cluster-down:
	@e2e/cluster/down

crd: venv
	$(VENV)/bin/python -m spillway_operator.flow.crd > crds/inferencedeployments.spillway.dev.yaml
	cp crds/inferencedeployments.spillway.dev.yaml charts/spillway/files/crd.yaml
