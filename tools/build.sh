#!/usr/bin/env bash
# Build (or reuse) the Go binaries the local control plane needs, pinned in
# tools/versions.env, into a cache under $HOME keyed by version:
#   $SPILLWAY_BIN_CACHE/{k8s-v*,etcd-v*,kwok-v*,helm-v*}/
# Prints the directory of every family on stdout, one "NAME=DIR" per line.
# Never writes into the repository.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
source "$here/versions.env"
cache=${SPILLWAY_BIN_CACHE:-$HOME/.cache/spillway/bin}
export CGO_ENABLED=0 GOFLAGS=-trimpath
mkdir -p "$cache"

log() { echo "[tools/build] $*" >&2; }

# build FAMILY VERSION BINARY... -- builds each binary named PKG:NAME with LDFLAGS
ensure() {
  local fam=$1 ver=$2 dir="$cache/$1-v$2"; shift 2
  local missing=0 b
  for b in "$@"; do [ -x "$dir/${b##*:}" ] || missing=1; done
  if [ $missing = 0 ]; then log "$fam v$ver cached in $dir"; echo "$fam=$dir"; return; fi
  log "building $fam v$ver into $dir (cold builds take minutes) ..."
  local start=$SECONDS tmp="$dir.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  for b in "$@"; do
    (cd "$here/$fam" && go build -ldflags "$LDFLAGS" -o "$tmp/${b##*:}" "${b%%:*}") >&2
  done
  rm -rf "$dir"; mv "$tmp" "$dir"
  log "$fam v$ver built in $((SECONDS - start)) s"
  echo "$fam=$dir"
}

minor=$(echo "$K8S_VERSION" | cut -d. -f2)
LDFLAGS="-s -w"
for kv in "gitVersion=v$K8S_VERSION" gitMajor=1 "gitMinor=$minor" gitTreeState=clean \
          "gitCommit=module-v$K8S_VERSION" "buildDate=1970-01-01T00:00:00Z"; do
  LDFLAGS="$LDFLAGS -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
done
ensure k8s "$K8S_VERSION" \
  k8s.io/kubernetes/cmd/kube-apiserver:kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager:kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler:kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl:kubectl

LDFLAGS="-s -w"
ensure etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3:etcd

LDFLAGS="-s -w"
ensure kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok:kwok

LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for p in pkg/lint/rules pkg/chartutil; do
  LDFLAGS="$LDFLAGS -X helm.sh/helm/v3/$p.k8sVersionMajor=1 -X helm.sh/helm/v3/$p.k8sVersionMinor=$minor"
done
ensure helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm:helm
