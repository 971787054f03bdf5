#!/usr/bin/env bash
# Delete a kind cluster made by create-cluster.sh, and what it set up on this host.
#
#   e2e/kind/delete-cluster.sh [--name NAME]
#
# For a --local-image cluster: the host routes --host-routes added (as recorded), the
# iptables rules that forward its API server's port (tagged spillway-kind:NAME), then
# `kind delete cluster` against Spillway's docker daemon (tools/kind-node.sh's kind).
# Otherwise: `kind delete cluster`. Deleting a cluster that does not exist is no error.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

while [ $# -gt 0 ]; do
  case "$1" in
    --name) CLUSTER_NAME="$2"; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done

state=$KIND_STATE
if [ -f "$state/$CLUSTER_NAME.local" ]; then
  unroute_host
  unforward_api_server
  refs=$("$REPO_ROOT/tools/kind-node.sh" --refs) || die "tools/kind-node.sh --refs failed"
  kind_cmd=$(sed -n 's/^kind=//p' <<<"$refs")
  DOCKER_HOST=$(sed -n 's/^DOCKER_HOST=//p' <<<"$refs")
  export DOCKER_HOST
  kind() { "$kind_cmd" "$@"; }
  rm -f "$state/$CLUSTER_NAME.local"
else
  need kind
fi
log "kind delete cluster --name $CLUSTER_NAME"
kind delete cluster --name "$CLUSTER_NAME"
