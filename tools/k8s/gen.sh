#!/usr/bin/env bash
# Regenerate a go.mod that builds Kubernetes commands at a version (see tools/versions.env):
#   tools/k8s/gen.sh 1.35.4                     # tools/k8s: the control plane and kubectl
#   tools/k8s/gen.sh 1.35.4 DIR CMD...          # DIR (e.g. tools/node) with cmd/CMD tools
# k8s.io/kubernetes pins its staging modules as v0.0.0 + relative replaces, which Go
# ignores in dependencies; so we replace every staging module with its v0.X.Y tag.
set -euo pipefail
V=${1:?usage: gen.sh 1.35.4 [DIR CMD...]}
here=$(cd "$(dirname "$0")" && pwd)
DIR=${2:-$here}; shift $(( $# > 1 ? 2 : 1 ))
CMDS=("$@"); [ ${#CMDS[@]} -gt 0 ] || CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
cd "$DIR"; rm -f go.mod go.sum
go mod init "spillway.dev/tools/$(basename "$DIR")"
MOD=$(go mod download -json "k8s.io/kubernetes@v$V" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
go mod edit -go="$(awk '/^go /{print $2; exit}' "$MOD")"
GD=$(grep -m1 '^godebug ' "$MOD" || true); if [ -n "$GD" ]; then go mod edit -godebug="${GD#godebug }"; fi
for m in $(awk '$2=="=>" && $3 ~ /^\.\/staging\// {print $1}' "$MOD"); do
  go mod edit -replace="$m=$m@v0.${V#1.}"
done
go mod edit -require="k8s.io/kubernetes@v$V"
for t in "${CMDS[@]}"; do
  go mod edit -tool="k8s.io/kubernetes/cmd/$t"
done
go mod tidy
