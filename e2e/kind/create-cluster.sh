#!/usr/bin/env bash
# Create a kind cluster for Spillway's e2e scenarios.
#
#   e2e/kind/create-cluster.sh [--name NAME] [--workers N] [--gpus]
#                              [--fake-gpus-per-node N] [--gpu-product PRODUCT] [--fake-gpus-only]
#
# Without --gpus: a plain kind cluster whose workers advertise FAKE GPUs, like the local
# control plane's KWOK nodes: nvidia.com/gpu in node status capacity AND allocatable, and
# GPU Feature Discovery's labels (the operator selects nodes by nvidia.com/gpu.product).
# Pods get scheduled; vLLM itself cannot start without a GPU.
# The kubelet may drop an extended resource it does not manage when it re-registers
# (node restart): re-run with --fake-gpus-only to patch the nodes again.
#
# With --gpus: real GPUs through NVIDIA's nvkind (one GPU set per worker) and the NVIDIA
# device plugin with GPU Feature Discovery. Needs the NVIDIA driver, nvidia-container-toolkit
# configured for docker (see README.md), and nvkind on PATH.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

workers=2
gpus=false
fake_only=false
fake_per_node=8
gpu_product="NVIDIA-H100-80GB-HBM3"
gpu_memory_mib=81559

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --name) CLUSTER_NAME="$2"; shift 2 ;;
    --workers) workers="$2"; shift 2 ;;
    --gpus) gpus=true; shift ;;
    --fake-gpus-per-node) fake_per_node="$2"; shift 2 ;;
    --gpu-product) gpu_product="$2"; shift 2 ;;
    --fake-gpus-only) fake_only=true; shift ;;
    -h|--help) usage 0 ;;
    *) printf 'unknown argument: %s\n' "$1" >&2; usage 2 ;;
  esac
done

fake_gpus() {
  local node patch
  patch=$(printf '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"%s"},{"op":"add","path":"/status/allocatable/nvidia.com~1gpu","value":"%s"}]' \
    "$fake_per_node" "$fake_per_node")
  for node in $(kctl get nodes -l '!node-role.kubernetes.io/control-plane' -o name); do
    log "fake GPUs on ${node#node/}: $fake_per_node x $gpu_product"
    kctl label --overwrite "$node" \
      nvidia.com/gpu.present=true \
      "nvidia.com/gpu.product=$gpu_product" \
      "nvidia.com/gpu.count=$fake_per_node" \
      "nvidia.com/gpu.memory=$gpu_memory_mib" >/dev/null
    # Both capacity and allocatable: the scheduler reads allocatable, kubectl shows capacity.
    kctl patch "$node" --subresource=status --type=json -p "$patch" >/dev/null
  done
  kctl get nodes \
    -o custom-columns='NAME:.metadata.name,GPUS:.status.allocatable.nvidia\.com/gpu,PRODUCT:.metadata.labels.nvidia\.com/gpu\.product'
}

if $fake_only; then
  need kubectl
  fake_gpus
  exit 0
fi

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
  die "kind cluster '$CLUSTER_NAME' exists; delete it with: kind delete cluster --name $CLUSTER_NAME"
fi

if ! $gpus; then
  need kind kubectl docker
  config=$(mktemp)
  trap 'rm -f "$config"' EXIT
  {
    echo "kind: Cluster"
    echo "apiVersion: kind.x-k8s.io/v1alpha4"
    echo "nodes:"
    echo "- role: control-plane"
    for _ in $(seq 1 "$workers"); do echo "- role: worker"; done
  } >"$config"
  image_args=()
  [ -n "$KIND_NODE_IMAGE" ] && image_args=(--image "$KIND_NODE_IMAGE")
  log "creating kind cluster '$CLUSTER_NAME' ($workers workers, ${KIND_NODE_IMAGE:-the default node image of this kind})"
  kind create cluster --name "$CLUSTER_NAME" "${image_args[@]}" --config "$config" --wait 180s
  fake_gpus
else
  need kind kubectl docker helm nvkind nvidia-smi
  log "GPUs on this host:"
  nvidia-smi -L >&2
  docker info --format '{{json .Runtimes}}' | grep -q nvidia \
    || die "docker has no nvidia runtime: sudo nvidia-ctk runtime configure --runtime=docker --set-as-default --cdi.enabled"
  log "creating kind cluster '$CLUSTER_NAME' with real GPUs (nvkind)"
  nvkind cluster create --name="$CLUSTER_NAME"
  log "installing the NVIDIA device plugin $NVIDIA_DEVICE_PLUGIN_VERSION with GPU Feature Discovery"
  helm repo add nvdp https://nvidia.github.io/k8s-device-plugin >/dev/null 2>&1 || true
  helm repo update nvdp >/dev/null
  helm upgrade -i nvidia-device-plugin nvdp/nvidia-device-plugin \
    --kube-context "kind-$CLUSTER_NAME" -n nvidia --create-namespace \
    --version "$NVIDIA_DEVICE_PLUGIN_VERSION" --set gfd.enabled=true --wait --timeout 5m
  log "waiting for allocatable nvidia.com/gpu on the workers"
  for _ in $(seq 1 60); do
    gpus_now=$(kctl get nodes -o jsonpath='{range .items[*]}{.status.allocatable.nvidia\.com/gpu}{" "}{end}')
    for n in $gpus_now; do
      if [ "$n" -gt 0 ]; then
        kctl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count
        exit 0
      fi
    done
    sleep 5
  done
  die "no node advertises nvidia.com/gpu after 5 minutes (kubectl -n nvidia logs ds/nvidia-device-plugin)"
fi
