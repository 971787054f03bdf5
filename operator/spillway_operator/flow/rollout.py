"""Pure: the engine Deployment's update strategy, and whether a rollout is stuck.

How "room for one more pod" is decided: by the scheduler's own verdict, not by
arithmetic in the operator. A rollout starts with one extra pod (maxSurge 1,
maxUnavailable 0: no serving capacity is lost). If the cluster has room, that pod
schedules and the rollout proceeds as always. If it has not, the scheduler marks the
pod Unschedulable with "Insufficient nvidia.com/gpu"; after spec.rollout
.surgeTimeoutSeconds (time for a cluster autoscaler to add a node) the strategy
becomes in place (maxSurge 0, maxUnavailable 1): one old pod goes, its GPUs take the
new pod, and so on. The in-place strategy holds until the rollout ends (the live
Deployment still has pods of an older template), so it does not flip back to surge
at every step; the next rollout starts with a surge again.

Why not count free GPUs (nodes' allocatable minus the requests of their pods)? That
copy of the scheduler would disagree with it on taints, affinity, other resources,
the device plugin's health and pods being bound right now, and it needs cluster-wide
read access to nodes and every pod. The Pending pod is what a platform team already
reads, it costs no extra permission, and the delay it adds happens only on a full
cluster, once per rollout.

A single replica is never switched in place on its own: that is a gap in service.
Its stuck surge is reported (Progressing=False, InsufficientGPUForSurge, a Warning
Event saying what to do); spec.rollout.strategy Recreate or InPlace accepts the gap.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spillway_operator.flow.spec import InferenceDeploymentSpec, RolloutStrategy

SURGE = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
IN_PLACE = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
RECREATE = {"type": "Recreate"}

#: Progressing=False reasons.
INSUFFICIENT_GPU_FOR_SURGE = "InsufficientGPUForSurge"
INSUFFICIENT_GPU_FOR_ROLLOUT = "InsufficientGPUForRollout"
#: Progressing=True while Auto replaces in place.
ROLLING_OUT_IN_PLACE = "RollingOutInPlace"


@dataclass(frozen=True)
class Decision:
    strategy: dict[str, Any]
    in_place: bool = False  # Auto replaces in place for the rest of this rollout
    stuck: tuple[str, str] | None = None  # (reason, message): Progressing=False
    recheck_after: float | None = None  # seconds until a Pending pod reaches the limit


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def old_pods(deployment: dict[str, Any] | None) -> int:
    """Pods of an older template the Deployment still runs (0: no rollout under way)."""
    status = (deployment or {}).get("status") or {}
    return max(0, int(status.get("replicas") or 0) - int(status.get("updatedReplicas") or 0))


def live_in_place(deployment: dict[str, Any] | None) -> bool:
    strategy = ((deployment or {}).get("spec") or {}).get("strategy") or {}
    rolling = strategy.get("rollingUpdate") or {}
    return strategy.get("type") == "RollingUpdate" and str(rolling.get("maxSurge")) == "0"


def waiting_for_gpu(pods: list[dict[str, Any]], gpu_resource: str,
                    now: float) -> list[tuple[str, float, str]]:
    """(name, seconds waiting, scheduler message) of each pod the scheduler could not
    place for lack of ``gpu_resource``, longest waiting first."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        for c in (pod.get("status") or {}).get("conditions") or []:
            message = c.get("message") or ""
            if (c.get("type") == "PodScheduled" and c.get("status") == "False"
                    and c.get("reason") == "Unschedulable"
                    and f"Insufficient {gpu_resource}" in message):
                since = _parse_time(c.get("lastTransitionTime")) or _parse_time(
                    meta.get("creationTimestamp")) or now
                out.append((meta.get("name", "?"), max(0.0, now - since), message))
    return sorted(out, key=lambda p: -p[1])


def _terminating(pods: list[dict[str, Any]]) -> bool:
    return any((p.get("metadata") or {}).get("deletionTimestamp") for p in pods)


def _stuck_message(spec: InferenceDeploymentSpec, name: str, waited: float,
                   why: str) -> str:
    gpu = spec.resources.gpu_resource_name
    if spec.replicas <= 1:
        advice = ("Free one pod's GPUs (or add a node), or set spec.rollout.strategy to "
                  "Recreate: with one replica, an update in place means a gap in service")
    else:
        advice = ("Free one pod's GPUs (or add a node), or set spec.rollout.strategy to "
                  "Auto or InPlace to replace pods one at a time")
    return (f"no room for an extra engine pod: pod {name} has waited {waited:.0f}s for "
            f"{gpu} ({why}). {advice}")


def decide(spec: InferenceDeploymentSpec, deployment: dict[str, Any] | None,
           pods: list[dict[str, Any]], now: float) -> Decision:
    """The strategy to render, given the live Deployment and its pods."""
    chosen = spec.rollout.strategy
    if chosen == RolloutStrategy.RECREATE:
        return Decision(RECREATE)
    rolling = old_pods(deployment) > 0
    in_place = chosen == RolloutStrategy.IN_PLACE or (
        chosen == RolloutStrategy.AUTO and spec.replicas > 1 and rolling
        and live_in_place(deployment))
    limit = spec.rollout.surge_timeout_seconds
    waiting = waiting_for_gpu(pods, spec.resources.gpu_resource_name, now) if rolling else []
    if in_place:
        auto = chosen == RolloutStrategy.AUTO
        # In place, a new pod waits for the GPUs of the old one that is stopping; it
        # is stuck only when nothing is stopping (its pod needs more GPUs than one
        # old pod frees: a larger tensor parallel size on a full cluster).
        if waiting and waiting[0][1] >= limit and not _terminating(pods):
            name, waited, why = waiting[0]
            gpu = spec.resources.gpu_resource_name
            return Decision(IN_PLACE, auto, (
                INSUFFICIENT_GPU_FOR_ROLLOUT,
                f"pod {name} has waited {waited:.0f}s for {gpu} ({why}) while no old pod "
                f"is stopping: a new pod needs more than one old pod frees. Free "
                f"{gpu} (or add a node), or set spec.rollout.strategy to Recreate"))
        return Decision(IN_PLACE, auto)
    if not waiting:
        return Decision(SURGE)
    name, waited, why = waiting[0]
    if waited < limit:
        return Decision(SURGE, recheck_after=limit - waited)
    if chosen == RolloutStrategy.AUTO and spec.replicas > 1:
        return Decision(IN_PLACE, in_place=True)
    return Decision(SURGE, stuck=(INSUFFICIENT_GPU_FOR_SURGE,
                                  _stuck_message(spec, name, waited, why)))
