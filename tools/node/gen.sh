#!/usr/bin/env bash
# Regenerate tools/node/go.mod for a Kubernetes version (see tools/versions.env): the
# module the real nodes' binaries build from -- the kubelet, kube-proxy and the fake GPU
# device plugin (./gpuplugin, against the same k8s.io/kubelet device plugin API).
# tools/k8s/gen.sh does it, as for the control plane's module.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec "$here/../k8s/gen.sh" "${1:?usage: gen.sh 1.35.4}" "$here" kubelet kube-proxy
