"""Cluster DNS for the real nodes' pods: CoreDNS (tools/coredns, built from the Go module
proxy) as a host process on the API server's address, answering the cluster's names
from the API server as a cluster's kube-dns does.

A real cluster runs CoreDNS as pods from an image registry, which this machine cannot
reach; the pods' view is the same: the kubelets' ``clusterDNS`` points their
``/etc/resolv.conf`` at it, with the ``<ns>.svc.cluster.local`` search path. Services
resolve to their ClusterIPs, headless ones to their pods, and a pod with a hostname and
a subdomain (a LeaderWorkerSet leader: ``LWS_LEADER_ADDRESS``) to its IP. Other names
are refused at once (no forwarding: nothing outside is reachable), so a lookup never
waits on a timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.request
from pathlib import Path

CLUSTER_DOMAIN = "cluster.local"
READY_PORT = 8181  # CoreDNS's ready plugin: 200 once the kubernetes plugin has synced


def corefile(address: str, kubeconfig: Path) -> str:
    return f"""{CLUSTER_DOMAIN}:53 {{
    bind {address}
    ready {address}:{READY_PORT}
    errors
    cache 5
    kubernetes {CLUSTER_DOMAIN} {{
        kubeconfig {kubeconfig}
        pods insecure
    }}
}}
"""


def kubelet_settings(address: str) -> dict[str, object]:
    """The KubeletConfiguration fields that send pods' lookups to it."""
    return {"clusterDNS": [address], "clusterDomain": CLUSTER_DOMAIN}


def ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}:{READY_PORT}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop_stale(corefile_path: Path) -> None:
    """A CoreDNS an earlier run left on this Corefile (its record lost in a crash)
    would hold port 53 on the address: stop it."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if Path(argv[0].decode()).name == "coredns" and str(corefile_path).encode() in argv:
                os.kill(int(proc.name), signal.SIGKILL)


def start(nodes, address: str, path: Path, timeout: float) -> None:
    """Start CoreDNS for ``nodes`` (an ``e2e.nodes.realnodes.RealNodes``), recorded
    under the key ``coredns`` so a stop (or the next run's cleanup) ends it."""
    cluster = nodes.cluster
    stop_stale(path)
    # the harness's admin kubeconfig, as the control plane's own processes hold theirs
    path.write_text(corefile(address, cluster.config.kubeconfig))
    log = "coredns.log"
    proc = nodes._spawn("coredns", [str(cluster.config.binaries["coredns"]),
                                    "-conf", str(path)], log)
    nodes._wait("CoreDNS ready (the kubernetes plugin synced)", lambda: ready(address),
                proc, log, timeout)
