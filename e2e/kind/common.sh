# Shared settings of the kind scripts; sourced, not run.
# shellcheck shell=bash

# Overridable from the environment.
CLUSTER_NAME="${CLUSTER_NAME:-spillway}"
IMAGE_REGISTRY="${IMAGE_REGISTRY:-ghcr.io/spillway-dev}"
IMAGE_TAG="${IMAGE_TAG:-0.1.0}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-$IMAGE_REGISTRY/spillway-operator:$IMAGE_TAG}"
ENGINE_IMAGE="${ENGINE_IMAGE:-$IMAGE_REGISTRY/spillway-engine:$IMAGE_TAG}"
RELEASE_NAMESPACE="${RELEASE_NAMESPACE:-spillway-system}"
# Pinned versions of what the scripts install into the cluster.
# The kind node image: empty = the default of your kind release; pin it for CI, e.g.
# KIND_NODE_IMAGE=kindest/node:v1.35.0 (the Kubernetes minor the tests run against).
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-}"
NVIDIA_DEVICE_PLUGIN_VERSION="${NVIDIA_DEVICE_PLUGIN_VERSION:-0.17.1}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export REPO_ROOT
export KIND_DIR="$REPO_ROOT/e2e/kind"

log() { printf '[kind] %s\n' "$*" >&2; }
die() { printf '[kind] error: %s\n' "$*" >&2; exit 1; }

need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is not on PATH (see e2e/kind/README.md)"
  done
}

kctl() { kubectl --context "kind-$CLUSTER_NAME" "$@"; }
