"""The operator, as a real process, against the real control plane: an
InferenceDeployment becomes a sized Deployment of GPU pods on fake GPU nodes."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from kubernetes import client

from e2e.cluster.controlplane import REPO_ROOT, locate_binaries
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import wait_for

pytestmark = pytest.mark.usefixtures("operator")

MODELS = REPO_ROOT / "tests" / "fixtures" / "models"


def model_configmap(core: client.CoreV1Api, ns: str, name: str, fixture: str) -> None:
    from spillway_engine.planner.model_config import load_local

    config = load_local(MODELS / fixture)
    core.create_namespaced_config_map(
        ns,
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name),
                           data={"config.json": json.dumps(config)}),
    )


def infdep(name: str, *, config_map: str | None = "model", replicas: int = 1,
           tp: int = 1, host_memory: str = "16Gi", **extra) -> dict:
    spec = {
        "model": {"name": "google/gemma-3-1b-it"},
        "replicas": replicas,
        "engine": {"tensorParallelSize": tp},
        "offload": {"hostMemory": host_memory},
        **extra,
    }
    if config_map:
        spec["model"]["configMapRef"] = {"name": config_map}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
            "metadata": {"name": name}, "spec": spec}


class Env:
    def __init__(self, api, ns, cluster):
        self.ns, self.cluster = ns, cluster
        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def create(self, body):
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def get(self, name):
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def patch(self, name, patch):
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name,
                                                          patch)

    def condition(self, name, ctype):
        for c in (self.get(name).get("status") or {}).get("conditions", []):
            if c["type"] == ctype:
                return c
        return None

    def wait_condition(self, name, ctype, status, reason=None, timeout=60):
        def ok():
            c = self.condition(name, ctype)
            return c if c and c["status"] == status and (reason is None or
                                                          c["reason"] == reason) else None
        return wait_for(ok, timeout, f"{ctype}={status} ({reason}) on {name}")

    def deployment(self, name):
        try:
            return self.apps.read_namespaced_deployment(name, self.ns)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def kubectl(self, *args, check=True):
        return self.cluster.kubectl(*args, "-n", self.ns, check=check)

    def events(self, name):
        return self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}").items


@pytest.fixture
def env(api, namespace, cluster):
    e = Env(api, namespace, cluster)
    model_configmap(e.core, namespace, "model", "gemma-3-1b-it.json")
    return e


def test_create_gives_sized_children_and_available_pods(env):
    env.create(infdep("gemma", replicas=2))
    env.wait_condition("gemma", "Available", "True", "MinimumReplicasAvailable")
    obj = env.get("gemma")
    status, plan = obj["status"], obj["status"]["plan"]
    assert status["readyReplicas"] == 2 and status["observedGeneration"] == 1
    assert env.condition("gemma", "PlanReady")["status"] == "True"
    assert [g["kind"] for g in plan["kvGroups"]].count("sliding_window") >= 1
    assert plan["capacityTokens"] > 0 and plan["hostPoolBytes"] == 16 * 2**30

    # The ConfigMap carries the exact plan; the pods are sized from it.
    cm = env.core.read_namespaced_config_map("gemma-plan", env.ns)
    full = json.loads(cm.data["plan.json"])
    assert full["capacity_tokens"] == plan["capacityTokens"]
    dep = env.deployment("gemma")
    pod = dep.spec.template.spec
    engine = pod.containers[0]
    from spillway_engine.quantity import parse_bytes

    assert parse_bytes(engine.resources.limits["memory"]) == full["pod"]["memory_limit_bytes"]
    assert parse_bytes(engine.resources.requests["memory"]) == full["pod"]["memory_request_bytes"]
    assert engine.resources.limits["nvidia.com/gpu"] == "1"
    shm = next(v for v in pod.volumes if v.name == "dshm")
    assert shm.empty_dir.medium == "Memory"
    assert parse_bytes(shm.empty_dir.size_limit) == full["pod"]["shm_bytes"]
    assert engine.security_context.run_as_non_root is True
    assert dep.metadata.owner_references[0].kind == "InferenceDeployment"
    svc = env.core.read_namespaced_service("gemma", env.ns)
    assert svc.spec.ports[0].port == 8000

    pods = env.core.list_namespaced_pod(env.ns, label_selector=obj["status"]["selector"]).items
    assert len(pods) == 2
    assert all(p.spec.node_name.startswith("gpu-node-") for p in pods)

    # kubectl shows the printer columns filled in.
    out = env.kubectl("get", "infdep", "gemma")
    header, row = out.strip().splitlines()
    assert header.split()[:4] == ["NAME", "MODEL", "DESIRED", "READY"]
    assert "google/gemma-3-1b-it" in row and "16.00 GiB" in row
    assert str(plan["capacityTokens"]) in row

    events = {e.reason for e in env.events("gemma")}
    assert {"PlanComputed", "MinimumReplicasAvailable"} <= events


@pytest.mark.local_only  # reads the local operator process's own metrics
def test_steady_state_reconcile_makes_no_writes(env, operator):
    env.create(infdep("steady"))
    env.wait_condition("steady", "Available", "True")
    env.wait_condition("steady", "Progressing", "False", "RolloutComplete")

    def settled():
        before = operator.metric("spillway_operator_reconciles_total", outcome="ok")
        patches = operator.metric("spillway_operator_api_requests_total", verb="patch")
        posts = operator.metric("spillway_operator_api_requests_total", verb="post")
        return before, patches, posts

    # Let in-flight reconciles finish, then poke the object without changing its spec.
    samples = []

    def quiet():
        samples.append(settled())
        return len(samples) >= 3 and samples[-1] == samples[-2] == samples[-3]

    wait_for(quiet, 60, "the operator to go quiet", interval=1.5)
    reconciles, patches, posts = samples[-1]
    env.patch("steady", {"metadata": {"annotations": {"test/poke": "1"}}})
    wait_for(lambda: operator.metric("spillway_operator_reconciles_total", outcome="ok")
             > reconciles, 30, "a reconcile of the poked object")
    assert operator.metric("spillway_operator_api_requests_total", verb="patch") == patches
    assert operator.metric("spillway_operator_api_requests_total", verb="post") == posts


def test_editing_tensor_parallel_rolls_out_new_gpu_count_and_plan(env):
    env.create(infdep("tp"))
    env.wait_condition("tp", "Available", "True")
    old_hash = env.get("tp")["status"]["plan"]["hash"]
    env.patch("tp", {"spec": {"engine": {"tensorParallelSize": 2}}})

    def rolled():
        obj = env.get("tp")
        p = obj["status"].get("plan", {})
        if p.get("hash") == old_hash or p.get("gpusPerPod") != 2:
            return None
        c = env.condition("tp", "Progressing")
        return obj if c and c["reason"] == "RolloutComplete" and obj["status"][
            "observedGeneration"] == 2 else None

    wait_for(rolled, 90, "the rollout to the TP=2 plan")
    plan = json.loads(env.core.read_namespaced_config_map("tp-plan", env.ns).data["plan.json"])
    assert plan["parallelism"]["tensor_parallel_size"] == 2
    pods = env.core.list_namespaced_pod(env.ns, label_selector=env.get("tp")["status"][
        "selector"]).items
    live = [p for p in pods if not p.metadata.deletion_timestamp]
    assert live and all(p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"
                        for p in live)
    assert env.condition("tp", "Available")["status"] == "True"


def test_more_gpus_than_any_node_is_reported_unschedulable(env):
    # Llama-3.2-1B has 32 heads, so TP=16 is a valid plan; no node has 16 GPUs. One pod
    # of them (engine.nodes 1; by default the replica would span two nodes).
    model_configmap(env.core, env.ns, "llama", "llama-3.2-1b.json")
    env.create(infdep("huge", config_map="llama", engine={"tensorParallelSize": 16,
                                                           "nodes": 1}))
    c = env.wait_condition("huge", "Available", "False", "InsufficientGPUCapacity", timeout=90)
    assert "nvidia.com/gpu" in c["message"]
    assert env.condition("huge", "Degraded")["status"] == "True"
    assert any(e.reason == "InsufficientGPUCapacity" and e.type == "Warning"
               for e in env.events("huge"))


def test_infeasible_plan_gives_condition_event_and_no_pods(env):
    env.create(infdep("tiny", host_memory="1Ki"))
    c = env.wait_condition("tiny", "PlanReady", "False", "OffloadPlanInvalid")
    assert c["message"]
    wait_for(lambda: any(e.reason == "OffloadPlanInvalid" for e in env.events("tiny")), 30,
             "the OffloadPlanInvalid Event")
    assert env.deployment("tiny") is None
    assert not env.core.list_namespaced_pod(env.ns).items


def test_infeasible_edit_keeps_the_running_deployment(env):
    env.create(infdep("keep"))
    env.wait_condition("keep", "Available", "True")
    before = env.deployment("keep")
    env.patch("keep", {"spec": {"offload": {"hostMemory": "1Ki"}}})
    env.wait_condition("keep", "PlanReady", "False", "OffloadPlanInvalid")
    env.wait_condition("keep", "Degraded", "True", "OffloadPlanInvalid")
    after = env.deployment("keep")
    assert after.metadata.generation == before.metadata.generation
    assert after.spec.template.metadata.annotations == before.spec.template.metadata.annotations
    assert env.condition("keep", "Available")["status"] == "True"


def test_missing_configmap_is_retried_until_it_appears(env):
    env.create(infdep("late", config_map="late-model"))
    env.wait_condition("late", "PlanReady", "False", "ModelConfigUnavailable")
    assert env.deployment("late") is None
    model_configmap(env.core, env.ns, "late-model", "llama-3.2-1b.json")
    env.wait_condition("late", "PlanReady", "True", timeout=60)
    env.wait_condition("late", "Available", "True", timeout=60)


def claim(env, name, size, modes):
    env.core.create_namespaced_persistent_volume_claim(env.ns, client.V1PersistentVolumeClaim(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PersistentVolumeClaimSpec(
            access_modes=modes, storage_class_name="",
            resources=client.V1VolumeResourceRequirements(requests={"storage": size}))))


def test_a_shared_disk_tier_waits_for_its_claim_and_refuses_one_that_cannot_hold_it(env):
    shared = {"hostMemory": "16Gi",
              "disk": {"size": "100Gi", "volume": "SharedPVC", "claimName": "kv"}}
    env.create(infdep("late-disk", offload=shared))
    c = env.wait_condition("late-disk", "PlanReady", "False", "DiskVolumeUnavailable")
    assert c["message"] == f"offload.disk.claimName: PersistentVolumeClaim kv not found in {env.ns}"
    assert env.deployment("late-disk") is None
    claim(env, "kv", "200Gi", ["ReadWriteMany"])
    env.wait_condition("late-disk", "PlanReady", "True", timeout=60)
    pod = env.deployment("late-disk").spec.template.spec
    assert [v.persistent_volume_claim.claim_name for v in pod.volumes if v.name == "kv-disk"] \
        == ["kv"]
    assert env.get("late-disk")["status"]["plan"]["diskCapacityTokens"] > 0

    claim(env, "kv-rwo", "200Gi", ["ReadWriteOnce"])
    env.create(infdep("rwo", offload={**shared, "disk": {**shared["disk"], "claimName": "kv-rwo"}}))
    c = env.wait_condition("rwo", "PlanReady", "False", "DiskVolumeInvalid")
    assert c["message"].startswith("offload.disk.claimName: PersistentVolumeClaim kv-rwo is "
                                   "ReadWriteOnce; a disk tier every replica shares needs "
                                   "ReadWriteMany")
    claim(env, "kv-small", "10Gi", ["ReadWriteMany"])
    env.create(infdep("small", offload={**shared,
                                        "disk": {**shared["disk"], "claimName": "kv-small"}}))
    c = env.wait_condition("small", "PlanReady", "False", "DiskVolumeInvalid")
    assert c["message"] == ("offload.disk.size: 100Gi is more than PersistentVolumeClaim "
                            "kv-small holds (10Gi)")
    wait_for(lambda: any(e.reason == "DiskVolumeInvalid" for e in env.events("small")), 30,
             "the DiskVolumeInvalid Event")
    assert env.deployment("rwo") is None and env.deployment("small") is None


def test_an_ephemeral_disk_tier_names_a_missing_storage_class(env):
    env.create(infdep("nvme", offload={"hostMemory": "16Gi", "disk": {
        "size": "1Ti", "volume": "Ephemeral", "storageClassName": "local-nvme"}}))
    c = env.wait_condition("nvme", "PlanReady", "False", "DiskVolumeUnavailable")
    assert c["message"] == "offload.disk.storageClassName: StorageClass local-nvme not found"
    assert env.deployment("nvme") is None


def test_drift_on_the_deployment_is_repaired(env):
    env.create(infdep("drift"))
    env.wait_condition("drift", "Available", "True")
    want = env.deployment("drift").spec.template.spec.containers[0].image
    env.apps.patch_namespaced_deployment("drift", env.ns, {"spec": {"replicas": 3, "template": {
        "spec": {"containers": [{"name": "engine", "image": "example.invalid/other:1"}]}}}})
    wait_for(lambda: (d := env.deployment("drift")).spec.template.spec.containers[0].image == want
             and d.spec.replicas == 1, 30, "the operator to restore image and replicas")


def test_scale_subresource_drives_replicas(env):
    env.create(infdep("scaled"))
    env.wait_condition("scaled", "Available", "True")
    env.kubectl("scale", "infdep/scaled", "--replicas=3")
    wait_for(lambda: env.get("scaled")["status"].get("readyReplicas") == 3, 60, "3 ready replicas")
    assert env.deployment("scaled").spec.replicas == 3
    scale = env.custom.get_namespaced_custom_object_scale(GROUP, VERSION, env.ns, PLURAL, "scaled")
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert "spillway.dev/inference-deployment=scaled" in scale["status"]["selector"]


def test_delete_cleans_up_children(env):
    env.create(infdep("gone"))
    env.wait_condition("gone", "Available", "True")
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "gone")
    wait_for(lambda: env.deployment("gone") is None, 60, "the Deployment to be collected")
    wait_for(lambda: not env.core.list_namespaced_pod(env.ns).items, 60, "the pods to go")
    wait_for(lambda: not [c for c in env.core.list_namespaced_config_map(env.ns).items
                          if c.metadata.name == "gone-plan"], 60, "the plan ConfigMap to go")


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"replicas": -1}, "spec.replicas"),
        ({"engine": {"tensorParallelSize": 0}}, "spec.engine.tensorParallelSize"),
        ({"offload": {"hostMemory": "lots"}}, "spec.offload.hostMemory"),
        ({"offload": {"blocksPerChunk": 4, "chunkTokens": 64}}, "only one of offload."),
        ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
         "minReplicas must not exceed"),
        ({"replicas": 9, "autoscaling": {"enabled": True, "maxReplicas": 4}},
         "spec.replicas must lie within"),
        ({"offload": {"hostMemory": "0"}}, "positive quantity"),
        ({"offload": {"hostMemory": "99999999999999999999Ei"}},
         "spec.offload.hostMemory: Invalid value: hostMemory must be at most 1Pi"),
        ({"offload": {"memoryLimit": "1025Ti"}}, "spec.offload.memoryLimit"),
        ({"resources": {"cpu": "65537"}}, "spec.resources.cpu"),
        ({"resources": {"extraMemory": "2P"}}, "extraMemory must be at most 1Pi"),
        ({"engine": {"bogus": 1}}, "bogus"),
        ({"offload": {"disk": {"size": "0"}}}, "spec.offload.disk.size"),
        ({"offload": {"disk": {"size": "10Gi", "volume": "SharedPVC"}}},
         "spec.offload.disk.claimName: Invalid value: offload.disk.claimName is required"),
        ({"offload": {"disk": {"size": "10Gi", "claimName": "kv"}}},
         "spec.offload.disk.claimName"),
        ({"offload": {"disk": {"size": "10Gi", "storageClassName": "nvme"}}},
         "storageClassName is only for volume Ephemeral"),
        ({"offload": {"disk": {"size": "10Gi", "volume": "Tape"}}}, "spec.offload.disk.volume"),
        ({"offload": {"offloader": "upstream", "disk": {"size": "10Gi"}}},
         "spec.offload.disk: Invalid value: offload.disk runs under offloader spillway only"),
    ],
)
def test_invalid_spec_is_refused_at_apply_naming_the_field(env, tmp_path, patch, needle):
    body = infdep("bad")
    for key, value in patch.items():
        if isinstance(value, dict):
            body["spec"].setdefault(key, {}).update(value)
        else:
            body["spec"][key] = value
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump(body))
    proc = subprocess.run(
        [str(locate_binaries()["kubectl"]), f"--kubeconfig={env.cluster.config.kubeconfig}",
         "apply", "-n", env.ns, "-f", str(manifest)],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr
    assert "InferenceDeployment" in proc.stderr or "inferencedeployment" in proc.stderr.lower()
