"""Conditions and status from what the reconciler observed (pure), and the status
both writers (reconciler, scaler) send: typed, declared in the CRD, steady when
nothing changed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from spillway_engine.planner.model_config import load_local
from spillway_operator.controller import Backoff
from spillway_operator.flow import crd
from spillway_operator.flow import scaler as scaler_module
from spillway_operator.flow.pressure import Aggregate
from spillway_operator.flow.reconciler import Reconciler
from spillway_operator.flow.scaler import Autoscaler, Tracked
from spillway_operator.flow.spec import InferenceDeploymentSpec
from spillway_operator.flow.status import (
    Observed,
    build_status,
    conditions_for,
    merge_patch,
    read_status,
    scaling_condition,
    to_wire,
    transitions,
)
from spillway_operator.flow.status_model import (
    AutoscalingStatus,
    Condition,
    InferenceDeploymentStatus,
)
from spillway_operator.plumbing.kube import contains

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
    first = build_status(obs, InferenceDeploymentStatus(), now=T0)
    # What the API server hands back next time is the wire form.
    second = build_status(obs, read_status(to_wire(first)), now=T1)
    assert to_wire(second) == to_wire(first)  # steady state: identical status, so no write
    flipped = build_status(Observed(1, 2, deployment=dep(ready=0), selector="a=b"), first, now=T1)
    times = {c.type: c.last_transition_time for c in flipped.conditions}
    assert times["Available"] == T1 and times["PlanReady"] == T0
    changed = list(transitions(first.conditions, flipped.conditions))
    assert [c.type for c in changed] == ["Available", "Progressing"]


def test_scaling_condition_follows_the_autoscaler():
    old = read_status({"autoscaling": {"pressure": 1.2,
                                       "lastDecisionReason": "MetricsUnavailable: x"}})
    new = build_status(Observed(1, 1), old, autoscaling_enabled=True)
    assert "autoscaling" not in to_wire(new)  # the autoscaler's; the merge patch keeps it
    cond = next(c for c in new.conditions if c.type == "ScalingActive")
    assert (cond.status, cond.reason) == ("False", "MetricsUnavailable")
    assert all(c.type != "ScalingActive" for c in build_status(Observed(1, 1), old).conditions)
    waiting = build_status(Observed(1, 1), InferenceDeploymentStatus(), autoscaling_enabled=True)
    assert waiting.conditions[-1].reason == "NoDecisionYet"


def test_a_misspelt_status_field_is_a_python_error():
    with pytest.raises(ValidationError, match="lastTransitonTime"):
        Condition(type="Available", status="True", reason="Ok", lastTransitonTime=T0)
    with pytest.raises(ValidationError, match="desired_replica"):
        AutoscalingStatus(desired_replica=2)
    with pytest.raises(ValidationError, match="ready_replica"):
        InferenceDeploymentStatus(ready_replica=1)


def test_read_status_ignores_fields_an_older_crd_had():
    old = read_status({"replicas": 2, "gone": 1, "plan": {"gpu": "h100", "gone": 2}})
    assert old.replicas == 2 and old.plan.gpu == "h100"
    assert read_status({"conditions": [{"type": "x"}]}) == InferenceDeploymentStatus()


# ------------------------------------------------------------ status on the wire

MODELS = Path(__file__).resolve().parents[3] / "fixtures" / "models"
STATUS_SCHEMA = crd.status_schema()


def undeclared(value: Any, schema: dict[str, Any], path: str = "status") -> list[str]:
    """Fields of ``value`` the CRD schema does not declare: the API server would prune
    them without a word."""
    if isinstance(value, list):
        return [f for v in value for f in undeclared(v, schema.get("items", {}), path + "[]")]
    if not isinstance(value, dict):
        return []
    if "additionalProperties" in schema:
        return [f for k, v in value.items()
                for f in undeclared(v, schema["additionalProperties"], f"{path}.{k}")]
    props = schema.get("properties", {})
    return [f for k, v in value.items()
            for f in ([f"{path}.{k}"] if k not in props else
                      undeclared(v, props[k], f"{path}.{k}"))]


class FakeKube:
    """The API server as the reconciler and scaler see it: children by path, one
    InferenceDeployment whose status takes merge patches, and every write counted."""

    def __init__(self, obj: dict[str, Any], config: dict[str, Any]):
        self.obj, self.config = obj, json.dumps(config)
        self.children: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, Any]] = []
        self.events: list[tuple[str, str]] = []

    def service_monitors_served(self) -> bool:
        return True

    def namespace_terminating(self, namespace: str) -> bool:
        return False

    def read_configmap_key(self, namespace: str, name: str, key: str,
                           reader: tuple[str, str] | None = None) -> str | None:
        return self.config

    def ensure(self, desired: dict, *, surely_absent: bool = False) -> tuple[str, dict]:
        old = self.children.get(desired["kind"])  # one of each kind: key by kind
        if old is not None and contains(old, desired):
            return "unchanged", old
        live = json.loads(json.dumps(desired))
        if desired["kind"] == "Deployment":  # a rolled-out, ready Deployment
            n = desired["spec"]["replicas"]
            live["metadata"]["generation"] = 1
            live["status"] = {"observedGeneration": 1, "replicas": n, "readyReplicas": n,
                              "updatedReplicas": n}
        self.children[desired["kind"]] = live
        self.writes.append(("apply", desired["kind"]))
        return ("created" if old is None else "updated"), live

    def get_deployment(self, namespace: str, name: str) -> dict | None:
        return self.children.get("Deployment")

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        return []

    def owned_pods(self, owner: tuple[str, str], selector: str,
                   deployment: dict | None) -> list[dict]:
        return []

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        self.writes.append(("status", status))
        # What the API server stores (RFC 7386: null removes, maps merge).
        self.obj["status"] = apply_merge_patch(self.obj.get("status") or {},
                                               json.loads(json.dumps(status)))

    def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        self.writes.append(("scale", replicas))

    def pods_of(self, namespace: str, name: str, selector: str) -> list[dict]:
        return []

    def post_event(self, owner: dict, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason))


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies an application/merge-patch+json body."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge_patch(out.get(key), value)
    return out


def infdep(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "u", "generation": 1},
            "spec": {"model": {"name": "google/gemma-3-1b-it", "configMapRef": {"name": "m"}},
                     "offload": {"hostMemory": "16Gi"}, **spec}}


def test_reconciler_status_is_declared_and_steady():
    obj = infdep(autoscaling={"enabled": True})
    kube = FakeKube(obj, load_local(MODELS / "gemma-3-1b-it.json"))
    first = Reconciler(kube).reconcile(obj)
    assert first.outcome == "ok" and first.writes == 6  # 5 children and the status
    status = obj["status"]
    assert undeclared(status, STATUS_SCHEMA) == []
    assert status["plan"]["capacityTokens"] > 0 and status["readyReplicas"] == 1
    assert {c["type"] for c in status["conditions"]} >= {"Available", "ScalingActive"}
    # Steady state: the same object again makes no write at all.
    again = Reconciler(kube).reconcile(obj)
    assert again.writes == 0 and len(kube.writes) == 6


def test_a_deferred_status_is_written_by_the_next_reconcile():
    obj = infdep()
    kube = FakeKube(obj, load_local(MODELS / "gemma-3-1b-it.json"))
    rec = Reconciler(kube)
    first = rec.reconcile(obj, defer_status=True)
    assert first.deferred and first.written is None and "status" not in obj
    assert [w[0] for w in kube.writes] == ["apply"] * 5
    second = rec.reconcile(obj)
    assert not second.deferred and second.writes == 1  # the children stand; the status
    assert obj["status"]["observedGeneration"] == 1


def test_a_new_object_posts_the_plan_event_and_later_transitions():
    """A new object's starting conditions (Degraded=False, Available=False while its
    pods come, Progressing) are no news: one Event, the plan's. What changes after
    that is."""
    obj = infdep()
    kube = FakeKube(obj, load_local(MODELS / "gemma-3-1b-it.json"))
    rec = Reconciler(kube)
    rec.reconcile(obj)
    assert {c["type"] for c in obj["status"]["conditions"]} >= {
        "PlanReady", "Available", "Progressing", "Degraded"}
    assert kube.events == [("Normal", "PlanComputed")]
    obj["spec"]["replicas"] = 0  # Available: MinimumReplicasAvailable -> ScaledToZero
    obj["metadata"]["generation"] = 2
    rec.reconcile(obj)
    assert ("Normal", "ScaledToZero") in kube.events[1:]


def test_a_new_object_with_a_refused_plan_posts_its_warning():
    obj = infdep(offload={"hostMemory": "1Ki"})
    kube = FakeKube(obj, load_local(MODELS / "gemma-3-1b-it.json"))
    Reconciler(kube).reconcile(obj)
    assert [r for t, r in kube.events if t == "Warning"] == ["OffloadPlanInvalid", "PlanNotReady"]


def test_a_reconcile_plans_once_per_config_and_spec(monkeypatch):
    """Validating, planning and the plan's JSON are kept by their inputs: a thousand
    reconciles of one spec plan once. A new generation validates again; a changed
    config.json plans again."""
    from spillway_operator.flow import reconciler as module

    calls: list[int] = []
    real = module.make_plan

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "make_plan", counted)
    obj = infdep()
    kube = FakeKube(obj, load_local(MODELS / "gemma-3-1b-it.json"))
    rec = Reconciler(kube)
    rec.reconcile(obj)
    rec.reconcile(obj)
    assert len(calls) == 1
    obj["spec"]["offload"]["hostMemory"] = "8Gi"  # a spec change: a new generation
    obj["metadata"]["generation"] = 2
    rec.reconcile(obj)
    assert len(calls) == 2
    assert json.loads(kube.children["ConfigMap"]["data"]["plan.json"])[
        "cpu_memory_bytes"] == 8 * 2**30  # the new plan's text, not the old one's
    kube.config = json.dumps({**load_local(MODELS / "gemma-3-1b-it.json"),
                              "max_position_embeddings": 4096})
    rec.reconcile(obj)
    assert len(calls) == 3


def test_scaler_status_is_declared_and_steady():
    obj = infdep()
    kube = FakeKube(obj, {})
    scaler = Autoscaler(kube)

    def write(agg: Aggregate, decision: str = "hold") -> None:
        live = (obj.get("status") or {}).get("autoscaling") or {}
        old = read_status(obj.get("status")).autoscaling or AutoscalingStatus()
        asyncio.run(scaler._write_status(("team-a", "chat"), live, old, agg, 2, decision,
                                         "why"))

    measured = Aggregate(1.234, {"load": 1.234, "queue": 0.5}, 2, 0)
    write(measured, "scale-up")
    auto = obj["status"]["autoscaling"]
    assert undeclared(obj["status"], STATUS_SCHEMA) == []
    assert auto["pressure"] == 1.23 and auto["desiredReplicas"] == 2 and auto["lastScaleTime"]
    write(measured)  # same reading, a hold: the scale time stays, nothing else changed
    assert len(kube.writes) == 2 and obj["status"]["autoscaling"]["lastDecision"] == "hold"
    write(measured)
    write(Aggregate(None, {}, 0, 2))  # no reading: the last one is kept
    assert len(kube.writes) == 2
    assert obj["status"]["autoscaling"]["pressure"] == 1.23


def test_scaler_clears_metrics_problems_once_they_are_gone():
    """A pod's metrics problem is listed, then cleared when it recovers (or the pod
    goes), and then nothing is written: the serializer leaves unset fields out, so
    a patch of the new status alone never cleared them and was sent every tick."""
    obj = infdep()
    kube = FakeKube(obj, {})
    scaler = Autoscaler(kube)
    key = ("team-a", "chat")

    def write(agg: Aggregate) -> None:
        live = (obj.get("status") or {}).get("autoscaling") or {}
        old = read_status(obj.get("status")).autoscaling or AutoscalingStatus()
        asyncio.run(scaler._write_status(key, live, old, agg, 2, "hold", "why"))

    scaler.objects[key] = Tracked(problems=["chat-1: body over 4194304 bytes"])
    write(Aggregate(0.5, {"load": 0.5}, 1, 1))
    auto = obj["status"]["autoscaling"]
    assert auto["unmeasuredPods"] == 1 and auto["metricsProblems"][0].startswith("chat-1")
    scaler.objects[key].problems = []  # recovered
    write(Aggregate(0.5, {"load": 0.5}, 2, 0))
    auto = obj["status"]["autoscaling"]
    assert "unmeasuredPods" not in auto and "metricsProblems" not in auto
    assert kube.writes[-1][1]["autoscaling"]["metricsProblems"] is None
    writes = len(kube.writes)
    for _ in range(3):  # steady state
        write(Aggregate(0.5, {"load": 0.5}, 2, 0))
    assert len(kube.writes) == writes


@pytest.mark.parametrize("where", ["decide", "aggregate"])
def test_a_policy_that_raises_holds_replicas_says_so_and_logs_once(monkeypatch, caplog, where):
    """The policy is pure code; if it raises (a bug, a value it never met), the tick
    scales nothing, status.autoscaling and ScalingActive say PolicyFailed, and the log
    has one line for the whole episode, then one when it recovers."""
    obj = infdep(replicas=3, autoscaling={"enabled": True, "minReplicas": 1})
    kube = FakeKube(obj, {})
    scaler = Autoscaler(kube)
    spec = InferenceDeploymentSpec.model_validate(obj["spec"])
    real = getattr(scaler_module, where)

    def broken(*args: Any) -> Any:
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(scaler_module, where, broken)
    broken.__name__ = where
    caplog.set_level("INFO", logger="spillway.scaler")
    for t in range(3):
        asyncio.run(scaler.tick(("team-a", "chat"), obj, spec, 100.0 + t))
    assert not [w for w in kube.writes if w[0] == "scale"]
    auto = obj["status"]["autoscaling"]
    assert auto["desiredReplicas"] == 3 and auto["lastDecision"] == "hold"
    assert auto["lastDecisionReason"].startswith(
        f"PolicyFailed: {where}: ZeroDivisionError: float division by zero")
    cond = scaling_condition(read_status(obj["status"]).autoscaling)
    assert (cond.status, cond.reason) == (False, "PolicyFailed")
    assert len(kube.writes) == 1  # the status, once: the later ticks wrote nothing
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "the scaling policy failed" in errors[0].getMessage()
    monkeypatch.setattr(scaler_module, where, real)
    asyncio.run(scaler.tick(("team-a", "chat"), obj, spec, 110.0))
    assert "PolicyFailed" not in obj["status"]["autoscaling"]["lastDecisionReason"]
    assert [r.getMessage() for r in caplog.records][-1].endswith("the scaling policy recovered")


def test_merge_patch_sets_changes_and_clears_what_is_gone():
    live = {"a": 1, "b": [1, 2], "m": {"x": 1, "y": 2}, "theirs": {"k": 1}, "gone": "x"}
    desired = {"a": 1.0, "b": [1, 3], "m": {"x": 1}, "new": True}
    assert merge_patch(live, desired, keep=frozenset({"theirs"})) == {
        "gone": None, "b": [1, 3], "m": {"y": None}, "new": True}
    assert merge_patch(desired, desired) == {}
    assert merge_patch({"f": 1}, {"f": True}) == {"f": True}  # True is not 1 in JSON
    assert apply_merge_patch(live, merge_patch(live, desired)) == desired


def test_backoff_grows_and_caps_and_resets():
    b = Backoff(base=1, cap=8)
    k = ("ns", "x")
    assert [b.next(k) for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    b.reset(k)
    assert b.next(k) == 1


def _engine_pod(name: str, **container_status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "status": {"containerStatuses": [{"name": "engine", **container_status}]}}


PLAN_TABLE = ("Spillway plan check FAILED: vLLM's KV-cache geometry differs from the plan:\n"
              "field | plan | vLLM\ncpu_bytes_to_use | 33554432 | 16777216")


def test_an_engine_that_says_why_it_did_not_start_is_engine_start_failed():
    """The kubelet copies the termination message into the status: after a restart
    it is in lastState while the container waits in CrashLoopBackOff."""
    crashed = _engine_pod("p-1", ready=False, restartCount=3,
                          state={"waiting": {"reason": "CrashLoopBackOff"}},
                          lastState={"terminated": {"exitCode": 1, "reason": "Error",
                                                    "message": PLAN_TABLE}})
    healthy = _engine_pod("p-0", ready=True, state={"running": {}})
    c = by_type(conditions_for(Observed(1, 2, deployment=dep(ready=1), pods=[healthy, crashed])))
    assert c["Degraded"].status is True
    assert c["Degraded"].reason == "EngineStartFailed"
    assert c["Degraded"].message.startswith("pod p-1: engine exited with code 1: Spillway plan")
    assert "cpu_bytes_to_use | 33554432 | 16777216" in c["Degraded"].message


def test_an_engine_message_is_cut_to_fit_a_condition():
    long = _engine_pod("p", ready=False, state={"terminated": {"exitCode": 3,
                                                               "message": "x" * 5000}})
    c = by_type(conditions_for(Observed(1, 1, deployment=dep(replicas=1, ready=0), pods=[long])))
    assert c["Degraded"].reason == "EngineStartFailed"
    assert len(c["Degraded"].message) < 1000 and c["Degraded"].message.endswith("[...]")


def test_a_crash_loop_without_a_message_is_pods_failing():
    looping = _engine_pod("p", ready=False, state={"waiting": {"reason": "CrashLoopBackOff"}},
                          lastState={"terminated": {"exitCode": 139, "reason": "Error"}})
    c = by_type(conditions_for(Observed(1, 1, deployment=dep(replicas=1, ready=0),
                                        pods=[looping])))
    assert (c["Degraded"].reason, c["Degraded"].message) == (
        "PodsFailing", "pod p: CrashLoopBackOff")


@pytest.mark.parametrize("restarts", [1, 2, 7])
def test_an_engine_killed_at_its_memory_limit_says_so_the_same_way_each_restart(restarts):
    """OOMKilled wins over the log tail FallbackToLogsOnError puts in the message: the
    condition names the limit, and is the same at every restart (no status write per
    crash)."""
    oom = _engine_pod("p", ready=False, restartCount=restarts,
                      state={"waiting": {"reason": "CrashLoopBackOff"}},
                      lastState={"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                                "message": f"log line {restarts}"}})
    oom["spec"] = {"containers": [{"name": "engine",
                                   "resources": {"limits": {"memory": "12Gi"}}}]}
    c = by_type(conditions_for(Observed(1, 1, deployment=dep(replicas=1, ready=0),
                                        pods=[oom])))
    assert c["Degraded"].status is True and c["Degraded"].reason == "EngineOOMKilled"
    assert c["Degraded"].message == (
        "pod p: the engine was killed at its memory limit of 12Gi (OOMKilled, exit code 137); "
        "the plan's memory is too small for what runs in the pod: raise "
        "spec.resources.extraMemory")


@pytest.mark.parametrize(("reason", "message", "shown"), [
    ("InvalidImageName", 'Failed to apply default image tag "x; rm -rf /": couldn\'t parse '
     "image name: invalid reference format", "pod p: InvalidImageName: Failed to apply"),
    ("ErrImageNeverPull", 'Container image "vllm:x" is not present with pull policy of Never',
     "pod p: ErrImageNeverPull: Container image"),
    ("CreateContainerConfigError", 'configmap "chat-plan" not found',
     'pod p: CreateContainerConfigError: configmap "chat-plan" not found'),
    ("CreateContainerError", "context deadline exceeded", "pod p: CreateContainerError: "),
    ("RunContainerError", "failed to start: exec: no such file", "pod p: RunContainerError: "),
    ("ErrImagePull", "rpc error: failed to pull", "pod p: ImagePullBackOff"),
    ("ImagePullBackOff", 'Back-off pulling image "vllm:x"', "pod p: ImagePullBackOff"),
])
def test_a_container_the_kubelet_cannot_start_is_pods_failing(reason, message, shown):
    waiting = _engine_pod("p", ready=False,
                          state={"waiting": {"reason": reason, "message": message}})
    c = by_type(conditions_for(Observed(1, 1, deployment=dep(replicas=1, ready=0),
                                        pods=[waiting])))
    assert c["Degraded"].status is True and c["Degraded"].reason == "PodsFailing"
    assert c["Degraded"].message.startswith(shown)


def test_pods_failing_is_steady_while_the_kubelet_retries():
    """ErrImagePull and ImagePullBackOff alternate, and CrashLoopBackOff's message
    counts the back-off: the condition stays the same, so the status is not rewritten."""
    def degraded(state):
        pod = _engine_pod("p", ready=False, state={"waiting": state})
        return by_type(conditions_for(Observed(1, 1, deployment=dep(replicas=1, ready=0),
                                               pods=[pod])))["Degraded"]

    assert degraded({"reason": "ErrImagePull", "message": "rpc error"}) == \
        degraded({"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'})
    assert degraded({"reason": "CrashLoopBackOff", "message": "back-off 10s restarting"}) == \
        degraded({"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting"})


def test_waiting_on_the_way_is_not_a_failure():
    for reason in ("ContainerCreating", "PodInitializing"):
        pod = _engine_pod("p", ready=False, state={"waiting": {"reason": reason}})
        c = by_type(conditions_for(Observed(1, 1, deployment=dep(replicas=1, ready=0),
                                            pods=[pod])))
        assert c["Degraded"].status is False


def test_an_engine_that_restarted_and_serves_again_is_not_degraded():
    recovered = _engine_pod("p", ready=True, state={"running": {}},
                            lastState={"terminated": {"exitCode": 1, "message": "old"}})
    c = by_type(conditions_for(Observed(1, 1, deployment=dep(replicas=1, ready=1),
                                        pods=[recovered])))
    assert c["Degraded"].status is False
