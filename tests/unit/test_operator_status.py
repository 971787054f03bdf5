"""Conditions and status from what the reconciler observed (pure)."""

from __future__ import annotations

from spillway_operator.controller import Backoff
from spillway_operator.status import Observed, build_status, conditions_for, transitions

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def dep(replicas=2, ready=2, updated=2, gen=3, observed=3):
    return {"metadata": {"generation": gen}, "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": updated, "observedGeneration": observed}}


def pod_unschedulable():
    return {"metadata": {"name": "p"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}


def by_type(conds):
    return {c.type: c for c in conds}


def test_healthy():
    c = by_type(conditions_for(Observed(1, 2, deployment=dep())))
    assert c["PlanReady"].status and c["Available"].status
    assert c["Progressing"].status is False and c["Progressing"].reason == "RolloutComplete"
    assert c["Degraded"].status is False


def test_unschedulable_pods_name_gpu_capacity():
    c = by_type(conditions_for(Observed(1, 2, deployment=dep(ready=1), pods=[pod_unschedulable()])))
    assert c["Available"].reason == "InsufficientGPUCapacity"
    assert "nvidia.com/gpu" in c["Available"].message
    assert c["Degraded"].status is True


def test_refused_plan_without_deployment():
    c = by_type(conditions_for(Observed(1, 1, plan_error=("OffloadPlanInvalid", "too small"))))
    assert c["PlanReady"].status is False and c["PlanReady"].message == "too small"
    assert c["Available"].reason == "PlanNotReady"
    assert c["Degraded"].status is False


def test_refused_plan_with_running_deployment_is_degraded_but_available():
    c = by_type(conditions_for(Observed(2, 2, plan_error=("OffloadPlanInvalid", "x"),
                                        deployment=dep())))
    assert c["Available"].status is True
    assert c["Degraded"].status is True and c["Degraded"].reason == "OffloadPlanInvalid"


def test_rollout_in_progress():
    c = by_type(conditions_for(Observed(1, 2, deployment=dep(updated=1, observed=2))))
    assert c["Progressing"].status is True


def test_transition_time_kept_while_status_holds():
    obs = Observed(1, 2, deployment=dep(), selector="a=b")
    first = build_status(obs, {}, now=T0)
    second = build_status(obs, first, now=T1)
    assert second == first  # steady state: identical status, so no write
    flipped = build_status(Observed(1, 2, deployment=dep(ready=0), selector="a=b"), first, now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times["Available"] == T1 and times["PlanReady"] == T0
    changed = list(transitions(first["conditions"], flipped["conditions"]))
    assert [t[0] for t in changed] == ["Available", "Progressing"]


def test_scaling_condition_follows_the_autoscaler():
    old = {"autoscaling": {"pressure": 1.2, "lastDecisionReason": "MetricsUnavailable: x"}}
    new = build_status(Observed(1, 1), old, autoscaling_enabled=True)
    assert "autoscaling" not in new  # owned by the autoscaler; the merge patch keeps it
    cond = next(c for c in new["conditions"] if c["type"] == "ScalingActive")
    assert (cond["status"], cond["reason"]) == ("False", "MetricsUnavailable")
    assert all(c["type"] != "ScalingActive" for c in build_status(Observed(1, 1), old)[
        "conditions"])


def test_backoff_grows_and_caps_and_resets():
    b = Backoff(base=1, cap=8)
    k = ("ns", "x")
    assert [b.next(k) for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    b.reset(k)
    assert b.next(k) == 1
