"""``python -m e2e.cluster up|down|status``: the local control plane for people.

The default cluster lives in $SPILLWAY_CLUSTER_DIR (default /tmp/spillway-cluster)
on fixed ports from --port-base (default 16380), so a second ``up`` finds it.
``up --real-nodes N`` adds N real nodes (kubelet, containerd, runc; e2e/nodes; root,
tools/host.sh) and then no fake KWOK nodes unless --nodes asks for some.
LeaderWorkerSet's controller runs beside the others unless ``up --no-lws``.
Exit status: 0 ok, 1 the cluster failed (the message says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from e2e.cluster.controlplane import (
    ClusterConfig,
    ClusterError,
    LocalCluster,
    Ports,
    locate_binaries,
)
from spillway_engine.planner.gpus import UnknownGpu, get_gpu

DEFAULT_DIR = Path(os.environ.get("SPILLWAY_CLUSTER_DIR", "/tmp/spillway-cluster"))
DEFAULT_PORT_BASE = 16380
NODE_COLUMNS = (
    "custom-columns=NAME:.metadata.name,"
    "READY:.status.conditions[?(@.type=='Ready')].status,"
    "GPUS:.status.allocatable.nvidia\\.com/gpu,CPU:.status.allocatable.cpu,"
    "MEMORY:.status.allocatable.memory,"
    "PRODUCT:.metadata.labels.nvidia\\.com/gpu\\.product,PODCIDR:.spec.podCIDR"
)


def _cluster(args: argparse.Namespace, need_binaries: bool) -> LocalCluster:
    config = ClusterConfig(
        workdir=args.dir,
        ports=Ports.from_base(args.port_base),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_product=args.gpu_product[-1],
        gpu_products=tuple(args.gpu_product),
        real_node_products=tuple(args.gpu_product),
        gpu_memory_mib=81559 if args.gpu_product[-1] == "NVIDIA-H100-80GB-HBM3" else None,
        pod_net=args.pod_net,
        real_nodes=args.real_nodes,
        lws=args.lws,
    )
    if need_binaries:
        config.binaries = locate_binaries(args.bin_cache, real_nodes=bool(args.real_nodes),
                                          lws=args.lws)
    return LocalCluster(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/cluster", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state and data folder")
    parser.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE,
                        help="first of nine consecutive loopback ports")
    parser.add_argument("--nodes", type=int, default=None,
                        help="fake (KWOK) GPU nodes (default 2, or 0 with --real-nodes)")
    parser.add_argument("--real-nodes", type=int, default=0,
                        help="real nodes: kubelet + containerd + runc each (needs root)")
    parser.add_argument("--no-lws", dest="lws", action="store_false",
                        help="without LeaderWorkerSet (no controller, no CRD)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-product", default="NVIDIA-H100-80GB-HBM3",
                        help="each node's GPU, a catalogue name (h100, a100, b200...) or a "
                        "GFD nvidia.com/gpu.product label; comma-separated: node i gets the "
                        "i-th, nodes past the list the last (e.g. h100,a100)")
    parser.add_argument("--pod-net", default="127.1",
                        help="node N gets pod CIDR <pod-net>.N.0/24 (must be inside 127/8)")
    parser.add_argument("--bin-cache", type=Path, default=None,
                        help="folder tools/build.sh fills (default ~/.cache/spillway/bin)")
    args = parser.parse_args(argv)
    args.gpu_product = [p.strip() for p in args.gpu_product.split(",") if p.strip()]
    try:
        for product in args.gpu_product or ["-"]:
            get_gpu(product)
    except UnknownGpu as exc:
        parser.error(f"--gpu-product: {exc}")
    if not args.pod_net.startswith("127."):
        parser.error("--pod-net must be inside 127.0.0.0/8: pod IPs are bound on loopback")
    if args.nodes is None:
        args.nodes = 0 if args.real_nodes else 2
    if not 0 <= args.real_nodes <= 8:
        parser.error("--real-nodes must be between 0 and 8")
    if not (1 if not args.real_nodes else 0) <= args.nodes <= 200:
        parser.error("--nodes must be between 1 and 200")

    try:
        if args.command == "down":
            ports = Ports.from_base(args.port_base)
            LocalCluster(ClusterConfig(workdir=args.dir, ports=ports)).stop()
            print(f"stopped the local cluster in {args.dir}")
            return 0
        if args.command == "status":
            cluster = _cluster(args, need_binaries=False)
            if cluster.running():
                print(f"up: {cluster.config.server}  KUBECONFIG={cluster.config.kubeconfig}")
                return 0
            print(f"down (no running cluster in {args.dir})")
            return 1
        cluster = _cluster(args, need_binaries=True)
        seconds = cluster.start()
        if seconds == 0.0:
            print(f"already up: {cluster.config.server}")
        else:
            print(f"control plane ready in {seconds:.1f}s: {cluster.config.server}")
        print(f"export KUBECONFIG={cluster.config.kubeconfig}")
        print(cluster.kubectl("get", "nodes", "-o", NODE_COLUMNS), end="")
        return 0
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
