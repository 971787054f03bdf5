"""Backends from the cluster: a watch of the engine pods (labels from
spillway_operator.flow.render) and each InferenceDeployment's plan ConfigMap.

The pure part, :func:`backend_from_pod`, turns a pod and its deployment's plan into
a Backend (or None while the pod is not ready). The watch runs the blocking
``kubernetes`` client in a thread and hands pods to the event loop.
RBAC: pods get/list/watch and configmaps get, in the router's namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .backends import EVENTS_FROM_POD, Backend, Profile, profile_from_plan

log = logging.getLogger("spillway.router.kube")

SELECTOR = "app.kubernetes.io/name=spillway-engine"
DEPLOYMENT_LABEL = "spillway.dev/inference-deployment"
#: a GPU pool's pods (spec.resources.gpuPools): their plan is <deployment>-<pool>-plan
POOL_LABEL = "spillway.dev/gpu-pool"
PLAN_HASH = "spillway.dev/plan-hash"
#: set by the operator on a replica chosen for removal: it takes no new requests
DRAINING = "spillway.dev/draining"
#: "on": the pod publishes KV events, on its declared ``kv-events*`` container ports (and
#: lists them at /kv_event_sources); "off": none (spillway_operator.flow.render); pods
#: without it publish on --events-port
KV_EVENTS = "spillway.dev/kv-events"
#: the engine container's KV-event ports: kv-events (rank 0), kv-events-1, ...
EVENT_PORT_PREFIX = "kv-events"
ENGINE_PORT = 8000
#: LWS's index of a pod in its group: only the leader (0) of a multi-node replica serves
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


@dataclass(frozen=True)
class DeploymentInfo:
    model: str
    profile: Profile
    plan_hash: str | None = None


def deployment_from_configmap(cm: Mapping[str, Any]) -> DeploymentInfo:
    """The served model name and routing profile from ``<name>-plan``'s data. Raises
    ValueError (PlanReadError is one) when it holds no usable plan."""
    from spillway_engine.planner.plan import read_plan
    from spillway_engine.seam import ENGINE_OPTIONS_FILE, PLAN_FILE, parse_engine_options

    data = cm.get("data") or {}
    engine = parse_engine_options(json.loads(data.get(ENGINE_OPTIONS_FILE) or "{}"),
                                  ENGINE_OPTIONS_FILE)
    plan = read_plan(data.get(PLAN_FILE) or "", "plan ConfigMap")
    model = engine.served_model_name or engine.model
    if not model:
        raise ValueError(f"{ENGINE_OPTIONS_FILE} names no model")
    return DeploymentInfo(model, profile_from_plan(plan))


def workload_of(labels: Mapping[str, str]) -> str | None:
    """The pod's workload, whose plan ConfigMap is <workload>-plan: its
    InferenceDeployment, or <deployment>-<pool> for a GPU pool's pod."""
    deployment = labels.get(DEPLOYMENT_LABEL)
    pool = labels.get(POOL_LABEL)
    return deployment if not deployment or not pool else f"{deployment}-{pool}"


def pod_ready(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False  # terminating: no new requests
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def backend_from_pod(
    pod: Mapping[str, Any], info: DeploymentInfo | None, events_port: int | None
) -> Backend | None:
    if info is None or not pod_ready(pod):
        return None
    meta = pod.get("metadata") or {}
    if (meta.get("labels") or {}).get(LWS_WORKER_INDEX, "0") != "0":
        return None  # a worker of a multi-node group: headless ranks, no API
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    annotations = meta.get("annotations") or {}
    events = f"tcp://{host}:{events_port}" if events_port else None
    if annotations.get(KV_EVENTS) in ("on", "off"):
        events = _declared_events(pod, host) if annotations[KV_EVENTS] == "on" else None
    profile = info.profile
    if profile.disk_group is not None:
        # one shared folder per deployment (its ReadWriteMany claim) and plan
        deployment = (meta.get("labels") or {}).get(DEPLOYMENT_LABEL, "")
        namespace = meta.get("namespace", "")
        profile = replace(profile, disk_group=f"{namespace}/{deployment}/{profile.disk_group}")
    labels = meta.get("labels") or {}
    pool = labels.get(POOL_LABEL)
    return Backend(
        name=meta.get("name", ip),
        model=info.model,
        url=f"http://{host}:{ENGINE_PORT}",
        events=events,
        profile=profile,
        draining=annotations.get(DRAINING) == "true",
        pool=None if pool is None else
        f"{meta.get('namespace', '')}/{labels.get(DEPLOYMENT_LABEL, '')}/{pool}",
    )


def event_ports(pod: Mapping[str, Any]) -> list[int]:
    """The pod's declared KV-event ports, by rank (container ports named kv-events,
    kv-events-1, ...)."""
    found: dict[int, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            name = str(port.get("name") or "")
            number = port.get("containerPort")
            if not isinstance(number, int) or port.get("protocol", "TCP") != "TCP":
                continue
            if name == EVENT_PORT_PREFIX:
                found[0] = number
            elif name.startswith(EVENT_PORT_PREFIX + "-") and name[len(EVENT_PORT_PREFIX) + 1:
                                                                    ].isdigit():
                found[int(name[len(EVENT_PORT_PREFIX) + 1:])] = number
    return [found[r] for r in sorted(found)]


def _declared_events(pod: Mapping[str, Any], host: str) -> str:
    """Where a pod with events on publishes: its declared ports on its IP, one endpoint
    per rank (space-separated); a replica over several pods, or a pod that declares
    none (made before the ports were), lists its ranks at /kv_event_sources."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    ports = event_ports(pod)
    if not ports or LWS_WORKER_INDEX in labels:  # LWS: the operator's multi-node replicas
        return EVENTS_FROM_POD
    return " ".join(f"tcp://{host}:{p}" for p in ports)


class PodWatch:
    """Keeps the router's backends equal to the ready engine pods of ``namespace``."""

    def __init__(self, namespace: str, events_port: int | None) -> None:
        self.namespace = namespace
        self.events_port = events_port
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deployments: dict[str, DeploymentInfo] = {}

    async def start(self, app: Any) -> None:
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._run, args=(app, loop), daemon=True, name="pod-watch"
        )
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()

    def _info(self, core: Any, deployment: str, pod_hash: str | None) -> DeploymentInfo | None:
        info = self._deployments.get(deployment)
        if info is not None and (pod_hash is None or info.plan_hash in (None, pod_hash)):
            return info
        try:
            cm = core.read_namespaced_config_map(f"{deployment}-plan", self.namespace)
            info = deployment_from_configmap(core.api_client.sanitize_for_serialization(cm))
        except Exception as e:
            log.warning("deployment %s: no usable plan ConfigMap (%s)", deployment, e)
            return None
        # remembered with the plan hash of the pod that asked: a new plan re-reads it
        info = DeploymentInfo(info.model, info.profile, pod_hash)
        self._deployments[deployment] = info
        return info

    def _run(self, app: Any, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        core = client.CoreV1Api()
        while not self._stop.is_set():
            try:
                w = watch.Watch()
                for ev in w.stream(
                    core.list_namespaced_pod,
                    self.namespace,
                    label_selector=SELECTOR,
                    timeout_seconds=60,
                ):
                    if self._stop.is_set():
                        w.stop()
                        return
                    pod = core.api_client.sanitize_for_serialization(ev["object"])
                    self._apply(core, app, loop, ev["type"], pod)
            except Exception as e:  # API hiccups: back off, list again
                log.warning("pod watch: %s", e)
                self._stop.wait(5)

    def _apply(self, core: Any, app: Any, loop: Any, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        deployment = workload_of(meta.get("labels") or {})
        if not name or not deployment:
            return
        pod_hash = (meta.get("annotations") or {}).get(PLAN_HASH)
        backend = None
        if kind != "DELETED" and pod_ready(pod):
            backend = backend_from_pod(
                pod, self._info(core, deployment, pod_hash), self.events_port
            )
        if backend is None:
            loop.call_soon_threadsafe(app.remove_backend, name)
        else:
            loop.call_soon_threadsafe(app.add_backend, backend)
