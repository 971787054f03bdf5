#!/usr/bin/env bash
# Build (or reuse) the Go binaries the local control plane needs, pinned in
# tools/versions.env, into a cache under $HOME keyed by version:
#   $SPILLWAY_BIN_CACHE/{k8s-v*,etcd-v*,kwok-v*,helm-v*,imageref-v*,node-v*,gpuplugin-v*,coredns-v*,gie-v*,lws-v*}/
# and, not binaries, LeaderWorkerSet's CRD and webhook manifests in lws-v*/{crds,webhook}/
# and the Gateway API Inference Extension's CRDs in gie-v*/crds/ beside its endpoint
# picker gie-v*/epp.
# Prints the directory of every family on stdout, one "NAME=DIR" per line, in the
# order below whatever order they were built in. Never writes into the repository.
# `tools/build.sh FAMILY...` builds (or finds) only those, in the same two chains;
# kvindexer (llm-d's indexer harness) is built only so: `tools/build.sh kvindexer`; so are
# the kind node image's (tools/kind-node.sh): kind, crictl, kubeadm, kindcoredns.
#
# A cold build is CPU-bound (about 15 CPU-minutes of compiling): the families are built
# in SPILLWAY_BUILD_JOBS chains at once (default 2), Kubernetes' six commands in one
# chain (they share most of their packages, and concurrent builds would compile them
# twice), the rest in the other; each family's commands in one `go build` (its links
# run in parallel); no DWARF is generated (-dwarf=false: the binaries are stripped
# anyway) and paths are trimmed, so the binaries do not depend on where they were built.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
source "$here/versions.env"
cache=${SPILLWAY_BIN_CACHE:-$HOME/.cache/spillway/bin}
jobs=${SPILLWAY_BUILD_JOBS:-2}
export CGO_ENABLED=0 GOFLAGS="-trimpath -gcflags=all=-dwarf=false"
mkdir -p "$cache"

log() { echo "[tools/build] $*" >&2; }

# build FAMILY VERSION BINARY... -- builds each binary named PKG:NAME with LDFLAGS;
# when it builds, a command in PREPARE runs first and prints a go.mod to build with.
# The module is tools/FAMILY, or tools/$MODULE when MODULE is set.
ensure() {
  local fam=$1 ver=$2 dir="$cache/$1-v$2"; shift 2
  local missing=0 b
  for b in "$@"; do [ -x "$dir/${b##*:}" ] || missing=1; done
  if [ $missing = 0 ]; then log "$fam v$ver cached in $dir"; echo "$fam=$dir"; return; fi
  log "building $fam v$ver into $dir (cold builds take minutes) ..."
  local start=$SECONDS tmp="$dir.tmp.$$" modfile=
  if [ -n "${PREPARE:-}" ]; then modfile=$($PREPARE); fi
  rm -rf "$tmp"; mkdir -p "$tmp"
  # One `go build -o DIR/ PKG...` when every binary is named as go names it (the last
  # element of its package path): one invocation compiles shared packages once and links
  # the commands in parallel. Otherwise one build per binary.
  local pkgs=() named=1
  for b in "$@"; do
    pkgs+=("${b%%:*}")
    [ "${b%%:*}" != . ] && [ "$(basename "${b%%:*}")" = "${b##*:}" ] || named=0
  done
  if [ $named = 1 ] && [ $# -gt 1 ]; then
    (cd "$here/${MODULE:-$fam}" && go build -ldflags "$LDFLAGS" ${modfile:+-modfile="$modfile"} \
      -o "$tmp/" "${pkgs[@]}") >&2 || { rm -rf "$tmp"; log "go build of $fam failed"; exit 1; }
  else
    for b in "$@"; do
      (cd "$here/${MODULE:-$fam}" && go build -ldflags "$LDFLAGS" ${modfile:+-modfile="$modfile"} \
        -o "$tmp/${b##*:}" "${b%%:*}") >&2 || { rm -rf "$tmp"; log "go build of $fam failed"; exit 1; }
    done
  fi
  rm -rf "$dir"; mv "$tmp" "$dir"
  log "$fam v$ver built in $((SECONDS - start)) s"
  echo "$fam=$dir"
}

minor=$(echo "$K8S_VERSION" | cut -d. -f2)
k8s_ldflags() {
  local kv out="-s -w"
  for kv in "gitVersion=v$K8S_VERSION" gitMajor=1 "gitMinor=$minor" gitTreeState=clean \
            "gitCommit=module-v$K8S_VERSION" "buildDate=1970-01-01T00:00:00Z"; do
    out="$out -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
  done
  echo "$out"
}
build_k8s() {
  LDFLAGS=$(k8s_ldflags) ensure k8s "$K8S_VERSION" \
    k8s.io/kubernetes/cmd/kube-apiserver:kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager:kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler:kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl:kubectl
}

# The real nodes' binaries (e2e/nodes): the kubelet and kube-proxy of the same
# Kubernetes release, from tools/node (the same module set plus what they import), in
# their own cache folder so the control plane's binaries are not rebuilt for them.
build_node() {
  LDFLAGS=$(k8s_ldflags) MODULE=node ensure node "$K8S_VERSION" \
    k8s.io/kubernetes/cmd/kubelet:kubelet \
    k8s.io/kubernetes/cmd/kube-proxy:kube-proxy
}

build_etcd() { LDFLAGS="-s -w" ensure etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3:etcd; }

# KWOK plays the kubelet, with one change. When a pod's status patch fails with a 500
# (what the API server answers for a write in flight when etcd dies), KWOK 0.8.0 drops
# the pod's stage for good and the pod stays Pending; a kubelet would write the status
# again. The change adds 500s to the errors KWOK's shouldRetry retries with back-off:
# one sed on a copy of its module, built through a go.mod that replaces the module.
kwok_retry_modfile() {
  local src out=$1
  src=$(cd "$here/kwok" && go mod download sigs.k8s.io/kwok && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  cp -R "$src" "$out/kwok" && chmod -R u+w "$out/kwok"
  local file="$out/kwok/pkg/kwok/controllers/utils.go"
  sed -i 's/^\tif apierrors\.IsServerTimeout(err) ||$/\tif apierrors.IsInternalError(err) || apierrors.IsServerTimeout(err) ||/' "$file"
  if ! grep -q 'apierrors.IsInternalError(err) ||' "$file"; then
    log "KWOK's shouldRetry is not what tools/build.sh expects in $src: revise kwok_retry_modfile"
    exit 1
  fi
  cp "$here/kwok/go.mod" "$here/kwok/go.sum" "$out/"
  echo "replace sigs.k8s.io/kwok => $out/kwok" >> "$out/go.mod"
  echo "$out/go.mod"
}
kwok_tmp=$(mktemp -d); trap 'rm -rf "$kwok_tmp"' EXIT
build_kwok() {
  LDFLAGS="-s -w" PREPARE="kwok_retry_modfile $kwok_tmp" \
    ensure kwok "$KWOK_BUILD" sigs.k8s.io/kwok/cmd/kwok:kwok
}

build_helm() {
  local p flags="-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for p in pkg/lint/rules pkg/chartutil; do
    flags="$flags -X helm.sh/helm/v3/$p.k8sVersionMajor=1 -X helm.sh/helm/v3/$p.k8sVersionMinor=$minor"
  done
  LDFLAGS=$flags ensure helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm:helm
}

# The kubelet's image reference parser (distribution/reference, as the kubelet links
# it), for tests/integration/test_image_reference.py.
build_imageref() { LDFLAGS="-s -w" ensure imageref "$IMAGEREF_BUILD" .:imageref; }

# The real nodes' fake GPU device plugin (tools/node/gpuplugin), against the device
# plugin API of the kubelet's own k8s.io/kubelet.
build_gpuplugin() {
  LDFLAGS="-s -w" MODULE=node ensure gpuplugin "$GPUPLUGIN_BUILD" ./gpuplugin:gpuplugin
}

# CoreDNS for the real nodes' pods (e2e/nodes/dns.py), from tools/coredns: a main that
# links only the plugins its Corefile uses (tools/coredns/go.mod pins github.com/coredns/coredns).
build_coredns() {
  if ! grep -q "^require github.com/coredns/coredns v$COREDNS_VERSION$" "$here/coredns/go.mod"; then
    log "tools/coredns/go.mod does not pin github.com/coredns/coredns v$COREDNS_VERSION (tools/versions.env)"
    exit 1
  fi
  LDFLAGS="-s -w" ensure coredns "$COREDNS_VERSION" .:coredns
}

# The Gateway API Inference Extension: its own endpoint picker (cmd/epp, the picker GIE
# ships, for bench/routing.py --gateway and tests/integration/test_gie_picker.py), built
# from tools/gie (which pins sigs.k8s.io/gateway-api-inference-extension), and beside it,
# from the same module, its CRDs (InferencePool, inference.networking.k8s.io/v1) as its
# release ships them in config/crd/bases/: the operator makes an InferencePool per
# InferenceDeployment, and the tests install the real schema, so the API server checks
# what the operator renders against what GIE defines. Copied, never committed; cached
# like the binaries.
gie_crds() {
  local dir=$1 src
  src=$(cd "$here/gie" && go mod download sigs.k8s.io/gateway-api-inference-extension &&
        go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api-inference-extension)
  if [ ! -s "$src/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" ]; then
    log "no InferencePool CRD in $src"
    exit 1
  fi
  local tmp="$dir/crds.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  cp "$src"/config/crd/bases/*.yaml "$tmp/" && chmod -R u+w "$tmp"
  rm -rf "$dir/crds"; mv "$tmp" "$dir/crds"
}
build_gie() {
  # tools/gie/go.mod is what is built: it must pin the version the cache folder names
  if ! grep -q "^	sigs.k8s.io/gateway-api-inference-extension v$GIE_VERSION " "$here/gie/go.mod"; then
    log "tools/gie/go.mod does not pin sigs.k8s.io/gateway-api-inference-extension v$GIE_VERSION (tools/versions.env)"
    exit 1
  fi
  LDFLAGS="-s -w" ensure gie "$GIE_VERSION" \
    sigs.k8s.io/gateway-api-inference-extension/cmd/epp:epp >/dev/null
  local dir="$cache/gie-v$GIE_VERSION"
  [ -s "$dir/crds/inference.networking.k8s.io_inferencepools.yaml" ] || gie_crds "$dir"
  echo "gie=$dir"
}

# LeaderWorkerSet's controller manager (its controllers and its webhooks: LWS defaulting
# and validation, the pod webhook that injects LWS_LEADER_ADDRESS and the group labels),
# from tools/lws (which pins sigs.k8s.io/lws), and beside it, from the same module, the
# CRD (config/crd/bases) and the webhook manifests (config/webhook: the webhooks and the
# patches that narrow the pod webhooks to LWS's pods). e2e/cluster/controlplane.py
# installs the CRD and registers the webhooks with URLs on 127.0.0.1.
lws_manifests() {
  local dir=$1 src
  src=$(cd "$here/lws" && go mod download sigs.k8s.io/lws && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)
  if [ ! -s "$src/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" ] ||
     [ ! -s "$src/config/webhook/manifests.yaml" ]; then
    log "no LeaderWorkerSet CRD or webhook manifests in $src"
    exit 1
  fi
  local tmp="$dir/manifests.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp/crds" "$tmp/webhook"
  cp "$src"/config/crd/bases/*.yaml "$tmp/crds/"
  cp "$src"/config/webhook/{manifests,mutating-patch,validating-patch}.yaml "$tmp/webhook/"
  chmod -R u+w "$tmp"
  rm -rf "$dir/crds" "$dir/webhook"; mv "$tmp/crds" "$tmp/webhook" "$dir/"; rmdir "$tmp"
}
build_lws() {
  LDFLAGS="-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=v$LWS_VERSION" \
    ensure lws "$LWS_VERSION" sigs.k8s.io/lws/cmd:lws-controller >/dev/null
  local lws_dir="$cache/lws-v$LWS_VERSION"
  if [ ! -s "$lws_dir/crds/leaderworkerset.x-k8s.io_leaderworkersets.yaml" ] ||
     [ ! -s "$lws_dir/webhook/validating-patch.yaml" ]; then
    lws_manifests "$lws_dir"
  fi
  echo "lws=$lws_dir"
}

# llm-d's KV-cache indexer (github.com/llm-d/llm-d-kv-cache, pinned by tools/kvindexer/go.mod)
# behind a small stdin/stdout harness (tools/kvindexer/main.go): the interop check
# tests/contract/test_llmd_indexer.py subscribes it to emulated engines' KV events.
build_kvindexer() { LDFLAGS="-s -w" ensure kvindexer "$KVINDEXER_BUILD" .:kvindexer; }

# What tools/kind-node.sh builds a kind node image with (only when named): the kind CLI
# and crictl (kind's `kind load` runs it in the nodes) from tools/kind, which pins
# sigs.k8s.io/kind and sigs.k8s.io/cri-tools; kubeadm of the same Kubernetes release from
# tools/kind/kubeadm (tools/k8s/gen.sh's module for cmd/kubeadm); and CoreDNS with the
# plugins of kubeadm's Corefile (tools/kind/coredns, the same CoreDNS as tools/coredns),
# the cluster DNS kubeadm deploys.
kind_pins() {  # kind_pins MODULE VERSION: tools/kind/go.mod must pin MODULE at VERSION
  grep -q "^	$1 v$2\( \|$\)" "$here/kind/go.mod" ||
    { log "tools/kind/go.mod does not pin $1 v$2 (tools/versions.env)"; exit 1; }
}
build_kind() {
  kind_pins sigs.k8s.io/kind "$KIND_VERSION"
  LDFLAGS="-s -w" ensure kind "$KIND_VERSION" sigs.k8s.io/kind:kind
}
build_crictl() {
  kind_pins sigs.k8s.io/cri-tools "$CRICTL_VERSION"
  LDFLAGS="-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=v$CRICTL_VERSION" MODULE=kind \
    ensure crictl "$CRICTL_VERSION" sigs.k8s.io/cri-tools/cmd/crictl:crictl
}
build_kubeadm() {
  grep -q "^	k8s.io/kubernetes v$K8S_VERSION " "$here/kind/kubeadm/go.mod" ||
    { log "tools/kind/kubeadm/go.mod does not pin k8s.io/kubernetes v$K8S_VERSION: tools/k8s/gen.sh $K8S_VERSION tools/kind/kubeadm kubeadm"; exit 1; }
  LDFLAGS=$(k8s_ldflags) MODULE=kind/kubeadm ensure kubeadm "$K8S_VERSION" \
    k8s.io/kubernetes/cmd/kubeadm:kubeadm
}
build_kindcoredns() {
  grep -q "^require github.com/coredns/coredns v$COREDNS_VERSION$" "$here/kind/coredns/go.mod" ||
    { log "tools/kind/coredns/go.mod does not pin github.com/coredns/coredns v$COREDNS_VERSION (tools/versions.env)"; exit 1; }
  LDFLAGS="-s -w" MODULE=kind/coredns ensure kindcoredns "$COREDNS_VERSION-$KIND_COREDNS_BUILD" .:coredns
}

# ------------------------------------------------------------------ the chains
# The families in the order their lines are printed, and the chains they are built in:
# Kubernetes (control plane, then the node's commands, which reuse its compiled
# packages, then the device plugin from the same module) beside everything else.
# kvindexer is built only when named (one contract test needs it), and so are the kind
# node image's families (tools/kind-node.sh names them).
ORDER=(k8s node etcd kwok helm imageref gpuplugin coredns gie lws)
ALL_CHAINS=("k8s node gpuplugin kubeadm" "etcd kwok helm lws imageref coredns gie kvindexer kind crictl kindcoredns")
if [ $# -gt 0 ]; then  # only the families named (make demo: what the demo runs)
  for fam in "$@"; do
    declare -F "build_$fam" >/dev/null ||
      { log "unknown family $fam (one of ${ORDER[*]} kvindexer kind crictl kubeadm kindcoredns)"; exit 2; }
  done
  ORDER=("$@")
fi
# the chains, less the families not asked for
CHAINS=()
for chain in "${ALL_CHAINS[@]}"; do
  kept=""
  for fam in $chain; do
    [[ " ${ORDER[*]} " == *" $fam "* ]] && kept="$kept $fam"
  done
  [ -z "$kept" ] || CHAINS+=("${kept# }")
done
[ "$jobs" -ge 2 ] || CHAINS=("${ORDER[*]}")
out=$(mktemp -d); trap 'rm -rf "$kwok_tmp" "$out"' EXIT
pids=()
for chain in "${CHAINS[@]}"; do
  # shellcheck disable=SC2086  # a chain is a list of words
  ( set -e; for fam in $chain; do "build_$fam" > "$out/$fam"; done ) &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
[ $failed = 0 ] || { log "a build failed (its lines above)"; exit 1; }
for fam in "${ORDER[@]}"; do cat "$out/$fam"; done
