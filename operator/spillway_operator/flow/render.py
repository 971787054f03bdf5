"""Pure functions: (InferenceDeployment, Plan) -> the child manifests.

No API calls here (nor REST paths: those are ``kube``'s). Every child carries the
same labels, an owner reference to the InferenceDeployment (so deletion cascades
through the garbage collector), and only the fields Spillway owns (server-side
apply merges the rest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spillway_engine.planner.plan import Plan
from spillway_engine.quantity import format_bytes, parse_bytes
from spillway_engine.seam import (
    DISK_TIER_MOUNT,
    DIST_PORT,
    ENGINE_OPTIONS_FILE,
    ENGINE_PORT,
    PLAN_FILE,
    READY_PATH,
    EngineOptions,
    event_port_name,
)
from spillway_operator.flow import disruption, rollout
from spillway_operator.flow.pools import POOL_LABEL, product_labels
from spillway_operator.flow.routing import EndpointPicker
from spillway_operator.flow.spec import (
    GROUP,
    KIND,
    VERSION,
    DiskVolume,
    InferenceDeploymentSpec,
    WeightsSource,
)
from spillway_operator.names import (
    FIELD_MANAGER,
    INFERENCE_POOL_API,
    INFERENCE_POOL_KIND,
    LWS_API,
    LWS_GROUP_KEY,
    LWS_KIND,
    LWS_WORKER_INDEX,
    inference_pool_name,
)

PLAN_MOUNT = "/etc/spillway/plan"
MODEL_CACHE = "/models-cache"
DEFAULT_CPU_PER_GPU = 4

@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment a child belongs to; ``pool``: the GPU pool whose
    workload and plan it is (None: the object's own, shared by every pool)."""

    name: str
    namespace: str
    uid: str
    pool: str | None = None

    def shared(self) -> Owner:
        return Owner(self.name, self.namespace, self.uid)


def workload_name(owner: Owner) -> str:
    """The workload (Deployment or LeaderWorkerSet) of the owner's pool: the object's
    name, or <name>-<pool>."""
    return owner.name if owner.pool is None else f"{owner.name}-{owner.pool}"


def plan_configmap_name(owner: Owner) -> str:
    return f"{workload_name(owner)}-plan"


def labels(owner: Owner) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "spillway-engine",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        f"{GROUP}/inference-deployment": owner.name,
        **({} if owner.pool is None else {POOL_LABEL: owner.pool}),
    }


def selector_labels(owner: Owner) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "spillway-engine",
        f"{GROUP}/inference-deployment": owner.name,
    }


def workload_selector(owner: Owner) -> dict[str, str]:
    """The pods of the owner's pool alone (a pool's workload must not count another's)."""
    pool = {} if owner.pool is None else {POOL_LABEL: owner.pool}
    return {**selector_labels(owner), **pool}


def serving_labels(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, str]:
    """The pods that answer requests: all of them, or each group's leader (a worker pod
    of a multi-node replica runs headless ranks and serves no API)."""
    if spec.nodes == 1:
        return selector_labels(owner)
    return {**selector_labels(owner), LWS_WORKER_INDEX: "0"}


def serves(pod: dict[str, Any]) -> bool:
    """Whether a pod answers requests and exports the engine's metrics: not a worker
    of a multi-node group (LWS's worker index above 0)."""
    index = ((pod.get("metadata") or {}).get("labels") or {}).get(LWS_WORKER_INDEX)
    return index in (None, "0")


def selector_string(owner: Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(owner).items()))


def _meta(owner: Owner, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner),
        "ownerReferences": [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def plan_json(plan: Plan) -> str:
    """The plan file the engine reads (stable text: its hash names the pods' plan)."""
    return plan.file_text


def plan_hash(plan: Plan) -> str:
    return plan.file_hash


def engine_options(spec: InferenceDeploymentSpec) -> EngineOptions:
    """Serving options the engine reads beside the plan (never secrets)."""
    return EngineOptions(
        model=spec.model.name,
        revision=spec.model.revision,
        served_model_name=spec.model.served_model_name or spec.model.name,
        weights_path=spec.weights.pvc.path if spec.weights.pvc else None,
        gpu_memory_utilization=spec.engine.gpu_memory_utilization,
        dtype=spec.engine.dtype.value,
        eviction_policy=spec.offload.eviction_policy.value,
        offload_enabled=spec.offload.enabled,
        kv_events=spec.engine.kv_events.enabled,
        kv_events_port=spec.engine.kv_events.port,
        extra_args=tuple(spec.engine.extra_args),
    )


def plan_configmap(owner: Owner, spec: InferenceDeploymentSpec, plan: Plan) -> dict[str, Any]:
    """The plan the engine checks at start-up, and its serving options beside it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, plan_configmap_name(owner)),
        "data": {PLAN_FILE: plan_json(plan), ENGINE_OPTIONS_FILE: engine_options(spec).to_json()},
    }


def service(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "type": "ClusterIP",
            "selector": serving_labels(owner, spec),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def service_monitor(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def inference_pool(owner: Owner, spec: InferenceDeploymentSpec,
                   picker: EndpointPicker) -> dict[str, Any]:
    """The Gateway API Inference Extension's InferencePool (v1) of the engine pods: the
    pods the Deployment, Service and spillway-router select, on the engine's HTTP port,
    with the endpoint picker's Service as the gateway's ext_proc server."""
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": INFERENCE_POOL_KIND,
        "metadata": _meta(owner, inference_pool_name(owner.name)),
        "spec": {
            "selector": {"matchLabels": serving_labels(owner, spec)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker.service,
                # The Service's port, not the container's (GIE's rule for a Service).
                "port": {"number": picker.port},
                "failureMode": spec.routing.endpoint_picker.failure_mode.value,
            },
        },
    }


def _node_affinity(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    term = {
        "matchExpressions": [
            {
                "key": "nvidia.com/gpu.product",
                "operator": "In",
                "values": product_labels(spec),
            }
        ]
    }
    affinity = json.loads(json.dumps(spec.resources.affinity or {}))
    required = affinity.setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {}
    )
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append(term)
    else:  # node selector terms are ORed: the GPU product must hold in each
        for t in terms:
            t.setdefault("matchExpressions", []).extend(term["matchExpressions"])
    return affinity


def _env(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": MODEL_CACHE},
        {"name": "SPILLWAY_PLAN", "value": f"{PLAN_MOUNT}/{PLAN_FILE}"},
        # the address the engine's KV-event publisher binds (spillway_engine serve)
        {"name": "SPILLWAY_POD_IP",
         "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
    ]
    token = spec.model.token_secret_ref
    if token:  # referenced, never copied: the token stays in its Secret
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}},
            }
        )
    return env + [e.model_dump(by_alias=True, exclude_none=True) for e in spec.engine.env or []]


def _volumes(owner: Owner, spec: InferenceDeploymentSpec, plan: Plan):
    shm = plan.pod.shm_bytes
    volumes = [
        {"name": "plan", "configMap": {"name": plan_configmap_name(owner)}},
        # The host offload pool lives in /dev/shm, so it is memory-backed and sized
        # by the plan (the default 64 MiB container /dev/shm would refuse it).
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(shm)}},
    ]
    mounts = [
        {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if spec.weights.source == WeightsSource.PVC and spec.weights.pvc:
        volumes.append(
            {
                "name": "weights",
                "persistentVolumeClaim": {"claimName": spec.weights.pvc.claim_name,
                                          "readOnly": True},
            }
        )
        mounts.append({"name": "weights", "mountPath": spec.weights.pvc.path, "readOnly": True})
    else:
        volumes.append({"name": "model-cache", "emptyDir": {}})
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE})
    if disk := _disk_volume(owner, spec):
        volumes.append(disk)
        mounts.append({"name": "kv-disk", "mountPath": DISK_TIER_MOUNT})
    return volumes, mounts


def _disk_volume(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any] | None:
    """The disk tier's volume: the node's ephemeral storage, a claim of the pod's own,
    or the shared claim every replica mounts."""
    disk = spec.offload.disk
    if disk is None:
        return None
    size = format_bytes(disk.size_bytes)
    if disk.volume == DiskVolume.SHARED_PVC:
        return {"name": "kv-disk", "persistentVolumeClaim": {"claimName": disk.claim_name}}
    if disk.volume == DiskVolume.EPHEMERAL:
        claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                                 "resources": {"requests": {"storage": size}}}
        if disk.storage_class_name:
            claim["storageClassName"] = disk.storage_class_name
        return {"name": "kv-disk", "ephemeral": {"volumeClaimTemplate": {
            "metadata": {"labels": selector_labels(owner)}, "spec": claim}}}
    # The kubelet evicts a pod whose emptyDir outgrows sizeLimit; the tier stays below.
    return {"name": "kv-disk", "emptyDir": {"sizeLimit": size}}


def disk_claim_refusal(spec: InferenceDeploymentSpec, claim: dict[str, Any]) -> str | None:
    """Why the shared claim cannot hold the disk tier (its access modes, its size), or
    None. The size is the bound claim's capacity, else what it requests."""
    disk = spec.offload.disk
    assert disk is not None and disk.volume == DiskVolume.SHARED_PVC
    modes = (claim.get("spec") or {}).get("accessModes") or []
    if "ReadWriteMany" not in modes:
        return (f"offload.disk.claimName: PersistentVolumeClaim {disk.claim_name} is "
                f"{'/'.join(modes) or 'without access modes'}; a disk tier every replica "
                "shares needs ReadWriteMany")
    size = ((claim.get("status") or {}).get("capacity") or {}).get("storage") or (
        (claim.get("spec") or {}).get("resources") or {}).get("requests", {}).get("storage")
    want = disk.size_bytes
    if size is not None and parse_bytes(size) < want:
        return (f"offload.disk.size: {disk.size} is more than PersistentVolumeClaim "
                f"{disk.claim_name} holds ({size})")
    return None


def _runs_anywhere(spec: InferenceDeploymentSpec) -> bool:
    """An emulated GPU needs no GPU node, unless asked to request the GPUs anyway."""
    emulated = spec.engine.emulate_gpu
    return emulated is not None and not emulated.request_gpus


def _resources(spec: InferenceDeploymentSpec, plan: Plan) -> dict[str, Any]:
    """GPUs from the spec (none when emulated); memory from the plan, plus the spec's extra."""
    gpus = str(spec.gpus_per_pod)
    extra = parse_bytes(spec.resources.extra_memory, what="resources.extraMemory") if (
        spec.resources.extra_memory) else 0
    cpu = spec.resources.cpu or str(DEFAULT_CPU_PER_GPU * spec.gpus_per_pod)
    gpu = {} if _runs_anywhere(spec) else {spec.resources.gpu_resource_name: gpus}
    disk = spec.offload.disk
    # A request only, so the scheduler picks a node with room for the tier; a limit
    # would also count the model cache, whose size the plan does not know.
    local = {} if disk is None or disk.volume != DiskVolume.EMPTY_DIR else {
        "ephemeral-storage": format_bytes(disk.size_bytes)}
    return {
        "requests": {**gpu, "cpu": cpu, **local,
                     "memory": format_bytes(plan.pod.memory_request_bytes + extra)},
        "limits": {**gpu, "memory": format_bytes(plan.pod.memory_limit_bytes + extra)},
    }


def _engine_args(spec: InferenceDeploymentSpec) -> list[str]:
    args = ["--plan", f"{PLAN_MOUNT}/{PLAN_FILE}", "--port", str(ENGINE_PORT)]
    if spec.nodes > 1:  # node rank and leader address come from LWS's env
        args += ["--nnodes", str(spec.nodes)]
    emulated = spec.engine.emulate_gpu
    if emulated:  # the same launch, on the emulated GPU (spillway_engine.emulator)
        args += ["--emulate-gpu", "--emulate-speed", repr(emulated.speed)]
        if emulated.kv_bytes is not None:
            args += ["--emulate-kv-bytes", str(emulated.kv_bytes)]
        if emulated.model_params is not None:
            args += ["--emulate-model-params", repr(emulated.model_params)]
    return args


def _engine_container(spec: InferenceDeploymentSpec, plan: Plan,
                      mounts: list[dict[str, Any]]) -> dict[str, Any]:
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    grace = disruption.grace_period_seconds(spec, plan.max_model_len)
    return {
        "name": "engine",
        "image": spec.engine.image,
        "command": ["spillway-engine", "serve"],
        "args": _engine_args(spec),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}] + (
            [] if spec.nodes == 1 else
            [{"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"}])
        + event_ports(spec, plan),
        "env": _env(spec),
        "resources": _resources(spec, plan),
        "volumeMounts": mounts,
        # The engine writes why it did not start (preflight, plan check) to the
        # termination message; anything else that kills it leaves its last log lines.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Model downloads and loads take minutes: up to an hour to start, then
        # readiness gates traffic and liveness restarts a hung engine.
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 360},
        # Ready is vLLM's health until the preStop drain starts; then not ready, while
        # liveness (a draining engine is alive) stays /health.
        "readinessProbe": {"httpGet": {"path": READY_PATH, "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 3},
        # Stopping: no new requests, those in flight finished, then SIGTERM
        # (spillway_engine.launcher.drain); the rest of the grace period is vLLM's stop.
        "lifecycle": {"preStop": {"exec": {"command": [
            "spillway-engine", "drain", "--port", str(ENGINE_PORT),
            "--timeout", str(disruption.drain_timeout_seconds(grace))]}}},
        "livenessProbe": {**probe, "periodSeconds": 15, "failureThreshold": 4,
                          "timeoutSeconds": 5},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def _pod_spec(owner: Owner, spec: InferenceDeploymentSpec, plan: Plan) -> dict[str, Any]:
    volumes, mounts = _volumes(owner, spec, plan)
    gpu_name = spec.resources.gpu_resource_name
    tolerations = [{"key": gpu_name, "operator": "Exists", "effect": "NoSchedule"}]
    tolerations += list(spec.resources.tolerations or [])
    emulated = _runs_anywhere(spec)
    pod_spec: dict[str, Any] = {
        "containers": [_engine_container(spec, plan, mounts)],
        "volumes": volumes,
        # An emulated GPU runs on any node: no GPU product to require.
        "affinity": (json.loads(json.dumps(spec.resources.affinity or {})) if emulated
                     else _node_affinity(spec)),
        "tolerations": tolerations,
        "securityContext": {"runAsNonRoot": True, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        # Time to finish the requests in flight (spillway_operator.flow.disruption).
        "terminationGracePeriodSeconds": disruption.grace_period_seconds(spec,
                                                                         plan.max_model_len),
        "topologySpreadConstraints": disruption.topology_spread(selector_labels(owner)),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
    }
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    return pod_spec


def capacity_annotations(plan: Plan) -> dict[str, str]:
    """Each pod's planned cache capacity, for routers that score by it (spillway-router's
    approximate mode, llm-d's approximate prefix scorer) instead of a hand-set number."""
    return {
        f"{GROUP}/host-capacity-tokens": str(plan.capacity_tokens),
        f"{GROUP}/tokens-per-hash": str(plan.tokens_per_hash),
    }


#: "on": the pod publishes vLLM KV events, on its declared kv-events ports (and listed at
#: GET /kv_event_sources on its http port); "off": none (spillway_router.kube)
KV_EVENTS_ANNOTATION = f"{GROUP}/kv-events"


def event_ports(spec: InferenceDeploymentSpec, plan: Plan) -> list[dict[str, Any]]:
    """The KV-event publishers' container ports, one per data-parallel rank (base port
    + rank, spillway_engine.launcher.kv_events), on every pod of a replica: each binds
    those of the ranks it runs."""
    if not (spec.engine.kv_events.enabled and plan.enable_prefix_caching):
        return []
    base = spec.engine.kv_events.port
    return [{"name": event_port_name(r), "containerPort": base + r, "protocol": "TCP"}
            for r in range(spec.engine.data_parallel_size)]


def kv_events_annotation(spec: InferenceDeploymentSpec, plan: Plan) -> dict[str, str]:
    on = spec.engine.kv_events.enabled and plan.enable_prefix_caching
    return {KV_EVENTS_ANNOTATION: "on" if on else "off"}


def pod_disruption_budget(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """At most spec.disruption.maxUnavailable engine pods evicted at once (a node
    drain, a cluster upgrade); see disruption.budget_max_unavailable."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "maxUnavailable": disruption.budget_max_unavailable(spec),
            "selector": {"matchLabels": selector_labels(owner)},
            # A pod that is not Ready serves nothing: a drain may always evict it (the
            # default would let one crash-looping engine block every drain).
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _pod_template(owner: Owner, spec: InferenceDeploymentSpec, plan: Plan) -> dict[str, Any]:
    return {
        "metadata": {
            "labels": labels(owner),
            # A changed plan rolls the pods: they were sized for the old one.
            "annotations": {f"{GROUP}/plan-hash": plan_hash(plan),
                            **capacity_annotations(plan),
                            **kv_events_annotation(spec, plan)},
        },
        "spec": _pod_spec(owner, spec, plan),
    }


def engine_workload(owner: Owner, spec: InferenceDeploymentSpec, plan: Plan,
                    strategy: dict[str, Any] | None = None) -> dict[str, Any]:
    """What runs the replicas: a Deployment of one-pod replicas, or a LeaderWorkerSet
    whose groups are the replicas of an engine that spans nodes."""
    if spec.nodes > 1:
        return leader_worker_set(owner, spec, plan)
    return deployment(owner, spec, plan, strategy)


def _group_affinity(owner: Owner, affinity: dict[str, Any]) -> dict[str, Any]:
    """A group's pods on one zone where the cluster labels zones (preferred: the ranks
    talk every step; the group-key label is LWS's, one value per group, and the API
    server refuses a key in both matchLabelKeys and the selector)."""
    affinity = json.loads(json.dumps(affinity))
    affinity.setdefault("podAffinity", {}).setdefault(
        "preferredDuringSchedulingIgnoredDuringExecution", []).append({
            "weight": 100,
            "podAffinityTerm": {
                "topologyKey": "topology.kubernetes.io/zone",
                "labelSelector": {"matchLabels": workload_selector(owner)},
                "matchLabelKeys": [LWS_GROUP_KEY],
            }})
    return affinity


def leader_worker_set(owner: Owner, spec: InferenceDeploymentSpec,
                      plan: Plan) -> dict[str, Any]:
    """One group per replica: the leader (node rank 0, vLLM's API server) and
    nodes - 1 workers (headless ranks), from one pod template; LWS's webhook gives each
    pod its rank and the leader's address (LWS_WORKER_INDEX, LWS_LEADER_ADDRESS)."""
    template = _pod_template(owner, spec, plan)
    template["spec"]["affinity"] = _group_affinity(owner, template["spec"]["affinity"])
    return {
        "apiVersion": LWS_API,
        "kind": LWS_KIND,
        "metadata": _meta(owner, workload_name(owner)),
        "spec": {
            "replicas": spec.replicas,
            # The leader pod first, its workers once it exists (they need its address).
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.nodes,
                # A rank that dies leaves the others hung in a collective: the group
                # restarts as one.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            },
            # Whole groups, one at a time: a group without one of its pods serves nothing,
            # and no GPUs are assumed free for a surge group.
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxUnavailable": 1, "maxSurge": 0}},
            # A headless Service per group, named after its leader (<lws>-<i>): LWS's
            # Shared policy names its one Service after the LeaderWorkerSet, which is
            # the object's name, and so the serving Service's (a 422 for whichever
            # writes second, and no leader DNS if ours was first).
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
        },
    }


def deployment(owner: Owner, spec: InferenceDeploymentSpec, plan: Plan,
               strategy: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine Deployment; ``strategy`` is rollout.decide's (default: the one a
    rollout starts with)."""
    if strategy is None:
        strategy = rollout.decide(spec, None, [], 0.0).strategy
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, workload_name(owner)),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": workload_selector(owner)},
            # Surge while the cluster has room, else in place (spillway_operator.flow.rollout).
            "strategy": strategy,
            "progressDeadlineSeconds": 3600,
            "template": _pod_template(owner, spec, plan),
        },
    }
