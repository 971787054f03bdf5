"""Day-2 operations on the local control plane (real API server, scheduler, controller
manager with its disruption and ReplicaSet controllers, KWOK fake GPU nodes): a node
drain's evictions held by the engine pods' PodDisruptionBudget, and rollouts on a
cluster with no spare GPU that finish, or say why they cannot."""

from __future__ import annotations

import contextlib
import http.client
import json
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest
from kubernetes import client

from e2e.simfleet import SimulatorFleet
from spillway_engine.emulator.tiny import llama_config, write_model
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import wait_for
from tests.integration.test_operator import Env, infdep, model_configmap

pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.local_only]

GPU = "nvidia.com/gpu"
SELECTOR = f"{GROUP}/inference-deployment"
# 8 GPUs per pod, a whole fake node (the test model's 4 heads allow TP 4 at most).
WHOLE_NODE = {"tensorParallelSize": 4, "dataParallelSize": 2}


@pytest.fixture
def env(api, namespace, cluster):
    e = Env(api, namespace, cluster)
    model_configmap(e.core, namespace, "model", "gemma-3-1b-it.json")
    return e


def engine_pods(env: Env, name: str) -> list[client.V1Pod]:
    return [p for p in env.core.list_namespaced_pod(
        env.ns, label_selector=f"{SELECTOR}={name}").items if not p.metadata.deletion_timestamp]


def evict(env: Env, pod: str) -> int:
    """POST pods/{pod}/eviction as kubectl drain does: 201, or 429 when the budget refuses."""
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=env.ns))
    try:
        env.core.create_namespaced_pod_eviction(pod, env.ns, body)
    except client.ApiException as exc:
        return exc.status
    return 201


@contextlib.contextmanager
def cordoned(env: Env):
    """Every node unschedulable, as the first step of a drain (of the whole cluster:
    a replacement pod then has nowhere to go, so the budget stays spent)."""
    nodes = [n.metadata.name for n in env.core.list_node().items]
    try:
        for n in nodes:
            env.core.patch_node(n, {"spec": {"unschedulable": True}})
        yield nodes
    finally:
        for n in nodes:
            env.core.patch_node(n, {"spec": {"unschedulable": False}})


def test_a_drain_evicts_no_more_than_the_budget(env):
    env.create(infdep("gemma", replicas=3))
    env.wait_condition("gemma", "Available", "True", "MinimumReplicasAvailable")
    policy = client.PolicyV1Api(env.core.api_client)
    pdb = policy.read_namespaced_pod_disruption_budget("gemma", env.ns)
    assert pdb.spec.max_unavailable == 1
    assert pdb.metadata.owner_references[0].kind == "InferenceDeployment"
    # The disruption controller has counted the three ready pods.
    wait_for(lambda: (p := policy.read_namespaced_pod_disruption_budget("gemma", env.ns))
             .status.disruptions_allowed == 1 and p.status.current_healthy == 3, 60,
             "the budget to allow one disruption")
    pods = [p.metadata.name for p in engine_pods(env, "gemma")]
    assert len(pods) == 3

    with cordoned(env):
        # All three at once, as a drain of their nodes asks: one goes, two are refused.
        answers = {p: evict(env, p) for p in pods}
        assert sorted(answers.values()) == [201, 429, 429], answers
        # The refusal holds while the evicted pod's replacement cannot start.
        refused = [p for p, a in answers.items() if a == 429]
        assert [evict(env, p) for p in refused] == [429, 429]
        assert len([p for p in engine_pods(env, "gemma")
                    if p.status.phase == "Running"]) == 2
    # Uncordoned: the replacement starts, the budget refills, the drain goes on.
    wait_for(lambda: policy.read_namespaced_pod_disruption_budget("gemma", env.ns)
             .status.disruptions_allowed == 1, 60, "the budget to refill")
    assert evict(env, refused[0]) == 201

    # A single replica has no protection unless asked: its one pod may be evicted.
    def budget():
        b = policy.read_namespaced_pod_disruption_budget("gemma", env.ns)
        return (b.spec.max_unavailable, b.status.expected_pods, b.status.disruptions_allowed,
                b.status.observed_generation == b.metadata.generation)

    env.patch("gemma", {"spec": {"replicas": 1}})
    wait_for(lambda: budget() == (1, 1, 1, True), 60, "the budget of one replica")
    env.patch("gemma", {"spec": {"disruption": {"protectSingleReplica": True}}})
    wait_for(lambda: budget() == (0, 1, 0, True), 60, "a budget of no eviction")
    (pod,) = engine_pods(env, "gemma")
    assert evict(env, pod.metadata.name) == 429


def free_gpus(env: Env) -> dict[str, int]:
    """Each node's allocatable GPUs minus those its pods request."""
    free = {n.metadata.name: int((n.status.allocatable or {}).get(GPU, "0"))
            for n in env.core.list_node().items}
    for p in env.core.list_pod_for_all_namespaces().items:
        if p.spec.node_name in free and p.status.phase not in ("Succeeded", "Failed"):
            for c in p.spec.containers:
                free[p.spec.node_name] -= int(((c.resources and c.resources.requests) or {})
                                              .get(GPU, "0"))
    return free


def fill_gpus(env: Env) -> int:
    """A pod on each node holding its remaining GPUs: the cluster has none spare."""
    filled = 0
    for node, n in free_gpus(env).items():
        if n <= 0:
            continue
        env.core.create_namespaced_pod(env.ns, {
            "metadata": {"name": f"filler-{node}"},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "containers": [{"name": "c", "image": "filler",
                                     "resources": {"requests": {GPU: str(n)},
                                                   "limits": {GPU: str(n)}}}]}})
        filled += n
    wait_for(lambda: all(p.status.phase == "Running" for p in env.core.list_namespaced_pod(
        env.ns, label_selector="!" + SELECTOR).items), 60, "the filler pods to run")
    assert sum(free_gpus(env).values()) == 0
    return filled


def images(env: Env, name: str) -> set[str]:
    return {p.spec.containers[0].image for p in engine_pods(env, name)}


def reasons(env: Env, name: str) -> dict[str, str]:
    return {e.reason: e.type for e in env.events(name)}


def test_a_rollout_on_a_full_cluster_finishes_in_place(env):
    # Two pods of 8 GPUs (a whole fake node each); every other GPU taken.
    env.create(infdep("big", replicas=2, engine=WHOLE_NODE, rollout={"surgeTimeoutSeconds": 3}))
    env.wait_condition("big", "Available", "True", "MinimumReplicasAvailable", timeout=90)
    env.wait_condition("big", "Progressing", "False", "RolloutComplete")
    fill_gpus(env)
    before = images(env, "big")

    env.patch("big", {"spec": {"engine": {**WHOLE_NODE, "image": "example.com/engine:2"}}})
    # The surge pod waits for a GPU; past the limit the pods are replaced one at a time.
    wait_for(lambda: "RollingOutInPlace" in reasons(env, "big"), 90,
             "the switch to an in-place rollout")
    env.wait_condition("big", "Progressing", "False", "RolloutComplete", timeout=120)
    assert images(env, "big") == {"example.com/engine:2"} != before
    assert len(engine_pods(env, "big")) == 2
    # Done: the next rollout starts with a surge again.
    wait_for(lambda: env.deployment("big").spec.strategy.rolling_update.max_surge == 1, 60,
             "the surge strategy back")
    assert "InsufficientGPUForSurge" not in reasons(env, "big")


def test_one_replica_on_a_full_cluster_reports_then_recreates(env):
    env.create(infdep("solo", replicas=1, engine=WHOLE_NODE,
                      rollout={"surgeTimeoutSeconds": 2}))
    env.wait_condition("solo", "Available", "True", "MinimumReplicasAvailable", timeout=90)
    fill_gpus(env)

    env.patch("solo", {"spec": {"engine": {**WHOLE_NODE, "image": "example.com/engine:2"}}})
    cond = env.wait_condition("solo", "Progressing", "False", "InsufficientGPUForSurge",
                              timeout=90)
    assert "Recreate" in cond["message"] and "gap" in cond["message"]
    # The Event follows the status write that the condition came in.
    wait_for(lambda: reasons(env, "solo").get("InsufficientGPUForSurge") == "Warning", 30,
             "the InsufficientGPUForSurge Warning Event")
    assert images(env, "solo") != {"example.com/engine:2"}  # the old pod still serves
    custom = client.CustomObjectsApi(env.core.api_client)
    assert custom.get_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL,
                                               "solo")["status"]["readyReplicas"] == 1

    # Told what to do: Recreate accepts the gap, and the rollout finishes.
    env.patch("solo", {"spec": {"rollout": {"strategy": "Recreate"}}})
    env.wait_condition("solo", "Progressing", "False", "RolloutComplete", timeout=120)
    assert images(env, "solo") == {"example.com/engine:2"}



# ------------------------------------------------------------------ drains

STREAM_TOKENS = 300


def _stream(url: str, out: dict) -> None:
    """One streaming completion against an engine; records its chunks, the finish
    reason, the tokens generated (usage) and [DONE]."""
    u = urlparse(url)
    out.update(url=url, tokens=0)
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "tiny/llama", "prompt": [5, 6, 7, 8], "max_tokens": STREAM_TOKENS,
            "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}),
            {"content-type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        for line in resp:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            chunk = json.loads(data)
            if "choices" not in chunk:
                out["error"] = chunk
                break
            if chunk.get("usage"):  # the last chunk: what the engine generated
                out["completion_tokens"] = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:  # a chunk may carry several tokens
                out["tokens"] += 1
                out["finish"] = chunk["choices"][0].get("finish_reason") or out.get("finish")
    except OSError as exc:
        out["error"] = repr(exc)


def test_a_scale_down_during_streams_drops_none(env, api, tmp_path):
    """Emulated engines (vLLM's real server) on the pods' IPs; the fleet stops a removed
    pod's engine as the kubelet does: the pod's preStop command, then SIGTERM. Streams
    run on both pods while the scale subresource (the autoscaler's write) takes one."""
    config = llama_config(num_layers=2)
    model_dir = write_model(tmp_path / "llama", config)
    env.core.create_namespaced_config_map(env.ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="llama"), data={"config.json": json.dumps(config)}))
    env.create({"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
                "metadata": {"name": "llama"}, "spec": {
                    "model": {"name": "tiny/llama", "configMapRef": {"name": "llama"}},
                    "replicas": 2,
                    # tens of tokens a second: a stream is still running at the scale-down
                    "engine": {"maxModelLen": 1024,
                               "emulateGPU": {"speed": 1, "modelParams": 7e10}},
                    "offload": {"hostMemory": "16Mi"},
                    "disruption": {"terminationGracePeriodSeconds": 240}}})
    with SimulatorFleet(api, env.ns, "llama", engine="emulated",
                        model_dirs={"tiny/llama": model_dir}, run_prestop=True) as fleet:
        wait_for(lambda: len(fleet.urls()) == 2, 420, "two emulated engines serving")
        urls = fleet.urls()
        streams: list[dict] = [{} for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(urls[i % 2], s))
                   for i, s in enumerate(streams)]
        for t in threads:
            t.start()
        wait_for(lambda: all(s.get("tokens") for s in streams), 120, "every stream started")

        client.CustomObjectsApi(api).patch_namespaced_custom_object_scale(
            GROUP, VERSION, env.ns, PLURAL, "llama", {"spec": {"replicas": 1}})
        wait_for(lambda: len(engine_pods(env, "llama")) == 1, 60, "the scale-down")
        (kept,) = engine_pods(env, "llama")
        gone = next(u for u in urls if f"//{kept.status.pod_ip}:" not in u)
        # The streams on the removed pod were still in flight when it went.
        on_gone = [s for s in streams if s["url"] == gone]
        assert on_gone and all(s.get("finish") is None for s in on_gone), streams
        for t in threads:
            t.join(300)
        dropped = [s for s in streams if not (s.get("status") == 200 and s.get("done")
                                              and s.get("finish") == "length"
                                              and s.get("completion_tokens") == STREAM_TOKENS)]
        assert dropped == [], dropped

        def prestop_said() -> str:
            logs = list(Path(fleet._dir).glob("*.prestop.log"))
            assert len(logs) <= 1, logs
            return logs[0].read_text() if logs else ""

        said = wait_for(lambda: "drain: {" in (text := prestop_said()) and text, 120,
                        "the removed pod's preStop to end")
        assert '"drained": true' in said, said
    print(f"\nscale-down 2 -> 1 during {len(streams)} streams ({len(on_gone)} on the removed "
          f"pod): {len(dropped)} dropped", file=sys.stderr)
