"""Pure functions that turn what the reconciler saw into the status it writes.

The status is built from the typed models in ``spec`` (the ones the CRD's status
schema is generated from), so a misspelt field is a Python error here instead of
a field the API server silently prunes. Conditions keep their
``lastTransitionTime`` unless their status flips, so a steady state yields an
identical status and no write.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from spillway_engine.planner.plan import Plan
from spillway_engine.quantity import human_bytes
from spillway_operator.flow.disk_health import degraded_message
from spillway_operator.flow.status_model import (
    AutoscalingStatus,
    Condition,
    ConditionType,
    DiskTierStatus,
    InferenceDeploymentStatus,
    KVGroupSummary,
    PlanSummary,
    PoolStatus,
    Routing,
)
from spillway_operator.names import GROUP, LWS_GROUP_INDEX, LWS_KIND, LWS_REVISION, LWS_WORKER_INDEX
from spillway_operator.plumbing.kube import now_rfc3339

log = logging.getLogger("spillway.status")

SCALING_ACTIVE = "ScalingActive"


@dataclass(frozen=True)
class Cond:
    type: str
    status: bool | None  # None = Unknown
    reason: str
    message: str = ""

    @property
    def status_str(self) -> str:
        return {True: "True", False: "False", None: "Unknown"}[self.status]


@dataclass
class Observed:
    """Everything the status depends on, gathered by the reconciler."""

    generation: int
    desired_replicas: int
    plan_error: tuple[str, str] | None = None  # (reason, message)
    apply_error: tuple[str, str] | None = None  # the API server refused a child
    plan_summary: PlanSummary | None = None
    deployment: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    selector: str | None = None
    # spillway_operator.flow.rollout's verdict on the live rollout
    rollout_stuck: tuple[str, str] | None = None  # (reason, message)
    rollout_in_place: bool = False
    recheck_after: float | None = None
    # What routes to the pods, decided when the children were applied (None: not this
    # time, the status keeps what it said)
    routing: Routing | None = None
    # Multi-node replicas: the groups LWS is recreating after one of their pods failed
    restarting_groups: list[str] = field(default_factory=list)
    # spec.resources.gpuPools: each pool's status ([] without pools; None: not planned
    # this time, the status keeps what it said)
    pools: list[PoolStatus] | None = None
    # Pools whose nodeSelector matches nodes of other GPU products, one message each
    # (None: not checked, no pool has a nodeSelector or nodes cannot be listed)
    mixed_products: list[str] | None = None
    # Each pool's live workload (pool None: the object's own), as applied or read
    workloads: list[tuple[str | None, dict[str, Any] | None]] | None = None


# ------------------------------------------------------------------ wire format


def read_status(raw: dict[str, Any] | None) -> InferenceDeploymentStatus:
    """The live status, typed. Fields this version does not know (written under an
    older CRD) are ignored; a status that does not parse counts as empty, so the
    next write replaces it rather than the reconcile failing for ever."""
    try:
        return InferenceDeploymentStatus.model_validate(raw or {}, extra="ignore")
    except ValidationError as exc:
        log.warning("ignoring an unreadable status: %s", exc)
        return InferenceDeploymentStatus()


def to_wire(model: BaseModel) -> dict[str, Any]:
    """A status model as the API server stores it: camelCase, unset fields left out."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def merge_patch(live: dict[str, Any], desired: dict[str, Any],
                keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``live`` into ``desired``: changed
    keys set, keys ``desired`` lacks set to null, maps patched key by key, anything
    else replaced whole; {} when they agree (no write). ``keep``: top-level keys that
    belong to another writer and are left as they are.

    A patch of ``desired`` alone cannot clear a field: the serializer leaves unset
    fields out, and a merge patch keeps what it does not name. The autoscaler sent
    the same patch every tick for ever once a pod had had a metrics problem."""
    patch: dict[str, Any] = {}
    for key in live.keys() - desired.keys() - keep:
        patch[key] = None
    for key, want in desired.items():
        have = live.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            if sub := merge_patch(have, want):
                patch[key] = sub
        elif not _same(have, want):
            patch[key] = want
    return patch


def _same(a: Any, b: Any) -> bool:
    """JSON equality, with 1 == 1.0 (the API server hands a whole float back as an
    int) but True != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ------------------------------------------------------------------ conditions


def unschedulable_message(pods: list[dict[str, Any]]) -> str | None:
    """The scheduler's message for the first pod it could not place, if any."""
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        for c in pod.get("status", {}).get("conditions", []) or []:
            if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
                return c.get("message") or "the scheduler could not place a pod"
    return None


#: Characters of an engine's termination message kept in a condition (the kubelet
#: keeps up to 4096 bytes; an Event message holds 1024).
ENGINE_MESSAGE_CHARS = 900


def _exit_of(cs: dict[str, Any]) -> dict[str, Any] | None:
    """The container's last non-zero exit (now, or before its restart), if any."""
    for state in (cs.get("state"), cs.get("lastState")):
        terminated = (state or {}).get("terminated") or {}
        if terminated and terminated.get("exitCode") not in (0, None):
            return terminated
    return None


#: The kubelet's waiting reasons for a container that does not start and will not
#: without a change (of the spec, the image, the node or a referenced object):
#: crash loops, image pulls that fail (ErrImagePull, then ImagePullBackOff),
#: references it cannot parse (InvalidImageName) or may not pull (ErrImageNeverPull:
#: pull policy Never and no local image), and containers the runtime cannot create or
#: start (CreateContainerConfigError: a missing ConfigMap or Secret key, a non-root
#: image run as root; CreateContainerError; RunContainerError). ContainerCreating and
#: PodInitializing are on their way.
FAILING_WAITING_REASONS = frozenset({
    "CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
    "ErrImageNeverPull", "CreateContainerConfigError", "CreateContainerError",
    "RunContainerError",
})


def _memory_limit(pod: dict[str, Any], container: str | None) -> str | None:
    for c in pod.get("spec", {}).get("containers", []) or []:
        if c.get("name") == container:
            return ((c.get("resources") or {}).get("limits") or {}).get("memory")
    return None


def pod_failure(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) for the first engine pod that is failing, if any.

    ``EngineOOMKilled``: the kernel killed the engine at its container's memory limit
    (the message names the limit, not the log tail, so it stays the same from one
    restart to the next);
    ``EngineStartFailed``: the engine exited non-zero before it served and said why
    (the launcher's preflight and the plan check write the termination message);
    ``PodsFailing``: a container the kubelet cannot start (``FAILING_WAITING_REASONS``)
    without such a message, with the kubelet's own message."""
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        name = pod["metadata"]["name"]
        for cs in pod.get("status", {}).get("containerStatuses", []) or []:
            if cs.get("ready"):
                continue
            exited = _exit_of(cs)
            if exited and exited.get("reason") == "OOMKilled":
                limit = _memory_limit(pod, cs.get("name"))
                return ("EngineOOMKilled",
                        f"pod {name}: the engine was killed at its memory limit"
                        f"{f' of {limit}' if limit else ''} (OOMKilled, exit code "
                        f"{exited.get('exitCode')}); the plan's memory is too small for what "
                        "runs in the pod: raise spec.resources.extraMemory")
            message = ((exited or {}).get("message") or "").strip()
            if exited and message:
                if len(message) > ENGINE_MESSAGE_CHARS:
                    message = message[:ENGINE_MESSAGE_CHARS] + " [...]"
                return ("EngineStartFailed",
                        f"pod {name}: engine exited with code {exited['exitCode']}: {message}")
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in FAILING_WAITING_REASONS:
                # The kubelet alternates ErrImagePull and ImagePullBackOff, and counts
                # its back-off in CrashLoopBackOff's message: shown as one steady
                # condition, else the status would be written at every retry.
                if reason in ("ErrImagePull", "ImagePullBackOff", "CrashLoopBackOff"):
                    reason = "CrashLoopBackOff" if reason == "CrashLoopBackOff" \
                        else "ImagePullBackOff"
                    return "PodsFailing", f"pod {name}: {reason}"
                detail = " ".join(str(waiting.get("message") or "").split())
                if len(detail) > ENGINE_MESSAGE_CHARS:
                    detail = detail[:ENGINE_MESSAGE_CHARS] + " [...]"
                return "PodsFailing", f"pod {name}: {reason}" + (f": {detail}" if detail else "")
    return None


@dataclass(frozen=True)
class Rollout:
    """The engine Deployment's progress, as its status reports it."""

    ready: int = 0
    updated: int = 0
    # The Deployment controller has seen our last change and every pod runs it.
    complete: bool = False

    @classmethod
    def of(cls, deployment: dict[str, Any] | None, want: int) -> Rollout:
        if deployment is None:
            return cls()
        status = deployment.get("status", {}) or {}
        spec = deployment.get("spec", {}) or {}
        updated = int(status.get("updatedReplicas") or 0)
        # A LeaderWorkerSet (replicas are groups) has no observedGeneration to compare.
        seen = deployment.get("kind") == LWS_KIND or (
            status.get("observedGeneration") == deployment["metadata"].get("generation"))
        complete = (
            seen
            and spec.get("replicas") == want
            and updated == want
            and int(status.get("replicas") or 0) == want
        )
        return cls(int(status.get("readyReplicas") or 0), updated, complete)


PLAN_HASH = f"{GROUP}/plan-hash"
#: A group as last seen whole and ready: (its leader pod's uid, its template revision)
GroupSeen = tuple[str, str]


def _pod_ready(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or [])


def group_restarts(pods: list[dict[str, Any]], size: int, seen: dict[str, GroupSeen]
                   ) -> tuple[list[str], dict[str, GroupSeen]]:
    """The groups of a LeaderWorkerSet that were whole and ready and are not now, on the
    same template (LWS recreates a group when one of its pods fails; a new template is a
    rollout, not a restart), and what to remember of the groups for next time."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        index = (pod["metadata"].get("labels") or {}).get(LWS_GROUP_INDEX)
        if index is not None:
            groups.setdefault(index, []).append(pod)
    restarting, now_seen = [], {}
    for index in sorted(set(groups) | set(seen), key=lambda i: (len(i), i)):
        members = groups.get(index, [])
        leader = next((p for p in members if (p["metadata"].get("labels") or {}).get(
            LWS_WORKER_INDEX) == "0" and not p["metadata"].get("deletionTimestamp")), None)
        revision = ((leader or {}).get("metadata", {}).get("labels") or {}).get(LWS_REVISION)
        whole = leader is not None and sum(map(_pod_ready, members)) == size
        if whole:
            now_seen[index] = (leader["metadata"]["uid"], revision or "")
        elif index in seen and members and (revision is None or revision == seen[index][1]):
            restarting.append(index)
            now_seen[index] = seen[index]
    return restarting, now_seen


def with_group_status(lws: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The LeaderWorkerSet with its status counted from its pods, in groups: replicas
    (groups with a leader), readyReplicas (groups with every pod Ready) and
    updatedReplicas (groups whose every pod runs the template's plan)."""
    template = lws["spec"]["leaderWorkerTemplate"]
    size = int(template.get("size") or 1)
    want = ((template["workerTemplate"].get("metadata") or {}).get("annotations") or {}).get(
        PLAN_HASH)
    groups: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        meta = pod["metadata"]
        index = (meta.get("labels") or {}).get(LWS_GROUP_INDEX)
        if index is not None and not meta.get("deletionTimestamp"):
            groups.setdefault(index, []).append(pod)
    led = [m for m in groups.values() if any(
        (p["metadata"].get("labels") or {}).get(LWS_WORKER_INDEX) == "0" for p in m)]
    whole = [m for m in led if len(m) == size]
    status = {
        "replicas": len(led),
        "readyReplicas": sum(1 for m in whole if all(map(_pod_ready, m))),
        "updatedReplicas": sum(1 for m in whole if all(
            ((p["metadata"].get("annotations") or {}).get(PLAN_HASH)) == want for p in m)),
    }
    return {**lws, "status": {**(lws.get("status") or {}), **status}}


def _plan_ready(obs: Observed) -> Cond:
    if obs.plan_error:
        reason, message = obs.plan_error
        return Cond(ConditionType.PLAN_READY, False, reason, message)
    return Cond(ConditionType.PLAN_READY, True, "PlanComputed",
                "offload plan computed and published")


def _available(obs: Observed, r: Rollout, unschedulable: str | None) -> Cond:
    want = obs.desired_replicas
    if obs.deployment is None:
        if obs.apply_error:
            return Cond(ConditionType.AVAILABLE, False, obs.apply_error[0],
                        "no engine Deployment: " + obs.apply_error[1])
        reason = "PlanNotReady" if obs.plan_error else "DeploymentPending"
        return Cond(ConditionType.AVAILABLE, False, reason, "no engine Deployment yet")
    if r.ready >= want and want > 0:
        return Cond(ConditionType.AVAILABLE, True, "MinimumReplicasAvailable",
                    f"{r.ready}/{want} engine pods ready")
    if want == 0:
        return Cond(ConditionType.AVAILABLE, False, "ScaledToZero", "replicas is 0")
    if unschedulable:
        return Cond(ConditionType.AVAILABLE, False, "InsufficientGPUCapacity",
                    f"{r.ready}/{want} ready; {unschedulable}")
    return Cond(ConditionType.AVAILABLE, False, "PodsNotReady",
                f"{r.ready}/{want} engine pods ready")


def _progressing(obs: Observed, r: Rollout) -> Cond:
    want = obs.desired_replicas
    if obs.apply_error:
        return Cond(ConditionType.PROGRESSING, False, obs.apply_error[0],
                    "the API server refused a child object; change the spec")
    if obs.deployment is None and obs.plan_error:
        return Cond(ConditionType.PROGRESSING, False, "PlanNotReady", "nothing to roll out")
    if r.complete and r.ready >= want:
        return Cond(ConditionType.PROGRESSING, False, "RolloutComplete",
                    "all engine pods run the current plan")
    if obs.rollout_stuck:
        return Cond(ConditionType.PROGRESSING, False, *obs.rollout_stuck)
    if obs.rollout_in_place:
        return Cond(ConditionType.PROGRESSING, True, "RollingOutInPlace",
                    f"no GPU for an extra pod: replacing pods one at a time; "
                    f"{r.updated}/{want} pods updated, {r.ready} ready")
    return Cond(ConditionType.PROGRESSING, True, "RollingOut",
                f"{r.updated}/{want} pods updated, {r.ready} ready")


def _degraded(obs: Observed, unschedulable: str | None,
              failure: tuple[str, str] | None, disk: DiskTierStatus | None = None) -> Cond:
    if obs.plan_error and obs.deployment is not None:
        return Cond(ConditionType.DEGRADED, True, obs.plan_error[0],
                    "the new spec cannot be planned; pods keep the last good plan: "
                    + obs.plan_error[1])
    if obs.apply_error:
        return Cond(ConditionType.DEGRADED, True, obs.apply_error[0], obs.apply_error[1])
    if unschedulable:
        return Cond(ConditionType.DEGRADED, True, "InsufficientGPUCapacity", unschedulable)
    if failure:
        return Cond(ConditionType.DEGRADED, True, *failure)
    if obs.restarting_groups:
        return Cond(ConditionType.DEGRADED, True, "GroupRestarting",
                    f"group(s) {', '.join(obs.restarting_groups)} restarting: a pod of the "
                    "group failed and LeaderWorkerSet recreates the whole group (its ranks "
                    "run one vLLM instance)")
    if disk is not None and disk.failing_pods:
        return Cond(ConditionType.DEGRADED, True, "DiskTierWriteFailing",
                    degraded_message(disk))
    return Cond(ConditionType.DEGRADED, False, "AsExpected", "")


def _mixed_products(messages: list[str]) -> Cond:
    if messages:
        return Cond(ConditionType.MIXED_GPU_PRODUCTS, True, "MixedGPUProducts",
                    " | ".join(messages))
    return Cond(ConditionType.MIXED_GPU_PRODUCTS, False, "OneGPUProductPerPool",
                "each pool's nodes carry its GPU product only")


def conditions_for(obs: Observed, disk: DiskTierStatus | None = None) -> list[Cond]:
    """``disk``: status.diskTier as the autoscaler last wrote it."""
    rollout = Rollout.of(obs.deployment, obs.desired_replicas)
    unschedulable = unschedulable_message(obs.pods)
    conds = [
        _plan_ready(obs),
        _available(obs, rollout, unschedulable),
        _progressing(obs, rollout),
        _degraded(obs, unschedulable, pod_failure(obs.pods), disk),
    ]
    if obs.mixed_products is not None:
        conds.append(_mixed_products(obs.mixed_products))
    return conds


def combined_workload(workloads: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The GPU pools' workloads as one, for the conditions and replica counts: spec and
    status replicas summed, observed only when every pool's controller has seen its
    last change. One workload is itself."""
    if len(workloads) <= 1:
        return workloads[0] if workloads else None
    fields = ("replicas", "readyReplicas", "updatedReplicas", "availableReplicas")
    status = {f: sum(int((w.get("status") or {}).get(f) or 0) for w in workloads)
              for f in fields}
    seen = all(w.get("kind") == LWS_KIND or (w.get("status") or {}).get(
        "observedGeneration") == w["metadata"].get("generation") for w in workloads)
    return {"kind": "Deployment", "metadata": {"generation": 1},
            "spec": {"replicas": sum(int((w.get("spec") or {}).get("replicas") or 0)
                                     for w in workloads)},
            "status": {**status, "observedGeneration": 1 if seen else 0}}


def scaling_condition(autoscaling: AutoscalingStatus | None) -> Cond:
    """ScalingActive, from the autoscaler's last decision (it owns status.autoscaling)."""
    if autoscaling is None or autoscaling == AutoscalingStatus():
        return Cond(SCALING_ACTIVE, None, "NoDecisionYet", "waiting for the first metrics")
    reason = autoscaling.last_decision_reason or ""
    for refusal in ("MetricsUnavailable", "PolicyFailed"):
        if reason.startswith(refusal):
            return Cond(SCALING_ACTIVE, False, refusal, reason)
    pressure: float | int | None = autoscaling.pressure
    if pressure is not None and pressure.is_integer():
        pressure = int(pressure)  # as the API server hands back a whole JSON number: "1"
    return Cond(SCALING_ACTIVE, True, "ValidMetrics", f"pressure {pressure}: {reason}")


def merge_conditions(old: list[Condition], new: list[Cond], generation: int,
                     now: str | None = None) -> list[Condition]:
    """The new conditions, keeping lastTransitionTime where the status did not flip."""
    previous = {c.type: c for c in old}
    now = now or now_rfc3339()
    out = []
    for c in new:
        prev = previous.get(c.type)
        held = prev is not None and prev.status == c.status_str
        out.append(Condition(
            type=c.type,
            status=c.status_str,
            reason=c.reason,
            message=c.message,
            last_transition_time=prev.last_transition_time if held else now,
            observed_generation=generation,
        ))
    return out


def transitions(old: list[Condition], new: list[Condition]) -> Iterator[Condition]:
    """The new conditions whose status or reason changed."""
    before = {c.type: (c.status, c.reason) for c in old}
    for c in new:
        if before.get(c.type) != (c.status, c.reason):
            yield c


# ------------------------------------------------------------------ status


def plan_summary(plan: Plan, gpus_per_pod: int, digest: str) -> PlanSummary:
    """The status.plan block: the figures people ask for first."""
    pool = plan.cpu_memory_bytes * plan.pod.engines  # the pod's engines (DP / nodes)
    return PlanSummary(
        offloader=plan.offloader,
        gpu=plan.gpu.name,
        gpus_per_pod=gpus_per_pod,
        nodes=plan.parallelism.nodes,
        kv_groups=[
            KVGroupSummary(kind=g.kind, num_layers=g.num_layers,
                           tokens_per_block=g.tokens_per_block, page_bytes=g.page_bytes,
                           sliding_window=g.sliding_window or None)
            for g in plan.kv_groups
        ],
        tokens_per_hash=plan.tokens_per_hash,
        blocks_per_chunk=plan.blocks_per_chunk,
        # The chunk span is Spillway's own; vLLM's offloader chunks by blocks.
        chunk_tokens=plan.spillway.chunk_tokens if plan.offloader == "spillway" else None,
        host_pool_bytes=pool,
        host_pool=human_bytes(pool),
        host_pool_bytes_per_engine=plan.cpu_memory_bytes,
        host_memory_scope="Pod" if plan.pod.host_memory_scope == "pod" else "Engine",
        num_chunks=plan.num_chunks,
        capacity_tokens=plan.capacity_tokens,
        shm_bytes=plan.pod.shm_bytes,
        memory_request_bytes=plan.pod.memory_request_bytes,
        memory_limit_bytes=plan.pod.memory_limit_bytes,
        disk_budget_bytes_per_engine=None if plan.disk is None else
        plan.disk.budget_bytes_per_engine,
        disk_capacity_tokens=None if plan.disk is None else plan.disk.capacity_tokens,
        hash=digest,
    )


def build_status(obs: Observed, old: InferenceDeploymentStatus, now: str | None = None,
                 autoscaling_enabled: bool = False) -> InferenceDeploymentStatus:
    """The reconciler's part of the status (never ``autoscaling`` or ``diskTier``: the
    scaler's, which its conditions follow)."""
    dep_status = (obs.deployment or {}).get("status", {}) or {}
    conds = conditions_for(obs, old.disk_tier)
    if autoscaling_enabled:
        conds.append(scaling_condition(old.autoscaling))
    return InferenceDeploymentStatus(
        observed_generation=obs.generation,
        replicas=int(dep_status.get("replicas") or 0),
        ready_replicas=int(dep_status.get("readyReplicas") or 0),
        selector=obs.selector,
        conditions=merge_conditions(old.conditions, conds, obs.generation, now),
        # No plan this time (refused, or config unavailable): the pods run the last one.
        plan=obs.plan_summary if obs.plan_summary is not None else old.plan,
        pools=old.pools if obs.pools is None else (obs.pools or None),
        routing=obs.routing if obs.routing is not None else old.routing,
    )
