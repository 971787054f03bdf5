"""Day-2 policy, pure: rollout strategy on a full cluster, the disruption budget, spread
over nodes and zones, and the drain grace period."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spillway_operator.flow import disruption, render, rollout
from spillway_operator.flow.reconciler import event_type
from spillway_operator.flow.spec import InferenceDeploymentSpec
from spillway_operator.flow.status import Observed, conditions_for
from spillway_operator.flow.status_model import Condition
from tests.unit.operator.flow.test_operator_render import OWNER, plan_for

NOW = 1_800_000_000.0


def spec_of(replicas=3, **fields) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {"model": {"name": "google/gemma-3-1b-it"}, "replicas": replicas, **fields})


def stamp(seconds_ago: float) -> str:
    return datetime.fromtimestamp(NOW - seconds_ago, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def deployment(replicas=3, updated=3, total=None, strategy=None) -> dict:
    return {"metadata": {"generation": 2},
            "spec": {"replicas": replicas, "strategy": strategy or rollout.SURGE},
            "status": {"observedGeneration": 2, "replicas": replicas if total is None else total,
                       "updatedReplicas": updated, "readyReplicas": replicas}}


def pending(name="chat-new", seconds=0.0, resource="nvidia.com/gpu", deleting=False) -> dict:
    meta = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = stamp(0)
    return {"metadata": meta, "status": {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "lastTransitionTime": stamp(seconds),
        "message": f"0/3 nodes are available: 3 Insufficient {resource}."}]}}


def running(name="chat-old", deleting=False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": stamp(0)} if deleting else {})}
    return {"metadata": meta, "status": {"phase": "Running"}}


# ------------------------------------------------------------------ rollout.decide


def test_a_rollout_starts_with_a_surge_and_waits_for_the_limit():
    spec = spec_of(rollout={"surgeTimeoutSeconds": 120})
    assert rollout.decide(spec, None, [], NOW).strategy == rollout.SURGE
    rolling = deployment(updated=1, total=4)
    d = rollout.decide(spec, rolling, [pending(seconds=20)], NOW)
    assert d.strategy == rollout.SURGE and d.stuck is None
    assert d.recheck_after == pytest.approx(100)


def test_auto_replaces_in_place_once_the_surge_pod_waited_too_long():
    spec = spec_of(rollout={"surgeTimeoutSeconds": 120})
    d = rollout.decide(spec, deployment(updated=1, total=4), [pending(seconds=121)], NOW)
    assert d.strategy == rollout.IN_PLACE and d.in_place and d.stuck is None
    # It holds for the rest of the rollout, though the pod got scheduled...
    live = deployment(updated=2, total=3, strategy=rollout.IN_PLACE)
    assert rollout.decide(spec, live, [running()], NOW).strategy == rollout.IN_PLACE
    # ... and the next rollout starts with a surge again.
    done = deployment(updated=3, total=3, strategy=rollout.IN_PLACE)
    d = rollout.decide(spec, done, [running()], NOW)
    assert d.strategy == rollout.SURGE and not d.in_place


def test_a_pending_pod_outside_a_rollout_or_for_another_resource_is_no_stuck_surge():
    spec = spec_of(rollout={"surgeTimeoutSeconds": 0})
    # A scale-up with no GPU is InsufficientGPUCapacity's business, not the rollout's.
    assert rollout.decide(spec, deployment(), [pending(seconds=999)], NOW).strategy == \
        rollout.SURGE
    rolling = deployment(updated=1, total=4)
    d = rollout.decide(spec, rolling, [pending(seconds=999, resource="memory")], NOW)
    assert d == rollout.Decision(rollout.SURGE)
    d = rollout.decide(spec, rolling, [pending(seconds=999, deleting=True)], NOW)
    assert d == rollout.Decision(rollout.SURGE)


def test_one_replica_is_reported_never_replaced_in_place_on_its_own():
    spec = spec_of(replicas=1, rollout={"surgeTimeoutSeconds": 60})
    d = rollout.decide(spec, deployment(1, updated=1, total=2), [pending(seconds=61)], NOW)
    assert d.strategy == rollout.SURGE and not d.in_place
    reason, message = d.stuck
    assert reason == "InsufficientGPUForSurge"
    assert "chat-new" in message and "Recreate" in message and "gap" in message


def test_surge_reports_and_explicit_strategies_are_rendered_as_asked():
    spec = spec_of(rollout={"strategy": "Surge", "surgeTimeoutSeconds": 60})
    d = rollout.decide(spec, deployment(updated=1, total=4), [pending(seconds=61)], NOW)
    assert d.strategy == rollout.SURGE and d.stuck[0] == "InsufficientGPUForSurge"
    assert "InPlace" in d.stuck[1]
    for name, want in (("InPlace", rollout.IN_PLACE), ("Recreate", rollout.RECREATE)):
        s = spec_of(rollout={"strategy": name})
        assert rollout.decide(s, deployment(updated=1, total=4), [pending(seconds=999)],
                              NOW).strategy == want
        assert render.deployment(OWNER, s, plan_for(s))["spec"]["strategy"] == want


def test_in_place_is_stuck_only_when_no_old_pod_is_stopping():
    spec = spec_of(rollout={"strategy": "InPlace", "surgeTimeoutSeconds": 60})
    rolling = deployment(updated=1, total=3, strategy=rollout.IN_PLACE)
    waiting = pending(seconds=300)
    assert rollout.decide(spec, rolling, [waiting, running(deleting=True)], NOW).stuck is None
    reason, message = rollout.decide(spec, rolling, [waiting, running()], NOW).stuck
    assert reason == "InsufficientGPUForRollout" and "Recreate" in message


def test_a_stuck_surge_is_progressing_false_with_a_warning_event():
    spec = spec_of(replicas=1, rollout={"surgeTimeoutSeconds": 0})
    dep = deployment(1, updated=1, total=2)
    d = rollout.decide(spec, dep, [pending(seconds=5)], NOW)
    obs = Observed(generation=2, desired_replicas=1, deployment=dep, pods=[pending(seconds=5)],
                   rollout_stuck=d.stuck, rollout_in_place=d.in_place)
    progressing = next(c for c in conditions_for(obs) if c.type == "Progressing")
    assert (progressing.status, progressing.reason) == (False, "InsufficientGPUForSurge")
    cond = Condition(type="Progressing", status="False", reason=progressing.reason,
                     message=progressing.message, last_transition_time=stamp(0))
    assert event_type(cond) == "Warning"
    # Scaled to zero on purpose is no warning (it was one per object and a log line).
    assert event_type(Condition(type="Available", status="False", reason="ScaledToZero",
                                message="replicas is 0", last_transition_time=stamp(0))) == \
        "Normal"
    assert event_type(Condition(type="Available", status="False", reason="EngineFailing",
                                message="x", last_transition_time=stamp(0))) == "Warning"
    obs.rollout_stuck, obs.rollout_in_place = None, True
    progressing = next(c for c in conditions_for(obs) if c.type == "Progressing")
    assert (progressing.status, progressing.reason) == (True, "RollingOutInPlace")


# ------------------------------------------------------------------ disruption


def test_budget_is_one_by_default_and_none_for_a_single_replica_unless_asked():
    assert disruption.budget_max_unavailable(spec_of(3)) == 1
    assert disruption.budget_max_unavailable(spec_of(3, disruption={"maxUnavailable": 2})) == 2
    assert disruption.budget_max_unavailable(spec_of(1)) == 1  # the one pod may go
    assert disruption.budget_max_unavailable(
        spec_of(1, disruption={"protectSingleReplica": True})) == 0
    pdb = render.pod_disruption_budget(OWNER, spec_of(4))
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == render.selector_labels(OWNER)
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_pods_spread_softly_over_nodes_and_zones():
    spec = spec_of(3)
    pod = render.deployment(OWNER, spec, plan_for(spec))["spec"]["template"]["spec"]
    spread = pod["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in spread] == ["kubernetes.io/hostname",
                                                  "topology.kubernetes.io/zone"]
    assert {c["whenUnsatisfiable"] for c in spread} == {"ScheduleAnyway"}
    assert all(c["labelSelector"]["matchLabels"] == render.selector_labels(OWNER)
               for c in spread)


def test_grace_period_follows_context_length_and_rate_capped():
    # 4096 tokens at 25 tokens/s: 164 s + 30 s.
    assert disruption.grace_period_seconds(spec_of(), 4096) == 194
    assert disruption.grace_period_seconds(spec_of(), 512) == 60  # floor
    assert disruption.grace_period_seconds(spec_of(), 131072) == 600  # cap
    fast = spec_of(disruption={"decodeTokensPerSecond": 100})
    assert disruption.grace_period_seconds(fast, 8192) == 82 + 30
    fixed = spec_of(disruption={"terminationGracePeriodSeconds": 45})
    assert disruption.grace_period_seconds(fixed, 131072) == 45
    spec = spec_of()
    plan = plan_for(spec)
    pod = render.deployment(OWNER, spec, plan)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == disruption.grace_period_seconds(
        spec, plan.max_model_len)


def test_a_stopping_pod_drains_before_sigterm_within_its_grace_period():
    spec = spec_of(disruption={"terminationGracePeriodSeconds": 300})
    pod = render.deployment(OWNER, spec, plan_for(spec))["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert pod["terminationGracePeriodSeconds"] == 300
    assert engine["lifecycle"]["preStop"]["exec"]["command"] == [
        "spillway-engine", "drain", "--port", "8000", "--timeout", "290"]
    assert engine["readinessProbe"]["httpGet"]["path"] == "/spillway/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
