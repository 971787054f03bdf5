#!/usr/bin/env bash
# Install the Spillway chart into the kind cluster and apply the sample InferenceDeployment.
#
#   e2e/kind/install.sh [--name NAME] [--namespace NS] [--no-samples] [-- EXTRA HELM ARGS]
#
# The operator image is the one load-images.sh loaded (pull policy IfNotPresent, so the
# loaded image is used). The sample reads its model config.json from a ConfigMap made from
# tests/fixtures/models/gemma-3-1b-it.json, so no Hugging Face token is needed to plan it.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

samples=true
sample_ns=default
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name) CLUSTER_NAME="$2"; shift 2 ;;
    --namespace) sample_ns="$2"; shift 2 ;;
    --no-samples) samples=false; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done

need helm kubectl python3
ctx="kind-$CLUSTER_NAME"

log "helm upgrade --install spillway charts/spillway (namespace $RELEASE_NAMESPACE)"
helm upgrade --install spillway "$REPO_ROOT/charts/spillway" \
  --kube-context "$ctx" -n "$RELEASE_NAMESPACE" --create-namespace \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  "${extra[@]}" --wait --timeout 5m
# Polled, not `kubectl wait --for=condition=Established`, which fails at once on a CRD
# the API server has not yet given a status (".status.conditions accessor error: <nil>").
crd_established() {
  [ "$(kctl get crd inferencedeployments.spillway.dev \
        -o jsonpath='{.status.conditions[?(@.type=="Established")].status}' 2>/dev/null)" = True ]
}
for _ in $(seq 1 60); do crd_established && break; sleep 1; done
crd_established || die "the InferenceDeployment CRD is not Established after 60 s"
kctl -n "$RELEASE_NAMESPACE" rollout status deployment/spillway --timeout=120s

if $samples; then
  log "sample: model ConfigMap and InferenceDeployment in namespace $sample_ns"
  python3 - "$REPO_ROOT/tests/fixtures/models/gemma-3-1b-it.json" >"${TMPDIR:-/tmp}/gemma-config.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
print(json.dumps(doc.get("config", doc)))
PY
  kctl -n "$sample_ns" create configmap gemma-3-1b-it-config \
    --from-file=config.json="${TMPDIR:-/tmp}/gemma-config.json" --dry-run=client -o yaml \
    | kctl apply -f -
  kctl -n "$sample_ns" apply -f "$KIND_DIR/samples/gemma-3-1b-it.yaml"
  log "watch it: kubectl --context $ctx -n $sample_ns get infdep -w"
fi
