//go:build tools

// The kind CLI and crictl (which kind's `kind load` runs inside the nodes), pinned here
// and built by tools/build.sh (families kind and crictl); tools/kind-node.sh puts crictl
// into the node image.
package tools

import (
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
	_ "sigs.k8s.io/kind"
)
