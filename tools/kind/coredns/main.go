// CoreDNS for the kind nodes' cluster DNS (tools/kind-node.sh makes it the image
// registry.k8s.io/coredns/coredns that kubeadm deploys): the plugins of kubeadm's own
// Corefile (cmd/kubeadm/app/phases/addons/dns), in CoreDNS's order (plugin.cfg); the
// rest of CoreDNS's plugins (and their cloud SDKs) are not linked in.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func init() {
	dnsserver.Directives = []string{
		"reload", "ready", "health", "prometheus", "errors", "log", "loadbalance",
		"cache", "kubernetes", "loop", "forward",
	}
}

func main() { coremain.Run() }
