"""Replicas that span nodes: the spec's placement, the per-node plan, the LeaderWorkerSet
the operator renders for them, and the reconciler's choice between it and a Deployment."""

from __future__ import annotations

from typing import Any

import pytest

from spillway_engine.planner.model_config import load_local
from spillway_engine.planner.plan import PlanRefused, make_plan
from spillway_engine.planner.pod_sizing import WORKER_PROCESS_BYTES
from spillway_engine.quantity import parse_bytes
from spillway_operator.flow import render
from spillway_operator.flow.crd import spec_schema
from spillway_operator.flow.placement import placement_refusal
from spillway_operator.flow.reconciler import Reconciler, make_plan_safely
from spillway_operator.flow.spec import InferenceDeploymentSpec
from spillway_operator.flow.status import (
    Observed,
    conditions_for,
    group_restarts,
    with_group_status,
)
from spillway_operator.names import LWS_GROUP_INDEX, LWS_REVISION
from spillway_router.kube import backend_from_pod, deployment_from_configmap
from tests.unit.operator.flow.test_operator_status import MODELS, FakeKube

OWNER = render.Owner("big", "team-a", "uid-9")
DEEPSEEK = load_local(MODELS / "deepseek-v3.json")


def spec_of(engine: dict[str, Any] | None = None, **fields: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({
        "model": {"name": "deepseek-ai/DeepSeek-V3"}, "offload": {"hostMemory": "64Gi"},
        "engine": engine or {"tensorParallelSize": 16}, **fields})


# ------------------------------------------------------------------ placement


def test_sixteen_gpus_on_eight_gpu_nodes_span_two_nodes():
    spec = spec_of()
    assert (spec.nodes, spec.gpus_per_pod, placement_refusal(spec)) == (2, 8, None)
    # pipeline stages split too, and an explicit node count wins over the default
    assert spec_of({"tensorParallelSize": 8, "pipelineParallelSize": 2}).nodes == 2
    assert spec_of({"tensorParallelSize": 8, "nodes": 2}).gpus_per_pod == 4
    assert spec_of({"tensorParallelSize": 8}).nodes == 1
    # a node of 4 GPUs (resources.gpusPerNode) needs four pods for the same replica
    assert spec_of(resources={"gpusPerNode": 4}).nodes == 4


@pytest.mark.parametrize("engine, gpus_per_node, field", [
    ({"tensorParallelSize": 16, "nodes": 3}, 8, "spec.engine.nodes"),  # 16 / 3
    # data parallelism across nodes: whole engines a node (see the DP x EP tests below)
    ({"tensorParallelSize": 4, "dataParallelSize": 3, "nodes": 2}, 8,
     "spec.engine.dataParallelSize"),
    ({"tensorParallelSize": 16, "nodes": 1}, 8, None),  # one pod of 16: allowed, as asked
    ({"tensorParallelSize": 32, "nodes": 2}, 8, "spec.engine.nodes"),  # 16 a node > 8
])
def test_a_placement_vllm_cannot_run_is_refused_naming_the_field(engine, gpus_per_node, field):
    spec = spec_of(engine, resources={"gpusPerNode": gpus_per_node})
    refusal = placement_refusal(spec)
    if field is None:
        assert refusal is None
        return
    assert refusal is not None and refusal.startswith(field)
    with pytest.raises(PlanRefused, match=field):
        make_plan_safely(DEEPSEEK, spec)


def test_each_pod_is_sized_for_its_own_node():
    """Pod memory counts the workers of one node; each node maps the whole pool region
    (vLLM's SharedOffloadRegion is one file of every rank's rows, on every node)."""
    two = make_plan(DEEPSEEK, spec_of().plan_request())
    assert two.parallelism.nodes == 2 and two.parallelism.world_size == 16
    one = make_plan(DEEPSEEK, spec_of({"tensorParallelSize": 16, "nodes": 1}).plan_request())
    # the same pool (to a row: across nodes a row holds every rank's copy), eight fewer
    # GPU worker processes on each pod
    assert abs(one.pod.pool_bytes_per_engine - two.pod.pool_bytes_per_engine) < two.row_bytes
    fewer = one.pod.process_overhead_bytes - two.pod.process_overhead_bytes
    assert 0 <= fewer - 8 * WORKER_PROCESS_BYTES < 64 * 2**20  # (the manager's keys differ)
    with pytest.raises(PlanRefused, match="do not divide"):
        make_plan(DEEPSEEK, spec_of({"tensorParallelSize": 16, "nodes": 3}).plan_request())


# ------------------------------------------------------------------ rendering


def test_a_multi_node_replica_is_one_leader_worker_set_group():
    spec = spec_of(replicas=2)
    plan = make_plan_safely(DEEPSEEK, spec)
    lws = render.engine_workload(OWNER, spec, plan)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    s = lws["spec"]
    assert s["replicas"] == 2  # groups, as the InferenceDeployment counts replicas
    t = s["leaderWorkerTemplate"]
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert s["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 1,
                                                                  "maxSurge": 0}
    pod = t["workerTemplate"]["spec"]
    c = pod["containers"][0]
    assert c["args"][c["args"].index("--nnodes") + 1] == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"  # one node's GPUs
    assert parse_bytes(c["resources"]["limits"]["memory"]) == plan.pod.memory_limit_bytes
    assert {"name": "dist", "containerPort": render.DIST_PORT, "protocol": "TCP"} in c["ports"]
    assert c["securityContext"]["runAsNonRoot"] is True
    assert c["readinessProbe"]["httpGet"]["path"] and c["lifecycle"]["preStop"]
    term = pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["matchLabelKeys"] == [render.LWS_GROUP_KEY]
    # the GPU product is still required of every pod of the group
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert t["workerTemplate"]["metadata"]["annotations"]["spillway.dev/plan-hash"] == (
        render.plan_hash(plan))
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-9"


def test_a_groups_headless_service_is_not_the_serving_service():
    """LWS names a Shared subdomain's headless Service after the LeaderWorkerSet, which
    is the object's name and so the serving Service's: each group gets its own instead
    (named after its leader pod, <name>-<i>), and the names never meet."""
    spec = spec_of(replicas=3)
    lws = render.engine_workload(OWNER, spec, make_plan_safely(DEEPSEEK, spec))
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    assert render.service(OWNER, spec)["metadata"]["name"] == lws["metadata"]["name"]


def test_a_one_node_replica_keeps_its_deployment():
    spec = spec_of({"tensorParallelSize": 8})
    workload = render.engine_workload(OWNER, spec, make_plan_safely(DEEPSEEK, spec))
    assert workload["kind"] == "Deployment"
    assert "--nnodes" not in workload["spec"]["template"]["spec"]["containers"][0]["args"]


def test_only_leaders_serve():
    spec = spec_of()
    selector = render.service(OWNER, spec)["spec"]["selector"]
    assert selector[render.LWS_WORKER_INDEX] == "0"
    assert render.LWS_WORKER_INDEX not in render.service(
        OWNER, spec_of({"tensorParallelSize": 8}))["spec"]["selector"]

    def pod(index: str | None) -> dict[str, Any]:
        labels = {} if index is None else {render.LWS_WORKER_INDEX: index}
        return {"metadata": {"name": f"p{index}", "labels": labels},
                "status": {"phase": "Running", "podIP": "10.0.0.9",
                           "conditions": [{"type": "Ready", "status": "True"}]}}

    assert [render.serves(pod(i)) for i in (None, "0", "1")] == [True, True, False]
    plan = make_plan_safely(DEEPSEEK, spec)
    info = deployment_from_configmap(render.plan_configmap(OWNER, spec, plan))
    assert backend_from_pod(pod("0"), info, None) is not None
    assert backend_from_pod(pod("1"), info, None) is None


# ------------------------------------------------------------------ reconciler


class GroupKube(FakeKube):
    """FakeKube with LeaderWorkerSet's API served (or not) and a ready LWS."""

    def __init__(self, obj: dict[str, Any], config: dict[str, Any], served: bool = True):
        super().__init__(obj, config)
        self.served = served
        self.zeroed: list[str] = []

    def leader_worker_sets_served(self, max_age: float = 30) -> bool:
        return self.served

    def get_leader_worker_set(self, namespace: str, name: str) -> dict | None:
        return self.children.get("LeaderWorkerSet")

    def ensure(self, desired: dict, *, surely_absent: bool = False) -> tuple[str, dict]:
        action, live = super().ensure(desired, surely_absent=surely_absent)
        if desired["kind"] == "LeaderWorkerSet" and action != "unchanged":
            n = desired["spec"]["replicas"]
            live["status"] = {"replicas": n, "readyReplicas": n, "updatedReplicas": n}
        return action, live

    def watched_deployment(self, namespace: str, name: str) -> dict | None:
        return self.get_deployment(namespace, name)

    def owned_pods(self, owner: tuple[str, str], selector: str,
                   deployment: dict | None) -> list[dict]:
        """Every group of the LWS whole and Ready, on its template's plan."""
        lws = self.children.get("LeaderWorkerSet")
        if deployment is None or lws is None:
            return []
        template = lws["spec"]["leaderWorkerTemplate"]
        notes = template["workerTemplate"]["metadata"]["annotations"]
        return [{"metadata": {"name": f"big-{g}-{i}", "uid": f"u{g}{i}", "annotations": notes,
                              "labels": {LWS_GROUP_INDEX: str(g), render.LWS_WORKER_INDEX: str(i),
                                         LWS_REVISION: "r1"}},
                 "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
                for g in range(lws["spec"]["replicas"]) for i in range(template["size"])]

    def scale_to_zero(self, api_version: str, kind: str, namespace: str, name: str,
                      live: dict | None) -> bool:
        if live is None or not live["spec"]["replicas"]:
            return False
        live["spec"]["replicas"] = 0
        self.zeroed.append(kind)
        return True


def big(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "big", "namespace": "team-a", "uid": "u", "generation": 1},
            "spec": {"model": {"name": "deepseek-ai/DeepSeek-V3", "configMapRef": {"name": "m"}},
                     "offload": {"hostMemory": "64Gi"}, **spec}}


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj["status"]["conditions"]}


def test_the_reconciler_applies_a_leader_worker_set_and_counts_groups():
    obj = big(replicas=2, engine={"tensorParallelSize": 16})
    kube = GroupKube(obj, DEEPSEEK)
    first = Reconciler(kube).reconcile(obj)
    assert first.outcome == "ok"
    assert "LeaderWorkerSet" in kube.children and "Deployment" not in kube.children
    status = obj["status"]
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert status["plan"]["nodes"] == 2 and status["plan"]["gpusPerPod"] == 8
    assert conditions(obj)["Available"]["status"] == "True"
    assert conditions(obj)["Progressing"]["reason"] == "RolloutComplete"
    writes = len(kube.writes)
    assert Reconciler(kube).reconcile(obj).writes == 0 and len(kube.writes) == writes


def test_changing_the_node_count_scales_the_other_workload_to_zero():
    obj = big(engine={"tensorParallelSize": 8})
    kube = GroupKube(obj, DEEPSEEK)
    rec = Reconciler(kube)
    rec.reconcile(obj)
    assert kube.children["Deployment"]["spec"]["replicas"] == 1
    obj["spec"]["engine"] = {"tensorParallelSize": 16}
    obj["metadata"]["generation"] = 2
    rec.reconcile(obj)
    assert kube.zeroed == ["Deployment"] and kube.children["LeaderWorkerSet"]
    obj["spec"]["engine"] = {"tensorParallelSize": 8}
    obj["metadata"]["generation"] = 3
    rec.reconcile(obj)
    assert kube.zeroed == ["Deployment", "LeaderWorkerSet"]
    assert kube.children["Deployment"]["spec"]["replicas"] == 1
    rec.reconcile(obj)  # and no more: the status says the replicas span one node
    assert kube.zeroed == ["Deployment", "LeaderWorkerSet"]


def test_without_lws_installed_a_condition_says_so_and_no_pods_are_made():
    obj = big(engine={"tensorParallelSize": 16})
    kube = GroupKube(obj, DEEPSEEK, served=False)
    result = Reconciler(kube).reconcile(obj)
    assert result.outcome == "retry" and result.requeue_after  # asked again: LWS may come
    assert not {"Deployment", "LeaderWorkerSet"} & set(kube.children)
    plan = conditions(obj)["PlanReady"]
    assert plan["reason"] == "LeaderWorkerSetUnavailable"
    assert "spec.engine.nodes" in plan["message"] and "leaderworkerset.x-k8s.io" in (
        plan["message"])
    assert ("Warning", "LeaderWorkerSetUnavailable") in kube.events
    kube.served = True  # installed: the next reconcile proceeds
    assert Reconciler(kube).reconcile(obj).outcome == "ok"
    assert kube.children["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["size"] == 2


def test_the_crd_serves_the_new_fields():
    spec = spec_schema()["properties"]
    nodes = spec["engine"]["properties"]["nodes"]
    assert (nodes["minimum"], nodes["maximum"]) == (1, 64)
    assert spec["resources"]["properties"]["gpusPerNode"]["default"] == 8


# ------------------------------------------------------------------ group restarts


def group_pod(group: str, index: str, uid: str, ready: bool, revision: str = "r1",
              deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"big-{group}-{index}", "uid": uid, "labels": {
        LWS_GROUP_INDEX: group, render.LWS_WORKER_INDEX: index,
        LWS_REVISION: revision}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_group_seen_whole_that_loses_a_pod_is_restarting_until_whole_again():
    starting = [group_pod("0", "0", "a", False), group_pod("0", "1", "b", False)]
    restarting, seen = group_restarts(starting, 2, {})
    assert restarting == [] and seen == {}  # never whole yet: starting, not restarting
    whole = [group_pod("0", "0", "a", True), group_pod("0", "1", "b", True),
             group_pod("1", "0", "c", True), group_pod("1", "1", "d", True)]
    restarting, seen = group_restarts(whole, 2, seen)
    assert restarting == [] and seen == {"0": ("a", "r1"), "1": ("c", "r1")}
    # group 0's worker died: LWS deletes the leader and starts both anew
    broken = [group_pod("0", "0", "a", True, deleting=True), group_pod("0", "0", "e", False),
              group_pod("1", "0", "c", True), group_pod("1", "1", "d", True)]
    restarting, seen = group_restarts(broken, 2, seen)
    assert restarting == ["0"] and seen["0"] == ("a", "r1")
    healed = [group_pod("0", "0", "e", True), group_pod("0", "1", "f", True), *whole[2:]]
    restarting, seen = group_restarts(healed, 2, seen)
    assert restarting == [] and seen["0"] == ("e", "r1")
    # a rollout (a new template revision) replaces groups: not a restart
    rolling = [group_pod("0", "0", "g", False, "r2"), group_pod("0", "1", "h", False, "r2")]
    assert group_restarts(rolling + whole[2:], 2, seen)[0] == []
    # a group scaled away is forgotten
    assert group_restarts(whole[2:], 2, seen)[1] == {"1": ("c", "r1")}


def test_a_restarting_group_is_a_degraded_condition():
    obs = Observed(generation=1, desired_replicas=2, restarting_groups=["0"])
    degraded = next(c for c in conditions_for(obs) if c.type == "Degraded")
    assert degraded.status is True and degraded.reason == "GroupRestarting"
    assert "group(s) 0" in degraded.message


def test_pipeline_stages_one_per_node_are_served():
    """TP 8 x PP 2 on 8-GPU nodes: two pods, each a stage; each pod is sized for the
    largest stage's region (DeepSeek-V3's 61 layers split 31 + 30)."""
    spec = spec_of({"tensorParallelSize": 8, "pipelineParallelSize": 2})
    assert spec.nodes == 2 and placement_refusal(spec) is None
    plan = make_plan_safely(DEEPSEEK, spec)
    assert [s.num_cache_layers for s in plan.stages] == [31, 30]
    assert plan.pod.pool_bytes_per_engine == max(s.region_bytes for s in plan.stages)
    lws = render.engine_workload(OWNER, spec, plan)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    # two stages in one pod (or four on two nodes) share a node's region: refused
    for engine in ({"tensorParallelSize": 4, "pipelineParallelSize": 2},
                   {"tensorParallelSize": 4, "pipelineParallelSize": 4, "nodes": 2}):
        refusal = placement_refusal(spec_of(engine))
        assert refusal is not None and refusal.startswith("spec.engine.nodes")


def test_groups_are_counted_from_their_pods():
    spec = spec_of(replicas=2)
    lws = render.engine_workload(OWNER, spec, make_plan_safely(DEEPSEEK, spec))
    want = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["annotations"]
    old = {"spillway.dev/plan-hash": "old"}

    def pod(group, index, ready=True, notes=want):
        p = group_pod(group, index, f"u{group}{index}", ready)
        p["metadata"]["annotations"] = notes
        return p

    pods = [pod("0", "0"), pod("0", "1"),  # whole, ready, current plan
            pod("1", "0", notes=old), pod("1", "1", notes=old),  # whole, ready, old plan
            pod("2", "0", ready=False)]  # a leader whose worker is not made yet
    status = with_group_status(lws, pods)["status"]
    assert status == {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 1}


def test_replicated_mla_rows_are_per_node_only():
    """vLLM 0.33 keeps one copy of a TP-replicated MLA row only in a single node's
    /dev/shm (build_offloading_config: nnodes_within_dp == 1): across two nodes every
    row holds each rank's copy, so the same pool holds a sixteenth of the tokens."""
    one = make_plan(DEEPSEEK, spec_of({"tensorParallelSize": 16, "nodes": 1}).plan_request())
    two = make_plan(DEEPSEEK, spec_of().plan_request())
    assert one.spillway.copies == 1 and two.spillway.copies == 16
    assert 15 * two.capacity_tokens < one.capacity_tokens <= 16 * two.capacity_tokens + 4096


# ------------------------------------------------------------------ DP x EP across nodes


def dp_ep_spec(dp: int = 16, tp: int = 1, **engine: Any) -> InferenceDeploymentSpec:
    """DeepSeek-V3 as run with DP attention: DP engines of TP GPUs, experts over all of
    them (vLLM's --enable-expert-parallel, through extraArgs)."""
    return spec_of({"tensorParallelSize": tp, "dataParallelSize": dp,
                    "extraArgs": ["--enable-expert-parallel"], **engine},
                   resources={"gpuProduct": "H200", "gpusPerNode": 8})


def test_dp16_ep_over_two_nodes_is_one_group_of_two_pods_with_eight_engines_each():
    spec = dp_ep_spec()
    assert (spec.nodes, spec.gpus_per_pod, placement_refusal(spec)) == (2, 8, None)
    plan = make_plan_safely(DEEPSEEK, spec)
    par = plan.parallelism
    assert (par.nodes, par.data_parallel_size, par.world_size) == (2, 16, 1)
    assert plan.pod.engines == 8  # DP / nodes engines a pod, each with its own pool
    assert plan.cpu_memory_bytes == 64 * 2**30
    assert plan.pod.pool_bytes_per_pod == 8 * plan.pod.pool_bytes_per_engine
    assert plan.pod.shm_bytes >= 8 * plan.pod.pool_bytes_per_engine
    # the pod is the same as the one-node pod of 8 engines of TP 1 (DP 8): per node
    one_node = make_plan_safely(DEEPSEEK, dp_ep_spec(dp=8))
    assert one_node.parallelism.nodes == 1 and one_node.pod.engines == 8
    assert plan.pod == one_node.pod
    assert (plan.kv_groups, plan.spillway) == (one_node.kv_groups, one_node.spillway)
    lws = render.engine_workload(OWNER, spec, plan)
    assert lws["kind"] == "LeaderWorkerSet"
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2
    c = t["workerTemplate"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--nnodes") + 1] == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert parse_bytes(c["resources"]["limits"]["memory"]) == plan.pod.memory_limit_bytes
    shm = [v for v in t["workerTemplate"]["spec"]["volumes"] if v.get("emptyDir", {}).get(
        "medium") == "Memory"]
    assert [parse_bytes(v["emptyDir"]["sizeLimit"]) for v in shm] == [plan.pod.shm_bytes]


def test_dp_with_tp2_replicates_mla_rows_per_engine():
    """Each DP engine's ranks sit on one node (vLLM's nnodes_within_dp is 1), so a TP 2
    engine keeps vLLM's replicated MLA rows (one copy a row), unlike TP 16 over nodes."""
    plan = make_plan_safely(DEEPSEEK, dp_ep_spec(dp=8, tp=2))
    assert (plan.parallelism.nodes, plan.pod.engines) == (2, 4)
    assert plan.spillway.copies == 1
    assert plan.upstream is not None and plan.upstream.replicated_layout


@pytest.mark.parametrize("engine, field", [
    ({"dataParallelSize": 3, "nodes": 2}, "spec.engine.dataParallelSize"),
    ({"dataParallelSize": 9}, "spec.engine.dataParallelSize"),  # 9 GPUs: 2 nodes
    ({"dataParallelSize": 2, "pipelineParallelSize": 2, "tensorParallelSize": 4},
     "spec.engine.pipelineParallelSize"),  # 16 GPUs, 2 nodes, stages sharing one
    ({"dataParallelSize": 2, "tensorParallelSize": 8, "nodes": 2,
      "pipelineParallelSize": 1}, None),
])
def test_dp_across_nodes_needs_whole_engines_a_node(engine, field):
    spec = dp_ep_spec(**engine)
    refusal = placement_refusal(spec)
    if field is None:
        assert refusal is None and spec.gpus_per_pod == 8
        return
    assert refusal is not None and refusal.startswith(field), refusal
    with pytest.raises(PlanRefused, match=field):
        make_plan_safely(DEEPSEEK, spec)


def test_dp_engines_more_than_a_node_holds_are_refused():
    spec = spec_of({"tensorParallelSize": 4, "dataParallelSize": 4, "nodes": 2},
                   resources={"gpusPerNode": 4})  # 2 engines of 4 GPUs a node > 4
    refusal = placement_refusal(spec)
    assert refusal is not None and refusal.startswith("spec.engine.nodes")
    assert "resources.gpusPerNode (4)" in refusal


def test_the_planner_refuses_dp_that_does_not_divide_the_nodes():
    request = dp_ep_spec(dp=3, nodes=2).plan_request()
    with pytest.raises(PlanRefused, match="data parallel size 3 does not split over 2 nodes"):
        make_plan(DEEPSEEK, request)
