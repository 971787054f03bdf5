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

# --local-image clusters: what create-cluster.sh leaves on this host is recorded under
# $KIND_STATE (NAME.routes: the host routes of --host-routes); the iptables rules
# forwarding a cluster's API server port are tagged spillway-kind:NAME.
# unforward_api_server and unroute_host remove those of $CLUSTER_NAME (create-cluster.sh
# before adding its own: a cluster deleted with plain `kind delete` left them;
# delete-cluster.sh).
export KIND_STATE="${SPILLWAY_CACHE:-$HOME/.cache/spillway}/kind-clusters"
unforward_api_server() {
  local tag="spillway-kind:$CLUSTER_NAME"
  { iptables -t nat -S 2>/dev/null || true; } \
    | { grep -F -e "--comment \"$tag\" " -e "--comment $tag " || true; } | sed 's/^-A /-D /' \
    | while read -r -a rule; do
        iptables -t nat "${rule[@]//\"/}" || die "iptables -t nat ${rule[*]}"
      done
}
unroute_host() {
  local record="$KIND_STATE/$CLUSTER_NAME.routes" cidr via
  [ -f "$record" ] || return 0
  while read -r cidr via; do
    if ip route del "$cidr" via "$via" 2>/dev/null; then log "route $cidr via $via removed"; fi
  done < "$record"
  rm -f "$record"
}
