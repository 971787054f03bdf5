"""One InferenceDeployment on two GPU node pools, against the real control plane, the
operator process and vLLM's real server on the emulated GPU (e2e/simfleet.py).

The session cluster's KWOK nodes are H100s; the ``second_node`` fixture adds one with
GPU Feature Discovery's labels of another catalogue GPU (``SECOND``; e2e/cluster/gfd.py). An object
with a pool of each gets two workloads with their own plan ConfigMaps, each pod is on
a node of its pool's product, and each serves with the plan check passed on the GPU
its plan is for. A pool whose nodeSelector matches both products gets its pods on its
own product and the MixedGPUProducts condition naming the other node.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from kubernetes import client

from e2e.simfleet import SimulatorFleet
from spillway_engine.emulator.tiny import gemma3_config, write_model
from spillway_engine.planner.gpus import GPUS
from spillway_operator.flow.pools import POOL_LABEL
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import fresh_namespace, wait_for
from tests.integration.conftest import SECOND
from tests.integration.test_emulated_fleet import _complete, _kv_bytes, _obj, _prompt

pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.local_only]

START_S = 420
CONFIG = gemma3_config(num_layers=4, sliding_window=64)


@pytest.fixture
def gated_namespace(api):
    with fresh_namespace(api, f"gated-pools-{uuid.uuid4().hex[:6]}") as name:
        yield name


def _spec(replicas: int, kv_bytes: int, pools: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": {"name": "tiny/swa", "configMapRef": {"name": "swa"}},
        "replicas": replicas,
        "engine": {"maxModelLen": 1024,
                   "emulateGPU": {"speed": 0, "kvBytes": kv_bytes, "requestGPUs": True}},
        "offload": {"hostMemory": "16Mi"},
        "resources": {"gpuPools": pools},
    }


def _node_product(core: client.CoreV1Api, node: str) -> str:
    return core.read_node(node).metadata.labels["nvidia.com/gpu.product"]


def test_two_pools_serve_each_on_its_own_gpu_with_its_own_plan(
        api, cluster, second_node, gated_namespace, tmp_path):
    ns = gated_namespace
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    custom = client.CustomObjectsApi(api)
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="swa"), data={"config.json": json.dumps(CONFIG)}))
    pools = [{"name": "hopper", "gpuProduct": "H100"},
             {"name": "second", "gpuProduct": SECOND}]
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
        "metadata": {"name": "chat"}, "spec": _spec(2, _kv_bytes(CONFIG, 80), pools)})
    dirs = {"tiny/swa": write_model(tmp_path / "swa", CONFIG)}
    with SimulatorFleet(api, ns, "chat", engine="emulated", model_dirs=dirs) as fleet:
        def serving():
            status = _obj(custom, ns, "chat").get("status") or {}
            return status if status.get("readyReplicas") == 2 and len(fleet.urls()) == 2 \
                else None

        status = wait_for(serving, START_S, "both pools' engines to serve", interval=1,
                          on_timeout=lambda: (_obj(custom, ns, "chat").get("status"), {
                              p: fleet.log_text(p)[-1500:] for p in fleet.sims}))
        assert [(p["name"], p["replicas"], p["readyReplicas"], p["plan"]["gpu"])
                for p in status["pools"]] == [("hopper", 1, 1, "h100"),
                                              ("second", 1, 1, SECOND)]
        hashes = {p["name"]: p["plan"]["hash"] for p in status["pools"]}
        assert hashes["hopper"] != hashes["second"]
        for pool, gpu in (("hopper", "h100"), ("second", SECOND)):
            dep = apps.read_namespaced_deployment(f"chat-{pool}", ns)
            assert dep.spec.selector.match_labels[POOL_LABEL] == pool
            plan = json.loads(core.read_namespaced_config_map(
                f"chat-{pool}-plan", ns).data["plan.json"])
            assert plan["gpu"]["name"] == gpu
            [pod] = core.list_namespaced_pod(ns, label_selector=f"{POOL_LABEL}={pool}").items
            assert _node_product(core, pod.spec.node_name) in GPUS[gpu].gfd_products
            assert pod.metadata.annotations["spillway.dev/plan-hash"] == hashes[pool]
            log = fleet.log_text(pod.metadata.name)
            assert "Spillway plan check passed" in log, log[-2000:]
            assert f"Emulated GPU {gpu}:" in log, log[-2000:]
        # The object's Service selects both pools' pods; each answers.
        service = core.read_namespaced_service("chat", ns)
        assert POOL_LABEL not in service.spec.selector
        endpoints = core.list_namespaced_pod(ns, label_selector=",".join(
            f"{k}={v}" for k, v in service.spec.selector.items())).items
        assert len(endpoints) == 2
        for url in fleet.urls():
            assert len(_complete(url, "tiny/swa", _prompt(3), max_tokens=4)) == 4


def test_a_pool_over_nodes_of_two_products_keeps_to_its_own_and_names_the_other(
        api, cluster, second_node, namespace):
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="swa"), data={"config.json": json.dumps(CONFIG)}))
    spec = _spec(1, _kv_bytes(CONFIG, 80), [])
    spec["resources"] = {"gpuProduct": "h100", "nodeSelector": {"type": "kwok"}}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
        "metadata": {"name": "mixed"}, "spec": spec})

    def mixed():
        conditions = (_obj(custom, namespace, "mixed").get("status") or {}).get("conditions")
        return next((c for c in conditions or [] if c["type"] == "MixedGPUProducts"), None)

    condition = wait_for(mixed, 60, "the MixedGPUProducts condition")
    assert (condition["status"], condition["reason"]) == ("True", "MixedGPUProducts")
    other = second_node["metadata"]["name"]
    assert f"({SECOND}) on {other}" in condition["message"], condition
    [pod] = wait_for(lambda: [p for p in core.list_namespaced_pod(namespace).items
                              if p.spec.node_name] or None, 60, "the pod scheduled")
    assert _node_product(core, pod.spec.node_name) in GPUS["h100"].gfd_products
    # the Event is written after the condition; on a loaded machine it may not be there yet
    events = wait_for(lambda: core.list_namespaced_event(
        namespace, field_selector="reason=MixedGPUProducts").items or None, 30,
        "the MixedGPUProducts event")
    assert [e.type for e in events] == ["Warning"]


@pytest.mark.parametrize(("resources", "says"), [
    ({"gpuProduct": "H100; rm -rf /"}, "spec.resources.gpuProduct"),
    ({"gpuPools": [{"name": "a", "gpuProduct": "h100"}, {"name": "a", "gpuProduct": "l40s"}]},
     "each pool needs a name of its own"),
    ({"gpuPools": [{"name": "a", "gpuProduct": "h100", "minReplicas": 3, "maxReplicas": 2}]},
     "minReplicas must not exceed maxReplicas"),
    ({"gpuPools": [{"name": "Not_A_Label", "gpuProduct": "h100"}]}, "gpuPools[0].name"),
])
def test_the_api_server_refuses_garbage_gpu_input_at_apply(api, namespace, resources, says):
    custom = client.CustomObjectsApi(api)
    spec = {"model": {"name": "google/gemma-3-1b-it"}, "resources": resources}
    with pytest.raises(client.ApiException) as refused:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
            "metadata": {"name": "bad"}, "spec": spec})
    assert refused.value.status == 422 and says in refused.value.body, refused.value.body
