"""Real nodes for the local control plane: a real kubelet, containerd and runc per
node, pod networking (CNI bridges, one kube-proxy), fake GPUs through a device plugin.

The API the tests and the demo call::

    from e2e.cluster import ClusterConfig, LocalCluster
    from e2e.cluster.controlplane import Ports
    from e2e.nodes import load_image, BUSYBOX_REF

    cluster = LocalCluster(ClusterConfig(workdir=Path("/tmp/x"), ports=Ports.free(),
                                         nodes=0, real_nodes=2))
    cluster.start()                       # control plane + 2 Ready real GPU nodes
    cluster.config.kubeconfig             # admin kubeconfig (https://10.213.0.1:<port>)
    load_image("spillway/engine:dev")     # docker daemon -> every node's containerd
    ...                                   # pods with image BUSYBOX_REF run as they are
    cluster.stop()                        # leaves no process, mount, link or chain

``e2e/cluster/up --real-nodes 2`` / ``e2e/cluster/down`` do the same from a shell, and
``python -m e2e.nodes load REF...`` loads images into the running real nodes.
"""

from e2e.nodes.images import load_image
from e2e.nodes.ociimage import BUSYBOX_REF, PAUSE_REF
from e2e.nodes.realnodes import API_IP, CLUSTER_CIDR, NodeError, NodeSpec, RealNodes

__all__ = ["API_IP", "BUSYBOX_REF", "CLUSTER_CIDR", "PAUSE_REF", "NodeError", "NodeSpec",
           "RealNodes", "load_image"]
