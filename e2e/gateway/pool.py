"""A standalone gateway for one ``InferencePool``: what a GIE gateway controller does,
small. It reads the pool (GIE's real API: selector, target port, endpoint picker and
its failure mode), runs Envoy with the picker as its ext_proc server, and keeps the
pool's endpoints -- the Ready pods the selector matches, on the target port -- in the
file Envoy reads them from, so pods that come and go (autoscaling, a rollout) are
picked from as they do.

    with PoolGateway(api, "spillway-demo", "chat", workdir).start() as gw:
        requests to gw.url ...
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e.gateway.envoy import Envoy, GatewayConfig, write_endpoints
from spillway_router.kube import pod_ready

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def pool_endpoints(pool: dict[str, Any], pods: list[dict[str, Any]]) -> list[str]:
    """``ip:port`` of the Ready pods (as the router judges them) the pool selects,
    sorted: a stable file."""
    labels = pool["spec"]["selector"].get("matchLabels") or {}
    port = pool["spec"]["targetPorts"][0]["number"]
    return sorted(f"{pod['status']['podIP']}:{port}" for pod in pods
                  if labels.items() <= (pod["metadata"].get("labels") or {}).items()
                  and pod_ready(pod))


class PoolGateway:
    def __init__(self, api: client.ApiClient, namespace: str, name: str, workdir: Path, *,
                 port: int, admin_port: int, picker: str | None = None,
                 interval_s: float = 1.0) -> None:
        """``picker``: host:port of the endpoint picker when this machine reaches it
        otherwise than by its Service's cluster IP (a picker run as a process)."""
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace, self.name, self.workdir = namespace, name, workdir
        self.port, self.admin_port, self.picker = port, admin_port, picker
        self.interval_s = interval_s
        self.endpoints_file = workdir / "endpoints" / "pool.json"
        self.endpoints: list[str] = []
        self.envoy: Envoy | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._version = 0

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def _pool(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name)

    def _picker_address(self, pool: dict[str, Any]) -> str:
        ref = pool["spec"]["endpointPickerRef"]
        if self.picker:
            return self.picker
        svc = self.core.read_namespaced_service(ref["name"], self.namespace)
        return f"{svc.spec.cluster_ip}:{ref['port']['number']}"

    def refresh(self) -> bool:
        """Re-list the pool's pods; True when the endpoint file changed."""
        pool = self._pool()
        pods = self.core.list_namespaced_pod(self.namespace)
        endpoints = pool_endpoints(
            pool, self.core.api_client.sanitize_for_serialization(pods)["items"])
        if endpoints == self.endpoints and self.endpoints_file.exists():
            return False
        self._version += 1
        write_endpoints(self.endpoints_file, endpoints, str(self._version))
        self.endpoints = endpoints
        return True

    def start(self) -> PoolGateway:
        pool = self._pool()
        self.endpoints_file.parent.mkdir(parents=True, exist_ok=True)
        self.refresh()
        self.envoy = Envoy(GatewayConfig(
            picker=self._picker_address(pool), endpoints=self.endpoints_file,
            port=self.port, admin_port=self.admin_port,
            failure_mode=pool["spec"]["endpointPickerRef"].get("failureMode", "FailClose"),
        ), self.workdir).start()
        self._thread = threading.Thread(target=self._follow, name="pool-gateway", daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except (client.ApiException, OSError):
                continue  # the next round tries again; the file keeps the last list

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.envoy is not None:
            self.envoy.stop()

    def __enter__(self) -> PoolGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
