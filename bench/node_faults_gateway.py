"""The gateway path of ``bench.node_faults --path gateway``: the clients go through a
real Envoy asking spillway-router's endpoint picker (gRPC ext_proc), as a Gateway API
Inference Extension gateway routes, instead of through the router's proxy.

As ``python -m e2e.demo --real-nodes --gateway`` sets it up: GIE's InferencePool CRD
installed first (a GIE gateway's installation brings it), the chart with
``router.endpointPicker.enabled`` in the serving namespace (an InferencePool names a
picker Service of its own namespace), the operator's InferencePool for the object, and
Envoy on this machine (every node's network namespace: it reaches the pods and the
picker's cluster IP) built from that pool, its endpoints the pool's Ready pods, re-read
every second (``e2e.gateway.pool``).
"""

from __future__ import annotations

import time
from pathlib import Path

from kubernetes import client

from e2e.cluster.controlplane import (
    GIE_INFERENCE_POOL_CRD,
    LocalCluster,
    free_port,
    locate_gie_crds,
)
from e2e.gateway.pool import PoolGateway
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION

HELM_ARGS = ("--set", "router.endpointPicker.enabled=true")


def install_crd(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", locate_gie_crds() / GIE_INFERENCE_POOL_CRD)
    cluster.wait_established("inferencepools.inference.networking.k8s.io")


def start(api: client.ApiClient, namespace: str, name: str, workdir: Path,
          timeout: float = 300) -> PoolGateway:
    """Envoy for the object's InferencePool, once the operator says it routes by one."""
    custom = client.CustomObjectsApi(api)
    deadline = time.monotonic() + timeout
    while (custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
           .get("status", {}).get("routing")) != "InferencePool":
        if time.monotonic() > deadline:
            raise TimeoutError(f"no status.routing=InferencePool within {timeout:.0f}s")
        time.sleep(1)
    return PoolGateway(api, namespace, name, workdir, port=free_port(),
                       admin_port=free_port()).start()
