"""Children rendered from (spec, plan) and the comparator that keeps steady state write-free."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spillway_engine.planner.model_config import load_local
from spillway_engine.planner.plan import Plan, make_plan
from spillway_engine.quantity import format_bytes, parse_bytes
from spillway_engine.seam import PLAN_FILE
from spillway_operator.flow import render
from spillway_operator.flow.render import engine_options
from spillway_operator.flow.spec import InferenceDeploymentSpec
from spillway_operator.plumbing.kube import Kube, contains, resource_path

MODELS = Path(__file__).resolve().parents[3] / "fixtures" / "models"
OWNER = render.Owner("chat", "team-a", "uid-123")


def plan_for(spec: InferenceDeploymentSpec, fixture="gemma-3-1b-it.json") -> Plan:
    return make_plan(load_local(MODELS / fixture), spec.plan_request())


def spec_of(**fields) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"name": "google/gemma-3-1b-it"},
                                                   **fields})


def test_deployment_is_sized_from_the_plan():
    spec = spec_of(engine={"tensorParallelSize": 2}, offload={"hostMemory": "32Gi"})
    plan = plan_for(spec)
    dep = render.deployment(OWNER, spec, plan)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert parse_bytes(c["resources"]["limits"]["memory"]) == plan.pod.memory_limit_bytes
    assert parse_bytes(c["resources"]["requests"]["memory"]) == plan.pod.memory_request_bytes
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert parse_bytes(shm["emptyDir"]["sizeLimit"]) == plan.pod.shm_bytes
    assert plan.pod.shm_bytes >= 32 * 2**30
    assert dep["spec"]["template"]["metadata"]["annotations"]["spillway.dev/plan-hash"] == \
        render.plan_hash(plan)
    assert c["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert "NVIDIA-H100-80GB-HBM3" in terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-123"


def test_token_is_referenced_never_copied():
    spec = spec_of(model={"name": "meta-llama/Llama-3.2-1B",
                          "tokenSecretRef": {"name": "hf", "key": "tok"}})
    dep = render.deployment(OWNER, spec, plan_for(spec, "llama-3.2-1b.json"))
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    hf = next(e for e in env if e["name"] == "HF_TOKEN")
    assert hf == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}}}
    assert "tok" not in engine_options(spec).to_json()


def test_user_affinity_terms_all_require_the_gpu_product():
    spec = spec_of(resources={"gpuProduct": "H200", "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
        ]}}}})
    dep = render.deployment(OWNER, spec, plan_for(spec))
    terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    for term in terms:
        keys = [e["key"] for e in term["matchExpressions"]]
        assert keys == ["zone", "nvidia.com/gpu.product"]
        assert "NVIDIA-H200" in term["matchExpressions"][1]["values"]


def test_auto_host_memory_fits_the_memory_limit():
    spec = spec_of(engine={"tensorParallelSize": 2}, offload={"memoryLimit": "300Gi"})
    plan = plan_for(spec)
    assert plan.pod.memory_limit_bytes <= 300 * 2**30
    assert plan.cpu_memory_bytes > 200 * 2**30


def test_configmap_holds_the_plan_json_sorted_as_the_engine_reads_it():
    spec = spec_of()
    plan = plan_for(spec)
    text = render.plan_configmap(OWNER, spec, plan)["data"][PLAN_FILE]
    assert text == json.dumps(plan.model_dump(mode="json"), indent=2, sort_keys=True)
    assert Plan.model_validate_json(text) == plan


def test_plan_hash_follows_the_plan_not_a_copy_it_was_made_from():
    # the text is kept on the frozen plan; a changed copy must not carry the old one
    plan = plan_for(spec_of())
    before = render.plan_hash(plan)
    changed = plan.model_copy(update={"max_model_len": plan.max_model_len // 2})
    assert render.plan_hash(changed) != before
    assert json.loads(render.plan_json(changed))["max_model_len"] == plan.max_model_len // 2
    assert render.plan_hash(plan.model_copy()) == before == render.plan_hash(plan)


def test_rest_paths_are_the_api_clients():
    spec = spec_of()
    plan = plan_for(spec)
    children = [render.plan_configmap(OWNER, spec, plan), render.service(OWNER, spec),
                render.deployment(OWNER, spec, plan), render.service_monitor(OWNER)]
    assert [Kube.object_path(c) for c in children] == [
        "/api/v1/namespaces/team-a/configmaps/chat-plan",
        "/api/v1/namespaces/team-a/services/chat",
        "/apis/apps/v1/namespaces/team-a/deployments/chat",
        "/apis/monitoring.coreos.com/v1/namespaces/team-a/servicemonitors/chat",
    ]
    assert resource_path("v1", "Pod", "team-a") == "/api/v1/namespaces/team-a/pods"
    assert resource_path("spillway.dev/v1alpha1", "InferenceDeployment", "team-a", "chat",
                         "scale") == \
        "/apis/spillway.dev/v1alpha1/namespaces/team-a/inferencedeployments/chat/scale"


@pytest.mark.parametrize(
    ("live", "desired", "equal"),
    [
        ({"a": 1, "server": "added"}, {"a": 1}, True),
        ({"a": 1}, {"a": 2}, False),
        ({"a": 1}, {"b": 1}, False),
        ({"l": [{"x": 1, "d": 0}]}, {"l": [{"x": 1}]}, True),
        ({"l": [{"x": 1}, {"x": 2}]}, {"l": [{"x": 1}]}, False),
        ({"limits": {"memory": "1Gi"}}, {"limits": {"memory": "1024Mi"}}, True),
        ({"limits": {"memory": "1Gi"}}, {"limits": {"memory": "1025Mi"}}, False),
        ({"requests": {"cpu": "500m"}}, {"requests": {"cpu": "0.5"}}, True),
        ({"port": 8000}, {"port": "8000"}, True),
        ({"image": "x:1"}, {"image": "x:2"}, False),
    ],
)
def test_contains(live, desired, equal):
    assert contains(live, desired) is equal


@given(st.integers(min_value=1, max_value=2**50))
def test_formatted_quantities_compare_equal_to_their_bytes(n):
    assert contains({"limits": {"memory": str(n)}}, {"limits": {"memory": format_bytes(n)}})


def test_workers_share_one_service_monitor_discovery():
    kube = Kube(None)
    asked = []

    def get(path):
        asked.append(path)
        time.sleep(0.05)  # a slow API server: the other workers arrive meanwhile
        return {"resources": [{"name": "servicemonitors"}]}

    kube.get = get
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: kube.service_monitors_served(), range(8)))
    assert answers == [True] * 8
    assert asked == ["/apis/monitoring.coreos.com/v1"]


def test_emulated_gpu_runs_the_same_launch_without_a_gpu():
    """spec.engine.emulateGPU: the planned launch plus the emulator's flags; no GPU
    requested and no GPU product required, so the pods schedule on any node."""
    real = spec_of(engine={"tensorParallelSize": 2}, offload={"hostMemory": "1Gi"})
    spec = spec_of(engine={"tensorParallelSize": 2, "emulateGPU": {"speed": 0.5,
                                                                   "kvBytes": 64 << 20}},
                   offload={"hostMemory": "1Gi"})
    plan = plan_for(spec)
    assert plan == plan_for(real)  # the plan is the GPU's, emulated or not
    pod = render.deployment(OWNER, spec, plan)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    real_c = render.deployment(OWNER, real, plan)["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][: len(real_c["args"])] == real_c["args"]
    assert c["args"][len(real_c["args"]):] == [
        "--emulate-gpu", "--emulate-speed", "0.5", "--emulate-kv-bytes", str(64 << 20)]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert "nvidia.com/gpu" not in c["resources"]["requests"]
    assert c["resources"]["limits"]["memory"] == real_c["resources"]["limits"]["memory"]
    assert "nodeAffinity" not in pod["affinity"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_emulated_gpu_can_request_the_planned_gpus():
    """requestGPUs: the pod asks for GPUs and the GPU product as the real one does (fake-GPU
    nodes whose device plugin admits it), and still runs the emulated launch."""
    real = spec_of(engine={"tensorParallelSize": 2}, offload={"hostMemory": "1Gi"})
    spec = spec_of(engine={"tensorParallelSize": 2, "emulateGPU": {"requestGPUs": True}},
                   offload={"hostMemory": "1Gi"})
    plan = plan_for(spec)
    pod = render.deployment(OWNER, spec, plan)["spec"]["template"]["spec"]
    real_pod = render.deployment(OWNER, real, plan)["spec"]["template"]["spec"]
    c, real_c = pod["containers"][0], real_pod["containers"][0]
    assert c["resources"] == real_c["resources"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["affinity"] == real_pod["affinity"]
    assert "--emulate-gpu" in c["args"]


@pytest.mark.parametrize("bad", [{"speed": -1}, {"kvBytes": 60000}, {"modelParams": 0},
                                 {"sped": 1}, {"requestGPUs": "yes please"}])
def test_emulated_gpu_fields_are_checked(bad):
    with pytest.raises(ValueError, match="emulateGPU"):
        spec_of(engine={"emulateGPU": bad})


@pytest.mark.parametrize(("scope", "per_engine"), [("Engine", 8), ("Pod", 4)])
def test_host_memory_is_per_engine_or_per_pod_as_the_spec_says(scope, per_engine):
    from spillway_operator.flow.status import plan_summary

    spec = spec_of(engine={"dataParallelSize": 2},
                   offload={"hostMemory": "8Gi", "hostMemoryScope": scope})
    plan = plan_for(spec)
    assert plan.cpu_memory_bytes == per_engine * 2**30
    summary = plan_summary(plan, spec.gpus_per_pod, "digest")
    assert summary.host_pool_bytes_per_engine == per_engine * 2**30
    assert summary.host_pool_bytes == 2 * per_engine * 2**30  # two engines' regions
    assert summary.host_memory_scope == scope


def test_pods_carry_their_planned_capacity_for_routers():
    spec = spec_of(offload={"hostMemory": "4Gi"})
    plan = plan_for(spec)
    annotations = render.deployment(OWNER, spec, plan)["spec"]["template"]["metadata"][
        "annotations"]
    assert annotations["spillway.dev/host-capacity-tokens"] == str(plan.capacity_tokens)
    assert annotations["spillway.dev/tokens-per-hash"] == str(plan.tokens_per_hash)
    assert plan.capacity_tokens > 0


def test_pods_publish_kv_events_on_their_own_ip_unless_switched_off():
    spec = spec_of()
    plan = plan_for(spec)
    dep = render.deployment(OWNER, spec, plan)
    template = dep["spec"]["template"]
    assert template["metadata"]["annotations"]["spillway.dev/kv-events"] == "on"
    env = template["spec"]["containers"][0]["env"]
    pod_ip = next(e for e in env if e["name"] == "SPILLWAY_POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert engine_options(spec).kv_events is True
    off = spec_of(engine={"kvEvents": {"enabled": False}})
    dep = render.deployment(OWNER, off, plan_for(off))
    assert dep["spec"]["template"]["metadata"]["annotations"]["spillway.dev/kv-events"] == "off"
    assert engine_options(off).kv_events is False


def _ports(workload: dict) -> dict[str, int]:
    template = workload["spec"].get("template") or workload["spec"]["leaderWorkerTemplate"][
        "workerTemplate"]
    [engine] = template["spec"]["containers"]
    assert all(p["protocol"] == "TCP" for p in engine["ports"])
    return {p["name"]: p["containerPort"] for p in engine["ports"]}


def test_each_data_parallel_rank_declares_its_kv_event_port():
    spec = spec_of()
    assert _ports(render.deployment(OWNER, spec, plan_for(spec))) == {
        "http": 8000, "kv-events": 5557}
    assert engine_options(spec).kv_events_port == 5557
    spec = spec_of(engine={"dataParallelSize": 3, "kvEvents": {"port": 6000}})
    assert _ports(render.deployment(OWNER, spec, plan_for(spec))) == {
        "http": 8000, "kv-events": 6000, "kv-events-1": 6001, "kv-events-2": 6002}
    assert json.loads(engine_options(spec).to_json())["kv_events_port"] == 6000
    # events off: no port to declare (nor to allow through a NetworkPolicy)
    off = spec_of(engine={"kvEvents": {"enabled": False, "port": 6000}})
    assert _ports(render.deployment(OWNER, off, plan_for(off))) == {"http": 8000}


@pytest.mark.parametrize(("port", "dp", "ok"), [
    (5557, 64, True), (7937, 64, False), (7937, 63, True), (8000, 1, False),
    (29500, 1, False), (29450, 64, False), (29400, 64, True), (65535, 1, True), (65535, 2, False),
])
def test_kv_event_ports_keep_clear_of_the_pods_other_ports(port, dp, ok):
    body = {"engine": {"dataParallelSize": dp, "kvEvents": {"port": port}}}
    if ok:
        spec_of(**body)
        return
    with pytest.raises(ValueError, match=r"engine\.kvEvents\.port"):
        spec_of(**body)


def test_speculative_spec_reaches_the_plan_and_the_engine_command():
    """engine.speculative -> the planner (with the drafter's config.json) -> the plan
    ConfigMap -> the engine's --speculative-config, drafter layers in the plan's groups."""
    from spillway_engine.launcher.serve import build_command
    from spillway_engine.planner.plan import read_plan
    from spillway_engine.seam import EngineOptions

    frontier = MODELS.parents[1] / "contract" / "frontier_configs"
    spec = InferenceDeploymentSpec.model_validate({
        "model": {"name": "Qwen/Qwen3-8B"},
        "engine": {"maxModelLen": 8192, "speculative": {
            "method": "draft_model", "numSpeculativeTokens": 4,
            "model": {"name": "Qwen/Qwen3-0.6B"}}},
        "offload": {"hostMemory": "16Gi"},
    })
    request = spec.plan_request()
    assert (request.speculative_method, request.num_speculative_tokens,
            request.speculative_model) == ("draft_model", 4, "Qwen/Qwen3-0.6B")
    plan = make_plan(load_local(frontier / "qwen3-8b.json"), request,
                     load_local(frontier / "qwen3-0.6b.json"))
    assert plan.draft_layer_indices == list(range(36, 64))
    shipped = read_plan(render.plan_configmap(OWNER, spec, plan)["data"]["plan.json"], "cm")
    cmd, _ = build_command(shipped, EngineOptions(model="Qwen/Qwen3-8B"))
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "method": "draft_model", "num_speculative_tokens": 4, "model": "Qwen/Qwen3-0.6B"
    }
    assert "--speculative-config" not in build_command(plan_for(spec_of()),
                                                       EngineOptions(model="m"))[0]


@pytest.mark.parametrize("cpu", ["250m", "2", "0.5", "1500m"])
def test_cpu_requests_take_millicores(cpu):
    """resources.cpu is a Kubernetes CPU quantity: millicores too (a 2-core node holds
    no 4-CPU engine)."""
    spec = spec_of(resources={"cpu": cpu})
    c = render.deployment(OWNER, spec, plan_for(spec))["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["requests"]["cpu"] == cpu


@pytest.mark.parametrize("cpu", ["250x", "1.5m", "m", "-1", "2Gi"])
def test_cpu_requests_refuse_what_is_not_a_cpu_quantity(cpu):
    with pytest.raises(ValueError, match="cpu"):
        spec_of(resources={"cpu": cpu})
