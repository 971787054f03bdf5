"""A real local Kubernetes control plane with fake GPU nodes, for tests and the demo.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the KWOK controller
run as plain processes on loopback; KWOK keeps fake GPU nodes Ready and moves
scheduled pods to Running/Ready with pod IPs in a 127.x range. With
``ClusterConfig(real_nodes=N)`` the cluster also gets real nodes (kubelet, containerd,
runc, pod networking, kube-proxy, fake GPUs through a device plugin): ``e2e.nodes``.
"""

from e2e.cluster.controlplane import ClusterConfig, ClusterError, LocalCluster

__all__ = ["ClusterConfig", "ClusterError", "LocalCluster"]
