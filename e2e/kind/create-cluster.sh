#!/usr/bin/env bash
# Create a kind cluster for Spillway's e2e scenarios.
#
#   e2e/kind/create-cluster.sh [--name NAME] [--workers N] [--gpus] [--local-image]
#       [--image REF] [--extra-mount HOSTDIR]... [--host-routes] [--kubeconfig FILE]
#       [--fake-gpus-per-node N] [--gpu-product PRODUCT] [--fake-gpus-only]
#
# Without --gpus: a plain kind cluster whose workers advertise FAKE GPUs, like the local
# control plane's KWOK nodes: nvidia.com/gpu in node status capacity AND allocatable, and
# GPU Feature Discovery's labels (the operator selects nodes by nvidia.com/gpu.product).
# Pods get scheduled; vLLM itself cannot start without a GPU.
# The kubelet may drop an extended resource it does not manage when it re-registers
# (node restart): re-run with --fake-gpus-only to patch the nodes again.
#
# --local-image: no registry needed. The node image is built here (tools/kind-node.sh,
# cached), kind runs against Spillway's docker daemon (unix:///run/spillway/docker.sock,
# where tools/images.sh builds the images `kind load docker-image` loads), and the
# API server's published port is forwarded to the control plane (that daemon publishes
# no ports itself), so `kind get kubeconfig` works from this host. --image REF uses that
# node image instead. --extra-mount HOSTDIR mounts HOSTDIR at the same path in every
# node (hostPath volumes); --host-routes routes this host to the pods (each podCIDR via
# its node) and to the Services (10.96.0.0/12 via a worker). Prints NAME=VALUE lines:
# kubeconfig, api_server, node.<name>=<IP>. e2e/kind/delete-cluster.sh undoes it all.
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
local_image=false
node_image=""
extra_mounts=()
host_routes=false

usage() { sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --name) CLUSTER_NAME="$2"; shift 2 ;;
    --workers) workers="$2"; shift 2 ;;
    --gpus) gpus=true; shift ;;
    --local-image) local_image=true; shift ;;
    --image) node_image="$2"; local_image=true; shift 2 ;;
    --extra-mount) extra_mounts+=("$2"); shift 2 ;;
    --host-routes) host_routes=true; shift ;;
    --kubeconfig) export KUBECONFIG="$2"; shift 2 ;;
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
    -o custom-columns='NAME:.metadata.name,GPUS:.status.allocatable.nvidia\.com/gpu,PRODUCT:.metadata.labels.nvidia\.com/gpu\.product' >&2
}

if $local_image; then
  # kind, kubectl and the daemon tools/kind-node.sh names (building the node image, or
  # reusing it; its one-line failure is on stderr)
  refs_args=()
  [ -z "$node_image" ] || refs_args=(--refs)
  refs=$("$REPO_ROOT/tools/kind-node.sh" "${refs_args[@]}") \
    || die "tools/kind-node.sh failed (its line above)"
  ref() { sed -n "s/^$1=//p" <<<"$refs"; }
  [ -n "$node_image" ] || node_image=$(ref node_image)
  kind_cmd=$(ref kind) kubectl_cmd=$(ref kubectl)
  DOCKER_HOST=$(ref DOCKER_HOST)
  export DOCKER_HOST
  kind() { "$kind_cmd" "$@"; }
  kubectl() { "$kubectl_cmd" "$@"; }
  docker() { /usr/bin/docker "$@"; }  # the daemon's own (20.10) client
fi

if $fake_only; then
  $local_image || need kubectl
  fake_gpus
  exit 0
fi

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
  die "kind cluster '$CLUSTER_NAME' exists; delete it with: ${KIND_DIR#"$REPO_ROOT"/}/delete-cluster.sh --name $CLUSTER_NAME"
fi

# The API server's published port, forwarded to the control plane: the daemon runs
# without iptables rules or a userland proxy (--iptables=false --userland-proxy=false,
# so that it leaves this host's firewall to the real nodes); it reserves the port but
# forwards nothing. One DNAT rule for 127.0.0.1:PORT and a masquerade for loopback
# sources on kind's bridge (route_localnet on it), tagged for delete-cluster.sh.
forward_api_server() {
  local cp=$CLUSTER_NAME-control-plane port cp_ip bridge tag="spillway-kind:$CLUSTER_NAME"
  port=$(docker port "$cp" 6443/tcp | sed -n 's/^127\.0\.0\.1:\([0-9]*\)$/\1/p' | head -n 1)
  [ -n "$port" ] || die "forward the API server: no 127.0.0.1 port published for $cp:6443"
  cp_ip=$(node_ip "$cp")
  bridge=br-$(docker network inspect -f '{{.Id}}' kind | cut -c1-12)
  unforward_api_server  # a cluster of this name deleted with plain `kind delete` left them
  sysctl -qw "net.ipv4.conf.$bridge.route_localnet=1" \
    || die "forward the API server: sysctl net.ipv4.conf.$bridge.route_localnet=1"
  iptables -t nat -A OUTPUT -d 127.0.0.1/32 -p tcp --dport "$port" -m comment --comment "$tag" \
    -j DNAT --to-destination "$cp_ip:6443" \
    || die "forward the API server: iptables DNAT 127.0.0.1:$port -> $cp_ip:6443"
  iptables -t nat -A POSTROUTING -s 127.0.0.0/8 -o "$bridge" -m comment --comment "$tag" -j MASQUERADE \
    || die "forward the API server: iptables MASQUERADE 127.0.0.0/8 out of $bridge"
  echo "api_server=https://127.0.0.1:$port"
}

node_ip() {
  docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$1"
}

# Routes from this host into the cluster, recorded for delete-cluster.sh.
add_host_routes() {
  local record=$1 name cidr ip svc_via=""
  : > "$record"
  while read -r name cidr ip; do
    [ -n "$cidr" ] || die "host routes: node $name has no podCIDR"
    ip route replace "$cidr" via "$ip" || die "host routes: ip route replace $cidr via $ip"
    echo "$cidr $ip" >> "$record"
    case "$name" in *-control-plane) ;; *) [ -n "$svc_via" ] || svc_via=$ip ;; esac
  done < <(kctl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.podCIDR}{" "}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}')
  [ -n "$svc_via" ] || svc_via=$(awk 'NR==1 {print $2}' "$record")
  ip route replace 10.96.0.0/12 via "$svc_via" || die "host routes: ip route replace 10.96.0.0/12 via $svc_via"
  echo "10.96.0.0/12 $svc_via" >> "$record"
  while read -r cidr ip; do echo "route=$cidr via $ip"; done < "$record"
}

if $local_image; then
  [ "$(id -u)" = 0 ] || die "--local-image needs root (the node image, the API server's forwarding)"
  state=$KIND_STATE
  mkdir -p "$state"
  unroute_host  # a cluster of this name deleted with plain `kind delete` left them
  touch "$state/$CLUSTER_NAME.local"  # delete-cluster.sh: undo what this host got
  config=$(mktemp)
  createlog=$state/$CLUSTER_NAME.create.log
  trap 'rm -f "$config"' EXIT
  mounts() {
    local dir
    [ ${#extra_mounts[@]} -gt 0 ] || return 0
    echo "  extraMounts:"
    for dir in "${extra_mounts[@]}"; do
      printf '  - hostPath: %s\n    containerPath: %s\n' "$dir" "$dir"
    done
  }
  for dir in "${extra_mounts[@]}"; do
    [ -d "$dir" ] || die "--extra-mount $dir: not a directory"
  done
  {
    echo "kind: Cluster"
    echo "apiVersion: kind.x-k8s.io/v1alpha4"
    echo "networking:"
    echo "  # kube-proxy runs in the nodes (tools/kind-node/spillway-kube-proxy.service)"
    echo "  kubeProxyMode: none"
    echo "kubeadmConfigPatches:"
    echo "- |"
    echo "  kind: KubeletConfiguration"
    echo "  # this host's cgroups are v1, which kubelet 1.35 refuses unless told"
    echo "  failCgroupV1: false"
    echo "nodes:"
    echo "- role: control-plane"
    mounts
    for _ in $(seq 1 "$workers"); do echo "- role: worker"; mounts; done
  } >"$config"
  log "creating kind cluster '$CLUSTER_NAME' ($workers workers) from $node_image (log: $createlog)"
  start=$SECONDS
  if ! kind create cluster --name "$CLUSTER_NAME" --image "$node_image" --config "$config" \
       --wait 180s >"$createlog" 2>&1; then
    # one line: the step kind marks failed (" ✗ Preparing nodes 📦 ...") and its error
    step=$(grep -m1 '✗' "$createlog" | LC_ALL=C sed 's/[^ -~]//g; s/^ *//; s/ *$//' || true)
    why=$(grep -m1 '^ERROR: ' "$createlog" | cut -c1-300 || true)
    kind delete cluster --name "$CLUSTER_NAME" >/dev/null 2>&1 || true
    rm -f "$state/$CLUSTER_NAME.local"
    die "kind create cluster '$CLUSTER_NAME' from $node_image failed at '${step:-?}': ${why:-see the log} (log: $createlog)"
  fi
  forward_api_server
  kctl wait --for=condition=Ready nodes --all --timeout=180s >/dev/null \
    || die "nodes Ready: not all nodes of '$CLUSTER_NAME' Ready after 180 s (kubectl --context kind-$CLUSTER_NAME get nodes)"
  log "all nodes Ready $((SECONDS - start)) s after kind create began"
  kctl -n kube-system rollout status deployment/coredns --timeout=180s >/dev/null \
    || die "CoreDNS: not rolled out after 180 s (kubectl --context kind-$CLUSTER_NAME -n kube-system get pods)"
  log "CoreDNS ready $((SECONDS - start)) s after kind create began"
  fake_gpus
  echo "kubeconfig=${KUBECONFIG:-$HOME/.kube/config}"
  echo "context=kind-$CLUSTER_NAME"
  for node in $(kind get nodes --name "$CLUSTER_NAME" | sort); do
    echo "node.$node=$(node_ip "$node")"
  done
  if $host_routes; then add_host_routes "$state/$CLUSTER_NAME.routes"; fi
elif ! $gpus; then
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
