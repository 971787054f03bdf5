"""Pure policy for voluntary disruptions: the PodDisruptionBudget's size, how replicas
spread over nodes and zones, and how long a stopping pod may take to drain.

No API calls and no manifests here (render.py builds the children from these).
"""

from __future__ import annotations

import math
from typing import Any

from spillway_operator.flow.spec import InferenceDeploymentSpec

#: The default grace period: a floor (a short context still needs the engine to stop
#: cleanly and the endpoints to drop the pod), a cap (a drain of a node, or an in-place
#: rollout of N replicas, waits up to N times this), and room for the stop itself.
GRACE_FLOOR_SECONDS = 60
GRACE_CAP_SECONDS = 600
GRACE_MARGIN_SECONDS = 30

HOSTNAME_KEY = "kubernetes.io/hostname"
ZONE_KEY = "topology.kubernetes.io/zone"


def budget_max_unavailable(spec: InferenceDeploymentSpec) -> int:
    """The PDB's maxUnavailable: spec.disruption.maxUnavailable for more than one
    replica. A single replica gets no protection unless asked (a budget of 0 makes
    every ``kubectl drain`` of its node wait for a person), so it is 1 then: the one
    pod may go, as without a budget."""
    d = spec.disruption
    if spec.replicas <= 1:
        return 0 if d.protect_single_replica else 1
    return d.max_unavailable


def topology_spread(selector: dict[str, str]) -> list[dict[str, Any]]:
    """Spread the replicas over nodes, then zones, both ``ScheduleAnyway``.

    Nodes: ``DoNotSchedule`` would be wrong on a GPU cluster. Skew counts every node
    the pod's affinity allows, full or not, so once the emptiest eligible node has no
    free GPU a second replica may not go where GPUs are free: it stays Pending while
    the cluster has room, and a surge pod of a rollout deadlocks the same way. A GPU
    is scarcer than spread; the PodDisruptionBudget, not the scheduler, is what keeps
    a drain from taking every replica. Zones: the same, and nodes without the zone
    label are left out of that constraint rather than refused (the kube-scheduler
    skips them for ScheduleAnyway)."""
    match = {"matchLabels": dict(selector)}
    return [
        {"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
         "labelSelector": match, "matchLabelKeys": ["pod-template-hash"]}
        for key in (HOSTNAME_KEY, ZONE_KEY)
    ]


#: Seconds of the grace period left to vLLM's own stop after the preStop drain.
STOP_SECONDS = 10


def drain_timeout_seconds(grace: int) -> int:
    """How long the preStop drain waits for the requests in flight."""
    return max(1, grace - STOP_SECONDS)


def grace_period_seconds(spec: InferenceDeploymentSpec, max_model_len: int) -> int:
    """terminationGracePeriodSeconds of the engine pods.

    spec.disruption.terminationGracePeriodSeconds when set, else

        clamp(ceil(max_model_len / decodeTokensPerSecond) + 30, 60, 600)

    The longest generation a pod can have in flight is bounded by the context length
    (prompt plus output), so at the slowest decode rate of one stream it needs at most
    max_model_len / rate seconds to finish; 30 s covers the stop itself. The cap keeps
    a drain bounded: a generation longer than that is cut (its client sees the stream
    end and retries elsewhere)."""
    d = spec.disruption
    if d.termination_grace_period_seconds is not None:
        return d.termination_grace_period_seconds
    needed = math.ceil(max_model_len / d.decode_tokens_per_second) + GRACE_MARGIN_SECONDS
    return max(GRACE_FLOOR_SECONDS, min(GRACE_CAP_SECONDS, needed))
