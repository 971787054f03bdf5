"""Replicas bigger than a node, against LeaderWorkerSet's real controller (v0.8.0, built
from the Go module proxy and run by the local control plane with its webhooks): one
InferenceDeployment of 16 GPUs on 8-GPU nodes is one group of two pods; it scales by
groups, a worker that dies restarts its group and the InferenceDeployment says so, a
rollout replaces groups one at a time, and the budget and Service count leaders.

The namespace is gated (e2e/cluster/kwok-stages.yaml): KWOK runs its pods but leaves them
unready until the test, standing in for the engines, marks them ready."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from kubernetes import client

from e2e.cluster.controlplane import REPO_ROOT
from spillway_engine.planner.model_config import load_local
from spillway_operator.names import (
    GROUP,
    LWS_GROUP_INDEX,
    LWS_WORKER_INDEX,
    PLURAL,
    VERSION,
)
from tests.helpers import fresh_namespace, wait_for

pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.local_only]

LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
READY = "spillway.dev/harness-ready"
HOLD = "spillway.dev/test-hold"


@pytest.fixture
def gated(api, cluster):
    """A gated namespace, and a fourth 8-GPU node so two groups of 16 GPUs fit."""
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-extra"}}
    template = json.loads(cluster.kubectl("get", "node", "gpu-node-0", "-o", "json"))
    node["metadata"]["labels"] = {**template["metadata"]["labels"],
                                  "kubernetes.io/hostname": "gpu-node-extra"}
    node["metadata"]["annotations"] = {"node.alpha.kubernetes.io/ttl": "0"}
    node["status"] = {k: template["status"][k] for k in ("capacity", "allocatable")}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(node))
    wait_for(lambda: "True" in cluster.kubectl(
        "get", "node", "gpu-node-extra", "-o",
        "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False), 60,
        "the extra node to turn Ready")
    try:
        with fresh_namespace(api, f"gated-lws-{uuid.uuid4().hex[:6]}") as name:
            yield name
    finally:
        cluster.kubectl("delete", "node", "gpu-node-extra", "--wait=false", check=False)


class Group:
    def __init__(self, api, ns):
        self.ns = ns
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.policy = client.PolicyV1Api(api)

    def create(self, name, **spec):
        config = load_local(REPO_ROOT / "tests/fixtures/models/llama-3.2-1b.json")
        self.core.create_namespaced_config_map(self.ns, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="model"), data={"config.json": json.dumps(config)}))
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
            "metadata": {"name": name},
            "spec": {"model": {"name": "meta-llama/Llama-3.2-1B",
                               "configMapRef": {"name": "model"}},
                     "offload": {"hostMemory": "8Gi"}, **spec}})

    def get(self, name):
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def patch(self, name, patch):
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, patch)

    def lws(self, name):
        return self.custom.get_namespaced_custom_object(*LWS[:2], self.ns, LWS[2], name)

    def pods(self):
        return [p for p in self.core.list_namespaced_pod(self.ns).items
                if not p.metadata.deletion_timestamp]

    def mark_ready(self):
        """The engines loaded: a running worker turns Ready, and a leader only once every
        worker of its group is Ready, as vLLM's leader serves only after all ranks joined.
        (LeaderWorkerSet counts a group ready from its leader's Ready and its workers merely
        created, so a leader marked first would let a rollout take the next group down.)"""
        pods = self.pods()
        workers_ready: dict[str, bool] = {}
        for p in pods:
            labels = p.metadata.labels or {}
            if labels.get(LWS_WORKER_INDEX) != "0":
                group = labels.get(LWS_GROUP_INDEX)
                workers_ready[group] = workers_ready.get(group, True) and is_ready(p)
        for p in pods:
            labels = p.metadata.labels or {}
            leader = labels.get(LWS_WORKER_INDEX) == "0"
            if p.status.phase != "Running" or (p.metadata.annotations or {}).get(READY) == "true":
                continue
            if leader and not workers_ready.get(labels.get(LWS_GROUP_INDEX), False):
                continue
            self.core.patch_namespaced_pod(p.metadata.name, self.ns,
                                           {"metadata": {"annotations": {READY: "true"}}})

    def ready_groups(self, name):
        self.mark_ready()
        return (self.get(name).get("status") or {}).get("readyReplicas") or 0

    def state(self, name):
        """What the world looked like, for a failed wait."""
        try:
            lws = self.lws(name).get("status")
        except client.ApiException as exc:
            lws = exc.status
        return {"lws": lws, "status": self.get(name).get("status"),
                "pods": [(p.metadata.name, p.status.phase, p.spec.node_name,
                          [(c.type, c.status) for c in p.status.conditions or []])
                         for p in self.pods()]}

    def condition(self, name, ctype):
        return next((c for c in (self.get(name).get("status") or {}).get("conditions", [])
                     if c["type"] == ctype), None)

    def events(self, name):
        return self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}").items


def is_ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def by_group(pods):
    groups: dict[str, dict[str, client.V1Pod]] = {}
    for p in pods:
        labels = p.metadata.labels or {}
        groups.setdefault(labels[LWS_GROUP_INDEX], {})[labels[LWS_WORKER_INDEX]] = p
    return groups


def env_of(pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env or []}


def test_sixteen_gpus_on_eight_gpu_nodes_run_as_leader_worker_set_groups(api, gated):
    g = Group(api, gated)
    g.create("big", engine={"tensorParallelSize": 16}, replicas=1)
    wait_for(lambda: g.ready_groups("big") == 1, 90, "one group of two pods to turn Ready",
             on_timeout=lambda: g.state("big"))

    # One group: a leader and a worker, 8 GPUs each, on two nodes, ranks from LWS's webhook.
    lws = g.lws("big")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2 and lws["spec"]["replicas"] == 1
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "InferenceDeployment"
    groups = by_group(g.pods())
    assert list(groups) == ["0"] and sorted(groups["0"]) == ["0", "1"]
    leader, worker = groups["0"]["0"], groups["0"]["1"]
    for pod in (leader, worker):
        engine = pod.spec.containers[0]
        assert engine.resources.limits["nvidia.com/gpu"] == "8"
        assert engine.args[engine.args.index("--nnodes") + 1] == "2"
    assert leader.spec.node_name != worker.spec.node_name
    env = env_of(worker)
    assert env["LWS_WORKER_INDEX"] == "1" and env["LWS_GROUP_SIZE"] == "2"
    assert env["LWS_LEADER_ADDRESS"].startswith(leader.metadata.name + ".")
    status = g.get("big")["status"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert status["plan"]["nodes"] == 2 and status["plan"]["gpusPerPod"] == 8
    assert g.condition("big", "Available")["status"] == "True"
    apps = client.AppsV1Api(api)
    assert apps.list_namespaced_deployment(gated).items == []
    # Requests go to leaders only; one budget over the pods counts groups.
    svc = g.core.read_namespaced_service("big", gated)
    assert svc.spec.selector[LWS_WORKER_INDEX] == "0"
    pdb = g.policy.read_namespaced_pod_disruption_budget("big", gated)
    assert pdb.spec.selector.match_labels == {
        "app.kubernetes.io/name": "spillway-engine", "spillway.dev/inference-deployment": "big"}

    # Scale 1 -> 2 groups (the scale subresource counts groups).
    g.patch("big", {"spec": {"replicas": 2}})
    wait_for(lambda: g.ready_groups("big") == 2, 90, "two groups Ready")
    assert g.lws("big")["spec"]["replicas"] == 2
    groups = by_group(g.pods())
    assert sorted(groups) == ["0", "1"] and all(len(m) == 2 for m in groups.values())

    # A worker pod killed: LWS recreates its whole group; the InferenceDeployment says so.
    # KWOK removes a deleted pod at once, where a kubelet keeps it terminating through its
    # grace period (what LWS's pod controller reacts to): a finalizer stands in for that.
    old_leader = groups["0"]["0"].metadata.uid
    worker = groups["0"]["1"].metadata.name
    g.core.patch_namespaced_pod(worker, gated, {"metadata": {"finalizers": [HOLD]}})
    try:
        g.core.delete_namespaced_pod(worker, gated)
        wait_for(lambda: (p := by_group(g.pods()).get("0", {}).get("0")) is None or (
            p.metadata.uid != old_leader), 60, "LWS to delete group 0's leader")
    finally:
        g.core.patch_namespaced_pod(worker, gated, {"metadata": {"finalizers": None}})
    c = wait_for(lambda: (c := g.condition("big", "Degraded")) and c["reason"] == (
        "GroupRestarting") and c, 60, "Degraded=GroupRestarting")
    assert c["status"] == "True" and "group(s) 0" in c["message"]
    wait_for(lambda: any(e.reason == "GroupRestarting" and e.type == "Warning"
                         for e in g.events("big")), 30, "a Warning Event GroupRestarting")
    new_leader = wait_for(lambda: (p := by_group(g.pods()).get("0", {}).get("0")) and (
        p.metadata.uid != old_leader) and p, 60, "group 0's leader recreated")
    assert new_leader.metadata.uid != old_leader
    wait_for(lambda: g.ready_groups("big") == 2 and g.condition("big", "Degraded")["reason"] == (
        "AsExpected"), 90, "the group whole again")

    # A rollout (a new plan) replaces groups one at a time: never both groups down.
    def template_hash():
        return g.lws("big")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"][
            "annotations"]["spillway.dev/plan-hash"]

    old_hash = template_hash()
    g.patch("big", {"spec": {"offload": {"hostMemory": "6Gi"}}})
    new_hash = wait_for(lambda: (h := template_hash()) != old_hash and h, 60,
                        "the operator to apply the new plan's template")
    serving_low = 2
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pods = g.pods()
        groups = by_group(pods)
        ready = sum(1 for m in groups.values() if len(m) == 2 and all(
            is_ready(p) for p in m.values()))
        serving_low = min(serving_low, ready)
        hashes = {(p.metadata.annotations or {}).get("spillway.dev/plan-hash") for p in pods}
        if ready == 2 and hashes == {new_hash} and len(pods) == 4 and g.lws("big").get(
                "status", {}).get("updatedReplicas") == 2:
            break
        g.mark_ready()
        time.sleep(0.3)
    else:
        raise AssertionError(f"the rollout did not finish: {g.lws('big').get('status')}")
    assert serving_low >= 1, "both groups were down at once during the rollout"
    plan = json.loads(g.core.read_namespaced_config_map("big-plan", gated).data["plan.json"])
    assert plan["cpu_memory_bytes"] == 6 * 2**30
    wait_for(lambda: g.condition("big", "Progressing")["reason"] == "RolloutComplete", 30,
             "Progressing=False RolloutComplete")
    assert g.get("big")["status"]["readyReplicas"] == 2
    assert g.condition("big", "Degraded")["reason"] == "AsExpected"  # a rollout, no restart
