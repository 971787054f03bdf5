#!/usr/bin/env bash
# Build both images of the repository's Dockerfile and load them into the kind cluster.
#
#   e2e/kind/load-images.sh [--name NAME] [--operator-only]
#
# Tags: $OPERATOR_IMAGE and $ENGINE_IMAGE (default ghcr.io/spillway-dev/spillway-{operator,engine}:0.1.0,
# the names the chart and the InferenceDeployment default to). The engine image is built on
# vllm/vllm-openai:v0.33.0 (several GB): --operator-only skips it.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

operator_only=false
while [ $# -gt 0 ]; do
  case "$1" in
    --name) CLUSTER_NAME="$2"; shift 2 ;;
    --operator-only) operator_only=true; shift ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done

need docker kind
kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME" \
  || die "no kind cluster '$CLUSTER_NAME' (run e2e/kind/create-cluster.sh first)"

targets=(operator)
$operator_only || targets+=(engine)
for target in "${targets[@]}"; do
  if [ "$target" = operator ]; then image="$OPERATOR_IMAGE"; else image="$ENGINE_IMAGE"; fi
  log "docker build --target $target -t $image"
  docker build --target "$target" -t "$image" "$REPO_ROOT"
  log "kind load docker-image $image"
  kind load docker-image "$image" --name "$CLUSTER_NAME"
done
