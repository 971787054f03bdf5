"""Which routing an InferenceDeployment gets: an InferencePool of the Gateway API
Inference Extension (GIE), or none, leaving clients to spillway-router or the Service.

Pure: the operator's ``--endpoint-picker`` setting and whether the cluster serves GIE's
InferencePool API are inputs; ``render.inference_pool`` writes the object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spillway_operator.flow.status_model import Routing

# A Service name (DNS-1035 label) and a namespace name (DNS-1123 label).
_SERVICE = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"
_NAMESPACE = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_PICKER = re.compile(rf"(?:(?P<namespace>{_NAMESPACE})/)?(?P<service>{_SERVICE}):(?P<port>[0-9]+)")


@dataclass(frozen=True)
class EndpointPicker:
    """The endpoint picker's Service (its gRPC ext_proc port), which each InferencePool
    references. GIE's endpointPickerRef names a Service in the pool's own namespace, so
    with ``namespace`` set only InferenceDeployments there get a pool; without it, every
    namespace is taken to hold a Service of that name."""

    service: str
    port: int
    namespace: str | None = None

    def serves(self, namespace: str) -> bool:
        return self.namespace is None or self.namespace == namespace

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.namespace else ""
        return f"{where}{self.service}:{self.port}"


def parse_endpoint_picker(text: str) -> EndpointPicker:
    """``[NAMESPACE/]SERVICE:PORT``; ValueError saying what is wrong."""
    m = _PICKER.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r}: expected [NAMESPACE/]SERVICE:PORT, e.g. "
                         "spillway-system/spillway-router:9002 (names are lowercase DNS labels)")
    port = int(m["port"])
    if not 1 <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} is not in 1..65535")
    return EndpointPicker(m["service"], port, m["namespace"])


def decide(picker: EndpointPicker | None, namespace: str, pools_served: bool) -> Routing:
    """An InferencePool when a picker is configured for this namespace and the cluster
    serves the InferencePool API; otherwise Spillway's own routing."""
    if picker is not None and picker.serves(namespace) and pools_served:
        return Routing.INFERENCE_POOL
    return Routing.SPILLWAY_ROUTER
