# Spillway developer entry points. Everything installs what it needs on first use:
# a virtual environment under ~/.cache/spillway/venv and the Go-built Kubernetes
# binaries under ~/.cache/spillway/bin (both reused on later runs).
SHELL := /bin/bash
VENV ?= $(HOME)/.cache/spillway/venv
PYTEST_ARGS ?=

.PHONY: crd help venv venv-demo host tools tools-demo tools-kind images images-in-nodes setup setup-demo setup-kind lint test test-unit test-contract test-integration test-images test-nodes test-product test-kind demo demo-fleet demo-kind cluster-up cluster-down

help:
	@echo "make demo   - the local demo: control plane + 2 real nodes with fake GPUs, Spillway's images and chart"
	@echo "make demo-fleet - the same demo on KWOK nodes, engines as host processes"
	@echo "make demo-kind - the same demo on a kind cluster from a node image built here"
	@echo "make test   - lint + every test tier (unit, contract, integration, images, nodes)"
	@echo "make cluster-up / cluster-down - start or stop the local cluster only"

venv:
	@EXTRAS=test,engine tools/venv.sh >/dev/null

# The demo on real nodes runs vLLM in the engine image only: its venv needs no vLLM or
# torch (about 10 GB less to install before the demo; `make test` adds them later).
venv-demo:
	@EXTRAS=test tools/venv.sh >/dev/null

# Debian packages for real containers and real nodes (containerd, runc, docker.io, CNI)
host:
	@tools/host.sh

tools: host
	@tools/build.sh >/dev/null

# Only what the real-node demo runs (no GIE picker or test-only binaries: minutes of a
# cold first run); GIE's CRDs come with its family when DEMO_ARGS has --gateway.
DEMO_TOOLS = k8s node gpuplugin etcd kwok helm lws coredns $(if $(findstring --gateway,$(DEMO_ARGS)),gie)
tools-demo: host
	@tools/build.sh $(DEMO_TOOLS) >/dev/null

# Spillway's images from its own Dockerfile, into the local docker daemon (tools/images.sh)
images: host
	@tools/images.sh >/dev/null

# The first run's installs at once: the venv (network, disk), the Go builds (CPU) and the
# images (network, disk) overlap instead of queueing; host packages come first.
setup:
	@$(MAKE) --no-print-directory -j3 venv tools images
setup-demo:
	@$(MAKE) --no-print-directory -j3 venv-demo tools-demo images-in-nodes

# The demo's images into the real nodes' kept containerd roots as soon as they are built,
# while the Go builds still run (python -m e2e.nodes preload), not after them
images-in-nodes: images venv-demo
	@$(VENV)/bin/python -m e2e.nodes preload

lint: venv
	$(VENV)/bin/ruff check .

# Every tier but tests/product and tests/kind (real engine pods; too long for CI's budget
# beside the rest), in three runs. The contract and unit tiers are CPU-bound (vLLM's own
# planning code, emulated engines started from scratch) and the integration tier mostly
# waits on its control plane: each runs on TEST_WORKERS processes, a test file per
# process (a file's session caches are built once; an integration worker starts a
# control plane of its own on free ports). The images and nodes tiers share one docker
# daemon and two real nodes: one test at a time. Every run runs; the target fails if
# any did.
TEST_WORKERS ?= 2
PARALLEL = -n $(TEST_WORKERS) --dist loadfile
test: setup lint
	@status=0; set -x; \
	$(VENV)/bin/pytest $(PARALLEL) tests/contract tests/unit $(PYTEST_ARGS) || status=$$?; \
	$(VENV)/bin/pytest $(PARALLEL) tests/integration $(PYTEST_ARGS) || status=$$?; \
	$(VENV)/bin/pytest tests --ignore=tests/product --ignore=tests/kind --ignore=tests/contract \
	  --ignore=tests/unit --ignore=tests/integration $(PYTEST_ARGS) || status=$$?; \
	exit $$status

test-unit: venv
	$(VENV)/bin/pytest $(PARALLEL) tests/unit $(PYTEST_ARGS)

test-contract: venv
	$(VENV)/bin/pytest $(PARALLEL) tests/contract $(PYTEST_ARGS)

test-integration: venv tools
	$(VENV)/bin/pytest $(PARALLEL) tests/integration $(PYTEST_ARGS)

test-images: venv images
	$(VENV)/bin/pytest tests/images $(PYTEST_ARGS)

test-nodes: venv tools images
	$(VENV)/bin/pytest tests/nodes $(PYTEST_ARGS)

# kind: what the harness installs in the cluster (kubectl, helm, the device plugin,
# LeaderWorkerSet's controller); tools/kind-node.sh, which the harness runs, builds kind,
# kubeadm, crictl and the node image with the control plane's images in it.
KIND_TOOLS = k8s node gpuplugin helm lws
tools-kind: host
	@tools/build.sh $(KIND_TOOLS) >/dev/null
setup-kind:
	@$(MAKE) --no-print-directory -j3 venv-demo tools-kind images

# Spillway on a kind cluster made here: the cluster, the chart, engines in kind's nodes
test-kind: venv tools-kind images
	$(VENV)/bin/pytest tests/kind $(PYTEST_ARGS)

# Spillway from its images and chart on the real nodes, engine pods as real containers
test-product: venv tools images
	$(VENV)/bin/pytest tests/product $(PYTEST_ARGS)

# The local demo on two real nodes: Spillway's images, the Helm chart, real engine containers
demo: setup-demo
	$(VENV)/bin/python -m e2e.demo --real-nodes $(DEMO_ARGS)

# The same demo on a kind cluster (1 control plane, 2 fake-GPU workers) from a node
# image built here, Spillway from its images (kind load) and chart
demo-kind: setup-kind
	$(VENV)/bin/python -m e2e.demo --kind $(DEMO_ARGS)

# The same demo with KWOK nodes and the engines as host processes (no containers)
demo-fleet: venv tools
	$(VENV)/bin/python -m e2e.demo $(DEMO_ARGS)

cluster-up: venv tools
	@e2e/cluster/up --no-build

cluster-down:
	@e2e/cluster/down

crd: venv
	$(VENV)/bin/python -m spillway_operator.flow.crd > crds/inferencedeployments.spillway.dev.yaml
	cp crds/inferencedeployments.spillway.dev.yaml charts/spillway/files/crd.yaml
