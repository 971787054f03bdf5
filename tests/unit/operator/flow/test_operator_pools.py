"""GPU node pools (spec.resources.gpuPools) and the catalogue-driven gpuProduct: the
replica split, each pool's plan and workload, the shared children, status, the
mixed-product condition and an unknown product, through the real reconciler against a
fake API server that keys children by kind and name."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from spillway_engine.planner.gpus import GPUS, get_gpu
from spillway_engine.planner.model_config import load_local
from spillway_engine.planner.plan import make_plan
from spillway_operator.flow import render
from spillway_operator.flow.crd import status_schema
from spillway_operator.flow.pools import POOL_LABEL, pool_views, split_replicas, unplaced
from spillway_operator.flow.reconciler import Reconciler
from spillway_operator.flow.spec import GpuPoolSpec, InferenceDeploymentSpec
from spillway_operator.plumbing.kube import contains
from tests.helpers import SECOND_GPU
from tests.unit.operator.flow.test_operator_status import MODELS, apply_merge_patch, undeclared

#: The second pool's GPU (one word in tests.helpers: "b200" once Blackwell plans).
SECOND = SECOND_GPU
GEMMA = load_local(MODELS / "gemma-3-1b-it.json")


def pools(*entries: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": e.get("gpuProduct", "x").lower(), **e} for e in entries]


TWO_POOLS = pools({"gpuProduct": "H100", "nodeSelector": {"pool": "hopper"}},
                  {"gpuProduct": SECOND, "nodeSelector": {"pool": "second"}})


def infdep(replicas: int = 3, **resources: Any) -> dict[str, Any]:
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "u", "generation": 1},
            "spec": {"model": {"name": "google/gemma-3-1b-it", "configMapRef": {"name": "m"}},
                     "replicas": replicas, "offload": {"hostMemory": "16Gi"},
                     "resources": resources}}


class PoolKube:
    """The API server as the reconciler sees it, children keyed by (kind, name), each
    Deployment rolled out and ready; nodes listed by an equality label selector."""

    def __init__(self, obj: dict[str, Any], nodes: list[dict[str, Any]] | None = None):
        self.obj, self.nodes = obj, nodes or []
        self.children: dict[tuple[str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.events: list[tuple[str, str, str]] = []
        self.node_lists = 0

    def service_monitors_served(self) -> bool:
        return False

    def namespace_terminating(self, namespace: str) -> bool:
        return False

    def read_configmap_key(self, namespace, name, key, reader=None) -> str:
        return json.dumps(GEMMA)

    def ensure(self, desired: dict, *, surely_absent: bool = False) -> tuple[str, dict]:
        key = (desired["kind"], desired["metadata"]["name"])
        old = self.children.get(key)
        if old is not None and contains(old, desired):
            return "unchanged", old
        live = json.loads(json.dumps(desired))
        if desired["kind"] == "Deployment":
            n = desired["spec"]["replicas"]
            live["metadata"]["generation"] = 1
            live["status"] = {"observedGeneration": 1, "replicas": n, "readyReplicas": n,
                              "updatedReplicas": n}
        self.children[key] = live
        self.writes.append(("apply", f"{desired['kind']}/{desired['metadata']['name']}"))
        return ("created" if old is None else "updated"), live

    def get_deployment(self, namespace: str, name: str) -> dict | None:
        return self.children.get(("Deployment", name))

    watched_deployment = get_deployment

    def scale_to_zero(self, api_version, kind, namespace, name, live) -> bool:
        if live is None or live["spec"]["replicas"] == 0:
            return False
        live["spec"]["replicas"] = 0
        self.writes.append(("scale", f"{kind}/{name}"))
        return True

    def owned_pods(self, owner, selector, deployment) -> list[dict]:
        return []

    def list_nodes(self, selector: str) -> list[dict]:
        self.node_lists += 1
        wanted = dict(part.split("=") for part in selector.split(","))
        return [n for n in self.nodes
                if wanted.items() <= n["metadata"]["labels"].items()]

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        self.writes.append(("status", ""))
        self.obj["status"] = apply_merge_patch(self.obj.get("status") or {},
                                               json.loads(json.dumps(status)))

    def post_event(self, owner: dict, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))


def node(name: str, gpu: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {
        "nvidia.com/gpu.product": get_gpu(gpu).gfd_products[0], **labels}}}


def required_products(deployment: dict[str, Any]) -> list[str]:
    affinity = deployment["spec"]["template"]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]


# ------------------------------------------------------------------ the split


def pool_spec(**fields: Any) -> GpuPoolSpec:
    return GpuPoolSpec.model_validate({"name": "p", "gpuProduct": "h100", **fields})


@pytest.mark.parametrize(("total", "spec", "want"), [
    (5, [{}, {}], [3, 2]),  # equal weights: alternate, ties to the first
    (4, [{"weight": 3}, {}], [3, 1]),
    (4, [{}, {"minReplicas": 3}], [1, 3]),  # minimums first, then the weights
    (2, [{"minReplicas": 2}, {"minReplicas": 2}], [2, 0]),  # minimums in order
    (6, [{"maxReplicas": 1}, {}], [1, 5]),
    (0, [{"minReplicas": 1}, {}], [0, 0]),
    (5, [{"minReplicas": 1, "weight": 2}, {"maxReplicas": 4}], [3, 2]),  # the README's
    (9, [{"weight": 2}, {"weight": 1}], [6, 3]),
])
def test_replicas_split_minimums_first_then_by_weight_within_maximums(total, spec, want):
    assert split_replicas(total, [pool_spec(**s) for s in spec]) == want


def test_replicas_beyond_every_pools_maximum_are_counted_unplaced():
    spec = InferenceDeploymentSpec.model_validate({
        "model": {"name": "google/gemma-3-1b-it"}, "replicas": 7,
        "resources": {"gpuPools": pools({"gpuProduct": "h100", "maxReplicas": 2},
                                        {"gpuProduct": SECOND, "maxReplicas": 3})}})
    assert [v.spec.replicas for v in pool_views(spec)] == [2, 3] and unplaced(spec) == 2


# ------------------------------------------------------------------ rendering


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_every_catalogue_gpu_pins_pods_to_its_gfd_products(gpu):
    """Node affinity comes from the catalogue (the planner's GFD labels), for every GPU
    it holds; a catalogue name, its product label and any case name the same GPU."""
    plan = make_plan(GEMMA, InferenceDeploymentSpec.model_validate(
        {"model": {"name": "google/gemma-3-1b-it"}}).plan_request())
    for written in (gpu, gpu.upper(), GPUS[gpu].gfd_products[0]):
        spec = InferenceDeploymentSpec.model_validate(
            {"model": {"name": "google/gemma-3-1b-it"}, "resources": {"gpuProduct": written}})
        dep = render.deployment(render.Owner("chat", "ns", "u"), spec, plan)
        assert required_products(dep) == list(GPUS[gpu].gfd_products)
        assert spec.plan_request().gpu == gpu


@pytest.mark.parametrize("garbage", ["H100; rm -rf", "", "-h100", "x" * 65, "h100\n"])
def test_a_garbage_gpu_product_is_refused_at_parse(garbage):
    with pytest.raises(ValidationError, match=r"gpu_product|gpuProduct"):
        InferenceDeploymentSpec.model_validate(
            {"model": {"name": "google/gemma-3-1b-it"}, "resources": {"gpuProduct": garbage}})


def test_each_pool_gets_its_own_plan_workload_and_pinned_pods():
    obj = infdep(replicas=3, gpuPools=TWO_POOLS)
    kube = PoolKube(obj)
    result = Reconciler(kube).reconcile(obj)
    assert result.outcome == "ok", obj.get("status")
    names = sorted(name for kind, name in kube.children)
    assert names == sorted(["chat", "chat", f"chat-{SECOND}", f"chat-{SECOND}-plan",
                            "chat-h100", "chat-h100-plan"])  # Service and PDB: the object's
    h100, second = kube.children["Deployment", "chat-h100"], kube.children[
        "Deployment", f"chat-{SECOND}"]
    assert (h100["spec"]["replicas"], second["spec"]["replicas"]) == (2, 1)
    for dep, gpu, pool in ((h100, "h100", "hopper"), (second, SECOND, "second")):
        name = dep["metadata"]["name"]
        assert dep["spec"]["selector"]["matchLabels"][POOL_LABEL] == gpu
        assert dep["spec"]["template"]["metadata"]["labels"][POOL_LABEL] == gpu
        pod = dep["spec"]["template"]["spec"]
        assert required_products(dep) == list(GPUS[gpu].gfd_products)
        assert pod["nodeSelector"] == {"pool": pool}
        plan_volume = next(v for v in pod["volumes"] if v["name"] == "plan")
        assert plan_volume["configMap"]["name"] == f"{name}-plan"
        plan = json.loads(kube.children["ConfigMap", f"{name}-plan"]["data"]["plan.json"])
        assert plan["gpu"]["name"] == gpu
        assert dep["spec"]["template"]["metadata"]["annotations"]["spillway.dev/plan-hash"] == \
            next(p for p in obj["status"]["pools"] if p["name"] == gpu)["plan"]["hash"]
    # Every pool's pods behind one Service (and the PDB, the router, the autoscaler).
    service = kube.children["Service", "chat"]
    assert POOL_LABEL not in service["spec"]["selector"]
    assert service["spec"]["selector"].items() <= h100["spec"]["template"]["metadata"][
        "labels"].items()
    assert obj["status"]["selector"] == render.selector_string(render.Owner("chat", "", ""))


def test_pool_status_is_declared_and_a_steady_state_writes_nothing():
    obj = infdep(replicas=3, gpuPools=TWO_POOLS)
    kube = PoolKube(obj, [node("a", "h100", pool="hopper"), node("b", SECOND, pool="second")])
    rec = Reconciler(kube)
    rec.reconcile(obj)
    status = obj["status"]
    assert undeclared(status, status_schema()) == []
    assert [(p["name"], p["replicas"], p["readyReplicas"], p["plan"]["gpu"])
            for p in status["pools"]] == [("h100", 2, 2, "h100"), (SECOND, 1, 1, SECOND)]
    assert status["plan"] == status["pools"][0]["plan"]
    assert (status["replicas"], status["readyReplicas"]) == (3, 3)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Available"]["status"] == "True"
    assert conditions["MixedGPUProducts"]["status"] == "False"
    writes = len(kube.writes)
    assert rec.reconcile(obj).writes == 0 and Reconciler(kube).reconcile(obj).writes == 0
    assert len(kube.writes) == writes


def test_a_pool_left_out_of_the_spec_is_scaled_to_zero_once():
    obj = infdep(replicas=3, gpuPools=TWO_POOLS)
    kube = PoolKube(obj)
    rec = Reconciler(kube)
    rec.reconcile(obj)
    obj["spec"]["resources"]["gpuPools"] = TWO_POOLS[:1]
    obj["metadata"]["generation"] = 2
    rec.reconcile(obj)
    assert ("scale", f"Deployment/chat-{SECOND}") in kube.writes
    assert kube.children["Deployment", "chat-h100"]["spec"]["replicas"] == 3
    assert [p["name"] for p in obj["status"]["pools"]] == ["h100"]
    assert rec.reconcile(obj).writes == 0


def test_an_object_that_gains_pools_scales_its_own_workload_to_zero():
    obj = infdep(replicas=2)
    kube = PoolKube(obj)
    rec = Reconciler(kube)
    rec.reconcile(obj)
    assert "pools" not in obj["status"]
    obj["spec"]["resources"]["gpuPools"] = TWO_POOLS
    obj["metadata"]["generation"] = 2
    rec.reconcile(obj)
    assert kube.children["Deployment", "chat"]["spec"]["replicas"] == 0
    assert rec.reconcile(obj).writes == 0


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("where", ["gpuProduct", "gpuPools"])
def test_an_unknown_gpu_product_is_plan_ready_false_listing_the_known_ones(where):
    resources = ({"gpuProduct": "X900"} if where == "gpuProduct" else
                 {"gpuPools": pools({"gpuProduct": "h100"}, {"gpuProduct": "X900"})})
    obj = infdep(**resources)
    kube = PoolKube(obj)
    result = Reconciler(kube).reconcile(obj)
    assert result.outcome == "refused"
    plan_ready = next(c for c in obj["status"]["conditions"] if c["type"] == "PlanReady")
    assert (plan_ready["status"], plan_ready["reason"]) == ("False", "UnknownGpuProduct")
    assert "'X900'" in plan_ready["message"]
    assert plan_ready["message"].startswith(
        "spec.resources.gpuProduct" if where == "gpuProduct" else "gpuPools[x900].gpuProduct")
    assert all(name in plan_ready["message"] for name in GPUS)
    assert not kube.children  # no plan, no pods
    assert ("Warning", "UnknownGpuProduct") in [(t, r) for t, r, _ in kube.events]
    assert Reconciler(kube).reconcile(obj).writes == 0  # refused once, not a crash loop


def test_a_node_pool_of_mixed_products_pins_pods_and_names_the_others():
    """The user's nodeSelector matches H100 nodes and an A100 node: the pods keep to
    the H100s (the plan is for them), and a condition and a Warning name the A100."""
    obj = infdep(replicas=1, nodeSelector={"team": "chat"})
    kube = PoolKube(obj, [node("gpu-1", "h100", team="chat"), node("gpu-2", "h100", team="chat"),
                          node("gpu-3", SECOND, team="chat"), node("gpu-4", SECOND, team="x")])
    rec = Reconciler(kube)
    rec.reconcile(obj)
    assert required_products(kube.children["Deployment", "chat"]) == list(
        GPUS["h100"].gfd_products)
    mixed = next(c for c in obj["status"]["conditions"] if c["type"] == "MixedGPUProducts")
    assert (mixed["status"], mixed["reason"]) == ("True", "MixedGPUProducts")
    assert f"{GPUS[SECOND].gfd_products[0]} ({SECOND}) on gpu-3;" in mixed["message"]
    assert "gpu-4" not in mixed["message"] and "gpu-1" not in mixed["message"]
    assert ("Warning", "MixedGPUProducts") in [(t, r) for t, r, _ in kube.events]
    # Steady, and the nodes are listed at most every NODES_SECONDS.
    assert rec.reconcile(obj).writes == 0 and kube.node_lists == 1


def test_nodes_the_operator_may_not_list_leave_the_condition_out():
    from kubernetes.client.exceptions import ApiException

    obj = infdep(replicas=1, nodeSelector={"team": "chat"})
    kube = PoolKube(obj)

    def denied(selector: str) -> list[dict]:
        raise ApiException(status=403, reason="Forbidden")

    kube.list_nodes = denied
    assert Reconciler(kube).reconcile(obj).outcome == "ok"
    assert "MixedGPUProducts" not in {c["type"] for c in obj["status"]["conditions"]}


# ------------------------------------------------------------------ the autoscaler


def test_a_scale_down_takes_replicas_from_the_pools_whose_share_shrinks():
    from spillway_operator.flow.pools import removals

    spec = InferenceDeploymentSpec.model_validate({
        "model": {"name": "google/gemma-3-1b-it"},
        "resources": {"gpuPools": pools({"gpuProduct": "h100", "weight": 2},
                                        {"gpuProduct": SECOND})}})
    assert split_replicas(6, spec.resources.gpu_pools) == [4, 2]
    assert removals(spec, 6, 5) == {"h100": 1}
    assert removals(spec, 6, 3) == {"h100": 2, SECOND: 1}
    assert removals(spec, 3, 6) == {}


def test_the_autoscaler_marks_pods_of_the_shrinking_pool_only():
    """A scale-down marks (draining, lowest deletion cost) the pods the pools' own
    Deployments will remove: a mark on another pool's pod would stop the router
    sending to a pod no Deployment removes."""
    import asyncio

    from spillway_operator.flow.scaler import Autoscaler

    class Marks:
        def __init__(self):
            self.marked: list[str] = []

        def annotate_pod(self, namespace, name, annotations):
            self.marked.append(name)

    spec = InferenceDeploymentSpec.model_validate({
        "model": {"name": "google/gemma-3-1b-it"},
        "resources": {"gpuPools": pools({"gpuProduct": "h100", "weight": 2},
                                        {"gpuProduct": SECOND})}})

    def pod(name: str, pool: str, second: int) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {POOL_LABEL: pool},
                             "creationTimestamp": f"2026-01-01T00:00:0{second}Z"},
                "status": {"podIP": "10.0.0.1"}}

    # The second pool's pods are the newest: the one the object would give up first
    # without pools.
    live = [pod("s-0", SECOND, 8), pod("s-1", SECOND, 9)] + [
        pod(f"h-{i}", "h100", i) for i in range(4)]
    kube = Marks()
    scaler = Autoscaler(kube)
    marked = asyncio.run(scaler._mark_pools(("ns", "chat"), spec, live, live, 6, 5))
    assert marked == kube.marked and len(marked) == 1 and marked[0].startswith("h-")
