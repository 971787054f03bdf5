// CoreDNS for the real nodes' pods (e2e/nodes/dns.py): cluster names only, from the
// API server, as a cluster's kube-dns answers them. Only the plugins its Corefile
// uses are linked in; the rest of CoreDNS's plugins (and their cloud SDKs) are not.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// The order plugins run in, a subset of CoreDNS's own (plugin.cfg).
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "cache", "kubernetes"}
}

func main() { coremain.Run() }
