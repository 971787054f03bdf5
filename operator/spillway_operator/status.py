"""Pure functions that turn what the reconciler saw into the status it writes.

Conditions keep their ``lastTransitionTime`` unless their status flips, so a
steady state yields an identical status and no write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spillway_engine.quantity import human_bytes
from spillway_operator.spec import ConditionType


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    plan_summary: dict[str, Any] | None = None
    deployment: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    selector: str | None = None


def unschedulable_message(pods: list[dict[str, Any]]) -> str | None:
    """The scheduler's message for the first pod it could not place, if any."""
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        for c in pod.get("status", {}).get("conditions", []) or []:
            if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
                return c.get("message") or "the scheduler could not place a pod"
    return None


def _crashlooping(pods: list[dict[str, Any]]) -> str | None:
    for pod in pods:
        for cs in pod.get("status", {}).get("containerStatuses", []) or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull"):
                return f"pod {pod['metadata']['name']}: {waiting['reason']}"
    return None


def conditions_for(obs: Observed) -> list[Cond]:
    if obs.plan_error:
        reason, message = obs.plan_error
        plan_ready = Cond(ConditionType.PLAN_READY, False, reason, message)
    else:
        plan_ready = Cond(ConditionType.PLAN_READY, True, "PlanComputed",
                          "offload plan computed and published")

    dep_status = (obs.deployment or {}).get("status", {}) or {}
    dep_spec = (obs.deployment or {}).get("spec", {}) or {}
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    total = int(dep_status.get("replicas") or 0)
    want = obs.desired_replicas
    rolled = (
        obs.deployment is not None
        and dep_status.get("observedGeneration") == obs.deployment["metadata"].get("generation")
        and dep_spec.get("replicas") == want
        and updated == want
        and total == want
    )
    unschedulable = unschedulable_message(obs.pods)
    crash = _crashlooping(obs.pods)

    if obs.deployment is None:
        reason = "PlanNotReady" if obs.plan_error else "DeploymentPending"
        available = Cond(ConditionType.AVAILABLE, False, reason, "no engine Deployment yet")
    elif ready >= want and want > 0:
        available = Cond(ConditionType.AVAILABLE, True, "MinimumReplicasAvailable",
                         f"{ready}/{want} engine pods ready")
    elif want == 0:
        available = Cond(ConditionType.AVAILABLE, False, "ScaledToZero", "replicas is 0")
    elif unschedulable:
        available = Cond(ConditionType.AVAILABLE, False, "InsufficientGPUCapacity",
                         f"{ready}/{want} ready; {unschedulable}")
    else:
        available = Cond(ConditionType.AVAILABLE, False, "PodsNotReady",
                         f"{ready}/{want} engine pods ready")

    if obs.deployment is None and obs.plan_error:
        progressing = Cond(ConditionType.PROGRESSING, False, "PlanNotReady", "nothing to roll out")
    elif rolled and ready >= want:
        progressing = Cond(ConditionType.PROGRESSING, False, "RolloutComplete",
                           "all engine pods run the current plan")
    else:
        progressing = Cond(ConditionType.PROGRESSING, True, "RollingOut",
                           f"{updated}/{want} pods updated, {ready} ready")

    if obs.plan_error and obs.deployment is not None:
        degraded = Cond(ConditionType.DEGRADED, True, obs.plan_error[0],
                        "the new spec cannot be planned; pods keep the last good plan: "
                        + obs.plan_error[1])
    elif unschedulable:
        degraded = Cond(ConditionType.DEGRADED, True, "InsufficientGPUCapacity", unschedulable)
    elif crash:
        degraded = Cond(ConditionType.DEGRADED, True, "PodsFailing", crash)
    else:
        degraded = Cond(ConditionType.DEGRADED, False, "AsExpected", "")
    return [plan_ready, available, progressing, degraded]


def merge_conditions(old: list[dict[str, Any]], new: list[Cond], generation: int,
                     now: str | None = None) -> list[dict[str, Any]]:
    """New condition dicts, keeping lastTransitionTime where the status did not flip."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = previous.get(c.type)
        since = prev.get("lastTransitionTime") if prev and prev.get("status") == c.status_str \
            else (now or now_rfc3339())
        out.append({
            "type": c.type,
            "status": c.status_str,
            "reason": c.reason,
            "message": c.message,
            "lastTransitionTime": since,
            "observedGeneration": generation,
        })
    return out


def plan_summary(plan: dict[str, Any], gpus_per_pod: int, digest: str) -> dict[str, Any]:
    """The status.plan block: the figures people ask for first."""
    spill = plan.get("spillway") or {}
    pod = plan["pod"]
    dp = plan.get("parallelism", {}).get("data_parallel_size", 1)
    pool = int(plan["cpu_memory_bytes"]) * dp
    return {
        "offloader": plan["offloader"],
        "gpu": plan["gpu"]["name"],
        "gpusPerPod": gpus_per_pod,
        "kvGroups": [
            {
                "kind": g["kind"],
                "numLayers": g["num_layers"],
                "tokensPerBlock": g["tokens_per_block"],
                "pageBytes": g["page_bytes"],
                **({"slidingWindow": g["sliding_window"]} if g.get("sliding_window") else {}),
            }
            for g in plan["kv_groups"]
        ],
        "tokensPerHash": plan["tokens_per_hash"],
        "blocksPerChunk": plan["blocks_per_chunk"],
        **({"chunkTokens": spill["chunk_tokens"]} if plan["offloader"] == "spillway" and spill
           else {}),
        "hostPoolBytes": pool,
        "hostPool": human_bytes(pool),
        "numChunks": plan["num_chunks"],
        "capacityTokens": plan["capacity_tokens"],
        "shmBytes": pod["shm_bytes"],
        "memoryRequestBytes": pod["memory_request_bytes"],
        "memoryLimitBytes": pod["memory_limit_bytes"],
        "hash": digest,
    }


def scaling_condition(autoscaling: dict[str, Any] | None) -> Cond:
    """ScalingActive, from the autoscaler's last decision (it owns status.autoscaling)."""
    reason = (autoscaling or {}).get("lastDecisionReason") or ""
    if not autoscaling:
        return Cond("ScalingActive", None, "NoDecisionYet", "waiting for the first metrics")
    if reason.startswith("MetricsUnavailable"):
        return Cond("ScalingActive", False, "MetricsUnavailable", reason)
    return Cond("ScalingActive", True, "ValidMetrics",
                f"pressure {autoscaling.get('pressure')}: {reason}")


def build_status(obs: Observed, old_status: dict[str, Any], now: str | None = None,
                 autoscaling_enabled: bool = False) -> dict[str, Any]:
    dep_status = (obs.deployment or {}).get("status", {}) or {}
    conds = conditions_for(obs)
    if autoscaling_enabled:
        conds.append(scaling_condition(old_status.get("autoscaling")))
    status: dict[str, Any] = {
        "observedGeneration": obs.generation,
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": int(dep_status.get("readyReplicas") or 0),
        "conditions": merge_conditions(old_status.get("conditions", []), conds,
                                       obs.generation, now),
    }
    if obs.selector:
        status["selector"] = obs.selector
    plan = obs.plan_summary if obs.plan_summary is not None else old_status.get("plan")
    if plan is not None:
        status["plan"] = plan
    return status


def transitions(old: list[dict[str, Any]], new: list[dict[str, Any]]):
    """(type, status, reason, message) of conditions whose status or reason changed."""
    before = {c["type"]: (c.get("status"), c.get("reason")) for c in old or []}
    for c in new:
        if before.get(c["type"]) != (c["status"], c["reason"]):
            yield c["type"], c["status"], c["reason"], c["message"]
