#!/usr/bin/env bash
# Regenerate tools/k8s/go.mod for a Kubernetes version (see tools/versions.env).
# k8s.io/kubernetes pins its staging modules as v0.0.0 + relative replaces, which Go
# ignores in dependencies; so we replace every staging module with its v0.X.Y tag.
set -euo pipefail
V=${1:?usage: gen.sh 1.35.4}
cd "$(dirname "$0")"; rm -f go.mod go.sum
go mod init spillway.dev/tools/k8s
MOD=$(go mod download -json "k8s.io/kubernetes@v$V" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
go mod edit -go="$(awk '/^go /{print $2; exit}' "$MOD")"
GD=$(grep -m1 '^godebug ' "$MOD" || true); if [ -n "$GD" ]; then go mod edit -godebug="${GD#godebug }"; fi
for m in $(awk '$2=="=>" && $3 ~ /^\.\/staging\// {print $1}' "$MOD"); do
  go mod edit -replace="$m=$m@v0.${V#1.}"
done
go mod edit -require="k8s.io/kubernetes@v$V"
for t in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  go mod edit -tool="k8s.io/kubernetes/cmd/$t"
done
go mod tidy
