"""Spillway as a user installs it, on real nodes: the images built from the
repository's Dockerfile, the Helm chart (operator with leader election, router), and
InferenceDeployments that become real containers of the engine image on the real
kubelets, on the emulated GPU, requesting the fake GPUs the device plugin advertises.

What only real pods show: the kubelet starts the engine image as user 1000 with the
plan mounted, a memory-backed /dev/shm of the planned size and a real memory cgroup;
the kubelet runs the preStop drain when a pod is deleted (streams in flight finish;
without the hook they are cut); and a container that outgrows its limit is killed by
the kernel, which the operator reports as ``Degraded=EngineOOMKilled``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster.gfd import gfd_labels
from e2e.install import (
    RELEASE_NAMESPACE,
    helm_install,
    image_refs,
    load_images,
    model_config_map,
    model_volume,
    on_real_nodes,
)
from e2e.nodes.images import normalize
from spillway_engine.emulator.tiny import (
    deepseek_v2_config,
    llama_config,
    qwen3_next_config,
    write_model,
)
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = yaml.safe_load((ROOT / "config/samples/qwen3-next-tiny-emulated.yaml").read_text())
SERVING = "spillway-serving"  # the namespace the chart's router routes to
MODELS = Path(os.environ.get("SPILLWAY_NODES_MODELS", "/tmp/spillway-nodes-models"))
START_S = 600  # an engine start on a 2-core machine shared with the other pods
ENGINE_PORT = 8000
# Loading a new engine image (~10 GB) into both nodes takes minutes, and the engines
# start on a 2-core machine: each test's whole budget, fixtures included.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def installed(real_cluster, api):
    """Images loaded into both nodes, the chart installed from them, the tiny hybrid
    model on a volume and its config in a ConfigMap."""
    refs = image_refs()
    t0 = time.monotonic()
    loaded = load_images(refs)
    print(f"images into the nodes in {time.monotonic() - t0:.0f}s: {loaded}")
    real_cluster.kubectl("create", "namespace", SERVING, check=False)
    t0 = time.monotonic()
    helm_install(real_cluster, refs["operator"], SERVING)
    print(f"helm install --wait in {time.monotonic() - t0:.0f}s")
    config = qwen3_next_config(num_layers=4)
    model_dir = write_model(MODELS / "tiny-qwen3-next", config)
    model_volume(real_cluster, SERVING, "models", model_dir)
    model_config_map(real_cluster, SERVING, SAMPLE["spec"]["model"]["configMapRef"]["name"],
                     config)
    return refs


def _custom(api) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def _obj(api, name: str) -> dict[str, Any]:
    return _custom(api).get_namespaced_custom_object(GROUP, VERSION, SERVING, PLURAL, name)


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind),
                None)


def _apply(real_cluster, obj: dict[str, Any]) -> None:
    real_cluster.kubectl("apply", "-n", SERVING, "-f", "-", input=yaml.safe_dump(obj))


def _pods(core: client.CoreV1Api, name: str) -> list[client.V1Pod]:
    return [p for p in core.list_namespaced_pod(
        SERVING, label_selector=f"spillway.dev/inference-deployment={name}").items
        if not p.metadata.deletion_timestamp]


def _exec(real_cluster, pod: str, script: str) -> str:
    return real_cluster.kubectl("exec", "-n", SERVING, pod, "-c", "engine", "--",
                                "sh", "-c", script)


def _metrics(ip: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _complete(url: str, prompt: list[int], max_tokens: int = 8,
              model: str = SAMPLE["spec"]["model"]["name"]) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt,
                       "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stream(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: chunks and tokens received (the usage vLLM sends last;
    a busy server may put several tokens in one chunk) and whether the end came."""
    body = json.dumps({"model": SAMPLE["spec"]["model"]["name"], "prompt": prompt,
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    got = {"chunks": 0, "tokens": 0, "done": False, "finish": None, "error": None}
    try:
        with urllib.request.urlopen(req, timeout=90) as r:
            for raw in r:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    got["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        got["tokens"] = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or []:
                        got["chunks"] += 1
                        got["finish"] = choice.get("finish_reason") or got["finish"]
    except Exception as exc:  # a cut stream is what is counted
        got["error"] = f"{type(exc).__name__}: {exc}"
    return got


def _streams_through_a_deletion(core, pod: client.V1Pod, streams: int = 6,
                                max_tokens: int = 400) -> list[dict[str, Any]]:
    """``streams`` streamed completions straight to the pod's IP; the pod is deleted
    (as a scale-down or an eviction does) once every stream has its first tokens."""
    url = f"http://{pod.status.pod_ip}:{ENGINE_PORT}"
    results: list[dict[str, Any]] = [{} for _ in range(streams)]

    def run(i: int) -> None:
        results[i] = _stream(url, [7 + i] * 64, max_tokens)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    wait_for(lambda: _metrics(pod.status.pod_ip).get("vllm:num_requests_running", 0)
             >= streams, 60, "every stream running", interval=0.2)
    core.delete_namespaced_pod(pod.metadata.name, SERVING)
    for t in threads:
        t.join(120)
    return results


def _kill_container(pod: client.V1Pod) -> list[int]:
    """SIGKILL every process of the pod's engine container, found from the host in the
    container's memory cgroup (<node's cgroup root>/kubepods/<QoS>/pod<uid>/<id>): PID 1
    of a container ignores signals sent from inside it."""
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    root = Path("/sys/fs/cgroup/memory")
    procs = [*root.glob(f"*/kubepods/*/pod{pod.metadata.uid}/{cid}/cgroup.procs"),
             *root.glob(f"*/kubepods/pod{pod.metadata.uid}/{cid}/cgroup.procs")]
    pids = [int(x) for f in procs for x in f.read_text().split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


class TestServing:
    """One InferenceDeployment with two replicas, shared by the tests of this class."""

    NAME = "tiny"

    @pytest.fixture(scope="class")
    @classmethod
    def deployment(cls, real_cluster, api, installed):
        obj = on_real_nodes(SAMPLE, installed["engine"], "models")
        obj["metadata"]["name"] = cls.NAME
        obj["spec"]["replicas"] = 2
        obj["spec"]["autoscaling"] = {"enabled": False}
        obj["spec"]["engine"]["emulateGPU"]["speed"] = 1
        _apply(real_cluster, obj)
        core = client.CoreV1Api(api)
        t0 = time.monotonic()

        def available():
            cond = _condition(_obj(api, cls.NAME), "Available")
            return cond if cond and cond["status"] == "True" else None

        wait_for(available, START_S, "Available=True", interval=2,
                 on_timeout=lambda: (_obj(api, cls.NAME).get("status"),
                                     real_cluster.kubectl("get", "pods", "-n", SERVING,
                                                          "-o", "wide", check=False)))
        print(f"2 engine pods Ready on real nodes {time.monotonic() - t0:.0f}s after apply")
        yield core
        real_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", cls.NAME,
                             "--wait=true", "--timeout=120s", check=False)

    def test_engine_pods_are_real_containers_of_the_engine_image(
            self, real_cluster, api, installed, deployment):
        """Each replica is a container containerd started from the engine image on a
        real node, with the pod spec the operator rendered in force: user 1000, the fake
        GPU the device plugin allocated, /dev/shm a tmpfs of the planned size, the
        planned memory limit in the container's cgroup, the plan mounted and checked."""
        core = deployment
        pods = _pods(core, self.NAME)
        assert len(pods) == 2
        assert {p.spec.node_name for p in pods} == {"spillway-node-a", "spillway-node-b"}
        plan = _obj(api, self.NAME)["status"]["plan"]
        for p in pods:
            [cs] = p.status.container_statuses
            assert cs.container_id.startswith("containerd://"), cs.container_id
            assert cs.image == normalize(installed["engine"]), cs.image
            [c] = p.spec.containers
            assert c.resources.limits["nvidia.com/gpu"] == "1"
            out = _exec(real_cluster, p.metadata.name,
                        "id -u; echo $NVIDIA_VISIBLE_DEVICES; df -k /dev/shm | tail -1; "
                        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
                        "ls /etc/spillway/plan").split("\n")
            uid, gpus, shm, limit = out[0], out[1], out[2].split(), int(out[3])
            assert uid == "1000"
            assert gpus.startswith(f"GPU-{p.spec.node_name}-"), gpus
            assert shm[0] == "tmpfs" and int(shm[1]) * 1024 == plan["shmBytes"], (shm, plan)
            assert limit == plan["memoryLimitBytes"], (limit, plan)
            assert "plan.json" in out[4:], out
            log = core.read_namespaced_pod_log(p.metadata.name, SERVING, container="engine")
            assert "Spillway plan check" in log and "FAILED" not in log

    def test_the_chart_router_routes_to_them_and_metrics_come_from_pod_ips(
            self, real_cluster, api, deployment):
        """The router the chart installed (a pod of the operator image) routes
        completions to the engine pods through its Service; each pod's /metrics,
        scraped from its pod IP, counts them, with 0 KV mismatches."""
        core = deployment
        [svc] = core.list_service_for_all_namespaces(
            label_selector="app.kubernetes.io/name=spillway-router").items
        port = svc.spec.ports[0].port
        url = f"http://{svc.spec.cluster_ip}:{port}"
        model = SAMPLE["spec"]["model"]["name"]

        def router_sees_both() -> bool:
            # The router learns Ready pods from its watch and its own probes, a moment
            # after the Deployment says Available: before that it answers 503.
            with urllib.request.urlopen(f"{url}/healthz", timeout=10) as r:
                return json.loads(r.read())["ready_pods"].get(model) == 2

        wait_for(router_sees_both, 60, "the router's /healthz counting both pods", interval=1)
        for i in range(8):
            answer = _complete(url, [3 + i] * 200)
            assert answer["choices"][0]["finish_reason"] == "length", answer
        prompt = sum(_metrics(p.status.pod_ip).get("vllm:prompt_tokens_total", 0)
                     for p in _pods(core, self.NAME))
        assert prompt >= 8 * 200
        for p in _pods(core, self.NAME):
            assert _metrics(p.status.pod_ip).get("spillway_emulator_kv_mismatch_total",
                                                 0) == 0
        operators = core.list_namespaced_pod(
            RELEASE_NAMESPACE, label_selector="app.kubernetes.io/name=spillway").items
        assert len(operators) == 2 and all(
            cs.ready and cs.container_id.startswith("containerd://")
            for p in operators for cs in p.status.container_statuses)

    def test_the_kubelet_runs_the_prestop_drain_and_no_stream_is_cut(
            self, real_cluster, api, deployment):
        """A replica deleted with streams in flight: the kubelet runs the preStop hook
        (spillway-engine drain) and waits for it, so every stream gets all its tokens
        and its last chunk; the Deployment replaces the pod."""
        core = deployment
        victim = _pods(core, self.NAME)[0]
        results = _streams_through_a_deletion(core, victim)
        assert all(r["done"] and r["finish"] == "length" and r["tokens"] == 400
                   for r in results), results
        wait_for(lambda: len([p for p in _pods(core, self.NAME)
                              if p.status.container_statuses
                              and p.status.container_statuses[0].ready]) == 2,
                 START_S, "the replacement Ready", interval=2)

    def test_without_the_prestop_hook_streams_are_cut(self, real_cluster, api, deployment):
        """The broken variant of the test above, so it is known to catch a missing hook:
        the same pod template without its preStop hook (a plain pod, outside the
        Deployment); deleted with streams in flight, vLLM's SIGTERM aborts them."""
        core = deployment
        apps = client.AppsV1Api(api)
        template = apps.read_namespaced_deployment(self.NAME, SERVING).spec.template
        body = api.sanitize_for_serialization(template)
        body["metadata"] = {"name": "no-prestop", "labels": {"app": "no-prestop"}}
        del body["spec"]["containers"][0]["lifecycle"]
        core.create_namespaced_pod(SERVING, {"apiVersion": "v1", "kind": "Pod", **body})

        def ready():
            p = core.read_namespaced_pod("no-prestop", SERVING)
            cs = p.status.container_statuses or []
            return p if cs and cs[0].ready else None

        pod = wait_for(ready, START_S, "the pod without preStop Ready", interval=2)
        results = _streams_through_a_deletion(core, pod)
        cut = [r for r in results if not (r["done"] and r["finish"] == "length")]
        assert cut, f"every stream finished without the preStop drain: {results}"


    def test_a_restarted_container_frees_what_the_earlier_engine_left_in_dev_shm(
            self, real_cluster, api, deployment):
        """The pod's /dev/shm is a memory-backed emptyDir: it outlives a container
        restart, and what an earlier engine left there still holds memory. After a
        restart the launcher frees vLLM's leftovers (a 32 MiB MessageQueue-style
        ``psm_`` block planted here), without which the preflight would refuse to start:
        the volume is sized to the plan's shm bytes exactly."""
        core = deployment
        [pod, *_] = [p for p in _pods(core, self.NAME)
                     if p.status.container_statuses and p.status.container_statuses[0].ready]
        name = pod.metadata.name
        _exec(real_cluster, name, "head -c 33554432 /dev/zero > /dev/shm/psm_5p1llwa7")
        restarts = pod.status.container_statuses[0].restart_count
        killed = _kill_container(pod)  # a crash: the kubelet restarts it in the same pod
        assert killed, f"no process of {name}'s engine container found in its cgroup"

        def back():
            p = core.read_namespaced_pod(name, SERVING)
            cs = p.status.container_statuses[0]
            return p if cs.restart_count > restarts and cs.ready else None

        wait_for(back, START_S, f"{name} restarted and Ready", interval=2)
        log = core.read_namespaced_pod_log(name, SERVING, container="engine")
        assert "freed leftover /dev/shm/psm_5p1llwa7: 33554432 bytes" in log, log[-3000:]
        assert "psm_5p1llwa7" not in _exec(real_cluster, name, "ls /dev/shm")

    def test_evictions_honour_the_pod_disruption_budget(self, real_cluster, api, deployment):
        """A node drain goes through the Eviction API, which the operator's
        PodDisruptionBudget (one engine pod at a time) holds: with one replica already
        evicted and its replacement not Ready, draining a node that runs the other is
        refused; once the replacement serves, the drain completes and no replica is
        left on the drained node.

        The node is cordoned before the first eviction, so the replacement cannot land
        on it: the replicas' spread is ScheduleAnyway (``disruption.topology_spread``),
        and after the earlier tests replaced pods both may run on one node."""
        core = deployment

        def ready() -> list:
            return [p for p in _pods(core, self.NAME)
                    if p.status.container_statuses and p.status.container_statuses[0].ready]

        pods = ready()
        assert len(pods) == 2
        second, first = sorted(pods, key=lambda p: p.spec.node_name)
        node = second.spec.node_name
        kubectl = [str(real_cluster.config.binaries["kubectl"]),
                   f"--kubeconfig={real_cluster.config.kubeconfig}"]
        drain = ["drain", node, "--ignore-daemonsets", "--delete-emptydir-data",
                 f"--pod-selector=spillway.dev/inference-deployment={self.NAME}"]
        try:
            real_cluster.kubectl("cordon", node)
            core.create_namespaced_pod_eviction(
                first.metadata.name, SERVING, client.V1Eviction(metadata=client.V1ObjectMeta(
                    name=first.metadata.name, namespace=SERVING)))
            refused = subprocess.run([*kubectl, *drain, "--timeout=20s"], capture_output=True,
                                     text=True, timeout=120, check=False)
            assert refused.returncode != 0, refused.stdout
            assert "disruption budget" in refused.stderr + refused.stdout, refused.stderr
            assert any(p.metadata.name == second.metadata.name for p in ready()), (
                "the drain evicted the replica the budget protects")
            wait_for(lambda: len(ready()) == 2, START_S,
                     "the evicted replica's replacement Ready", interval=2)
            real_cluster.kubectl(*drain, "--timeout=50s")
            wait_for(lambda: len(ready()) == 2, START_S, "both replicas Ready after the drain",
                     interval=2)
            assert node not in {p.spec.node_name for p in _pods(core, self.NAME)}
        finally:
            real_cluster.kubectl("uncordon", node, check=False)

    def test_a_wrong_plan_ends_in_engine_start_failed_from_the_kubelets_message(
            self, real_cluster, api, deployment):
        """The plan ConfigMap edited to a host pool twice the one the engine runs (with the
        operator stopped, so it does not repair it at once): the replacement pod's plan
        check refuses, the engine writes why to its termination log, the kubelet copies
        it into the pod status, and the operator, back, reports Degraded=EngineStartFailed
        quoting it."""
        core = deployment
        operator = ["-n", RELEASE_NAMESPACE, "deployment/spillway"]
        cm = core.read_namespaced_config_map(f"{self.NAME}-plan", SERVING)
        plan = json.loads(cm.data["plan.json"])
        real_cluster.kubectl("scale", *operator, "--replicas=0")
        try:
            wait_for(lambda: not core.list_namespaced_pod(
                RELEASE_NAMESPACE, label_selector="app.kubernetes.io/name=spillway").items,
                120, "the operator stopped", interval=1)
            stale = json.loads(json.dumps(plan))
            stale["kv_transfer_config"]["kv_connector_extra_config"]["cpu_bytes_to_use"] *= 2
            core.patch_namespaced_config_map(f"{self.NAME}-plan", SERVING,
                                             {"data": {"plan.json": json.dumps(stale)}})
            victim = _pods(core, self.NAME)[0].metadata.name
            core.delete_namespaced_pod(victim, SERVING, grace_period_seconds=0)

            def refused():
                for p in _pods(core, self.NAME):
                    cs = (p.status.container_statuses or [None])[0]
                    last = cs and (cs.last_state.terminated or cs.state.terminated)
                    if last and last.exit_code and last.message:
                        return last
                return None

            last = wait_for(refused, START_S, "an engine refusing the stale plan", interval=2)
            assert last.message.startswith("Spillway plan check FAILED"), last.message
        finally:
            real_cluster.kubectl("scale", *operator, "--replicas=2")

        def degraded():
            cond = _condition(_obj(api, self.NAME), "Degraded")
            return cond if cond and cond["reason"] == "EngineStartFailed" else None

        cond = wait_for(degraded, 120, "Degraded=EngineStartFailed", interval=0.5)
        assert "Spillway plan check FAILED" in cond["message"]


def test_an_engine_beyond_its_memory_limit_is_oom_killed_and_the_deployment_says_so(
        real_cluster, api, installed):
    """An emulated GPU whose KV cache (CPU memory in this container) is larger than the
    pod's planned memory limit: the real memory cgroup kills the engine, the kubelet
    reports OOMKilled, and the operator turns it into Degraded=EngineOOMKilled naming the
    limit. (A host process has no cgroup: nothing would stop it.)"""
    obj = on_real_nodes(SAMPLE, installed["engine"], "models")
    obj["metadata"]["name"] = "too-big"
    obj["spec"]["replicas"] = 1
    obj["spec"]["autoscaling"] = {"enabled": False}
    obj["spec"]["engine"]["emulateGPU"] = {"requestGPUs": True, "speed": 0,
                                           "kvBytes": 16 << 30}
    _apply(real_cluster, obj)
    try:
        def oom():
            cond = _condition(_obj(api, "too-big"), "Degraded")
            return cond if cond and cond["reason"] == "EngineOOMKilled" else None

        cond = wait_for(oom, START_S, "Degraded=EngineOOMKilled", interval=2,
                        on_timeout=lambda: (_obj(api, "too-big").get("status"),
                                            real_cluster.kubectl("get", "pods", "-n", SERVING,
                                                                 "-o", "wide", check=False)))
        limit = _obj(api, "too-big")["status"]["plan"]["memoryLimitBytes"]
        assert cond["status"] == "True"
        assert "killed at its memory limit" in cond["message"]
        [pod] = _pods(client.CoreV1Api(api), "too-big")
        last = pod.status.container_statuses[0].last_state.terminated or \
            pod.status.container_statuses[0].state.terminated
        # The kernel kills the biggest process of the container's cgroup (vLLM's engine
        # core); the API server then exits on its own, so the code is not always 137.
        assert last.reason == "OOMKilled" and last.exit_code != 0
        assert limit < (16 << 30)
    finally:
        real_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", "too-big",
                             "--wait=true", "--timeout=120s", check=False)



def test_an_engine_image_no_node_holds_ends_in_pods_failing(real_cluster, api, installed):
    """An engine image the nodes do not hold and cannot pull (no registry here): the real
    kubelet's pull fails and backs off, and the operator reports Degraded=PodsFailing
    with the kubelet's reason, not silence."""
    obj = on_real_nodes(SAMPLE, "spillway-engine:never-built", "models")
    obj["metadata"]["name"] = "no-image"
    obj["spec"]["replicas"] = 1
    obj["spec"]["autoscaling"] = {"enabled": False}
    _apply(real_cluster, obj)
    try:
        def failing():
            cond = _condition(_obj(api, "no-image"), "Degraded")
            return cond if cond and cond["reason"] == "PodsFailing" else None

        cond = wait_for(failing, 300, "Degraded=PodsFailing", interval=2,
                        on_timeout=lambda: _obj(api, "no-image").get("status"))
        assert cond["status"] == "True" and "ImagePullBackOff" in cond["message"], cond
        [pod] = _pods(client.CoreV1Api(api), "no-image")
        waiting = pod.status.container_statuses[0].state.waiting
        assert waiting and waiting.reason in ("ErrImagePull", "ImagePullBackOff"), waiting
    finally:
        real_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", "no-image",
                             "--wait=true", "--timeout=120s", check=False)


def test_two_replicas_on_two_nodes_share_a_disk_tier_that_outlives_a_restart(
        real_cluster, api, installed):
    """offload.disk on a ReadWriteMany claim (a hostPath volume both nodes' pods mount),
    two replicas: real containers (user 1000) write chunk files into it, a prefix one
    replica computed loads from disk on the other, and after the first one's container
    is killed its restarted engine finds the chunks again -- from disk, not recomputed."""
    folder = MODELS.parent / "spillway-kv-shared"
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's chunks would be adopted
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    pv = f"{SERVING}-kv-shared"
    real_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                  "hostPath": {"path": str(folder), "type": "Directory"},
                  "claimRef": {"namespace": SERVING, "name": "kv-shared"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": "kv-shared", "namespace": SERVING},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]))
    name = "tiny-disk"
    obj = on_real_nodes(SAMPLE, installed["engine"], "models")
    obj["metadata"]["name"] = name
    obj["spec"]["replicas"] = 2
    obj["spec"]["autoscaling"] = {"enabled": False}
    obj["spec"]["engine"]["emulateGPU"]["speed"] = 0
    obj["spec"]["offload"] = {"hostMemory": "1Mi", "disk": {
        "size": "512Mi", "volume": "SharedPVC", "claimName": "kv-shared"}}
    _apply(real_cluster, obj)
    core = client.CoreV1Api(api)
    try:
        def ready_pods():
            pods = [p for p in _pods(core, name) if p.status.container_statuses
                    and p.status.container_statuses[0].ready]
            return pods if len(pods) == 2 else None

        a, b = wait_for(ready_pods, START_S, "two engine pods Ready", interval=2,
                        on_timeout=lambda: _obj(api, name).get("status"))
        plan = _obj(api, name)["status"]["plan"]
        assert plan["diskCapacityTokens"] > 0
        out = _exec(real_cluster, a.metadata.name, "id -u; ls -d /var/cache/spillway/kv/*")
        assert out.split("\n")[0] == "1000"
        prompt = [5 + i % 400 for i in range(700)]
        first = _complete(f"http://{a.status.pod_ip}:{ENGINE_PORT}", prompt, max_tokens=4)
        wait_for(lambda: _metrics(a.status.pod_ip).get("spillway_disk_tier_chunks", 0) >= 2,
                 60, "the first replica's chunks on disk", interval=1)
        files = [p for p in folder.rglob("*.kv")]
        assert files and all(p.stat().st_uid == 1000 for p in files)

        before = _metrics(b.status.pod_ip)
        again = _complete(f"http://{b.status.pod_ip}:{ENGINE_PORT}", prompt, max_tokens=4)
        after = _metrics(b.status.pod_ip)
        assert after["spillway_disk_tier_shared_hits_total"] > \
            before.get("spillway_disk_tier_shared_hits_total", 0)
        assert after["vllm:external_prefix_cache_hits_total"] - \
            before.get("vllm:external_prefix_cache_hits_total", 0) >= 256
        assert again["choices"][0]["text"] == first["choices"][0]["text"]

        restarts = a.status.container_statuses[0].restart_count
        _kill_container(a)

        def restarted():
            p = core.read_namespaced_pod(a.metadata.name, SERVING)
            cs = p.status.container_statuses[0]
            return p if cs.restart_count > restarts and cs.ready else None

        a = wait_for(restarted, START_S, "the killed engine back and Ready", interval=2)
        # a new engine: its counters start at 0 (and appear with its first step)
        third = _complete(f"http://{a.status.pod_ip}:{ENGINE_PORT}", prompt, max_tokens=4)
        after = _metrics(a.status.pod_ip)
        assert after["spillway_disk_tier_chunks"] >= 2  # adopted at start from the folder
        assert after["spillway_disk_tier_loads_total"] > 0  # the prefix came from disk
        assert after["vllm:external_prefix_cache_hits_total"] >= 256
        assert third["choices"][0]["text"] == first["choices"][0]["text"]
        for p in (a, b):
            assert _metrics(p.status.pod_ip).get("spillway_emulator_kv_mismatch_total", 0) == 0
    finally:
        real_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", name,
                             "--wait=true", "--timeout=120s", check=False)
        real_cluster.kubectl("delete", "-n", SERVING, "pvc", "kv-shared", "--wait=false",
                             check=False)
        real_cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


@contextlib.contextmanager
def _node_as(real_cluster, core: client.CoreV1Api, node: str, product: str):
    """The node labelled by GPU Feature Discovery as ``product`` (the kubelet sets its
    labels only when it registers), its own labels back afterwards."""
    before = core.read_node(node).metadata.labels
    gfd = gfd_labels(product, real_cluster.config.gpus_per_node)
    real_cluster.kubectl("label", "node", node, "--overwrite",
                         *[f"{k}={v}" for k, v in gfd.items()])
    try:
        yield gfd
    finally:
        real_cluster.kubectl("label", "node", node, "--overwrite",
                             *[f"{k}={before[k]}" for k in gfd if k in before])


def test_one_object_serves_on_an_h100_pool_and_a_b200_pool_each_with_its_own_plan(
        real_cluster, api, installed):
    """spec.resources.gpuPools on real nodes: node a stays an H100 node, node b becomes
    a B200 node (GFD's labels); one object gets a workload per pool, each pod a container
    of the engine image on its pool's node, planned for that GPU (Blackwell: FlashInfer
    for the full-attention layers) and started with the plan check passed on the GPU its
    plan is for; the chart's router serves the model from both pools."""
    core = client.CoreV1Api(api)
    name = "tiny-pools"
    obj = on_real_nodes(SAMPLE, installed["engine"], "models")
    obj["metadata"]["name"] = name
    obj["spec"]["replicas"] = 2
    obj["spec"]["autoscaling"] = {"enabled": False}
    obj["spec"]["engine"]["emulateGPU"]["speed"] = 0
    obj["spec"]["resources"]["gpuPools"] = [{"name": "hopper", "gpuProduct": "H100"},
                                            {"name": "blackwell", "gpuProduct": "B200"}]
    with _node_as(real_cluster, core, "spillway-node-b", "b200"):
        _apply(real_cluster, obj)
        try:
            def both_ready():
                status = _obj(api, name).get("status") or {}
                pools = status.get("pools") or []
                return status if len(pools) == 2 and all(
                    p["readyReplicas"] == 1 for p in pools) else None

            status = wait_for(both_ready, START_S, "a Ready engine in each pool", interval=2,
                              on_timeout=lambda: (_obj(api, name).get("status"),
                                                  real_cluster.kubectl(
                                                      "get", "pods", "-n", SERVING, "-o",
                                                      "wide", check=False)))
            pools = {p["name"]: p for p in status["pools"]}
            assert {n: p["plan"]["gpu"] for n, p in pools.items()} == {
                "hopper": "h100", "blackwell": "b200"}
            assert pools["hopper"]["plan"]["hash"] != pools["blackwell"]["plan"]["hash"]
            for pool, gpu, node in (("hopper", "h100", "spillway-node-a"),
                                    ("blackwell", "b200", "spillway-node-b")):
                plan = json.loads(core.read_namespaced_config_map(
                    f"{name}-{pool}-plan", SERVING).data["plan.json"])
                assert plan["gpu"]["name"] == gpu
                [p] = [p for p in _pods(core, name)
                       if p.metadata.labels.get("spillway.dev/gpu-pool") == pool]
                assert p.spec.node_name == node, (pool, p.spec.node_name)
                assert p.status.container_statuses[0].container_id.startswith("containerd://")
                assert p.metadata.annotations["spillway.dev/plan-hash"] == \
                    pools[pool]["plan"]["hash"]
                log = core.read_namespaced_pod_log(p.metadata.name, SERVING,
                                                   container="engine")
                assert "Spillway plan check passed" in log, log[-2000:]
                assert f"Emulated GPU {gpu}:" in log, log[-2000:]
                answer = _complete(f"http://{p.status.pod_ip}:{ENGINE_PORT}", [7] * 300)
                assert answer["choices"][0]["finish_reason"] == "length"
                assert _metrics(p.status.pod_ip).get("spillway_emulator_kv_mismatch_total",
                                                     0) == 0
                print(f"{pool}: {gpu} on {node}, backend {plan['gpu']['attention_backend']},"
                      f" block {plan['block_size']}, {plan['num_chunks']} chunks, pod memory "
                      f"{plan['pod']['memory_limit_bytes']} B")
            [svc] = core.list_service_for_all_namespaces(
                label_selector="app.kubernetes.io/name=spillway-router").items
            url = f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}"
            model = SAMPLE["spec"]["model"]["name"]

            def router_sees_both() -> bool:
                with urllib.request.urlopen(f"{url}/healthz", timeout=10) as r:
                    return json.loads(r.read())["ready_pods"].get(model) == 2

            wait_for(router_sees_both, 60, "the router counting both pools' pods", interval=1)
            for i in range(6):
                assert _complete(url, [11 + i] * 200)["choices"][0]["finish_reason"] == "length"
        finally:
            real_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", name,
                                 "--wait=true", "--timeout=120s", check=False)


def _model_on_a_volume(cluster, model: str, config: dict[str, Any],
                       models: Path = MODELS) -> str:
    """tiny/``model``'s folder under ``models`` (a folder every node sees at that path),
    a volume and claim over it, and its config in ``<model>-config``; the claim's name."""
    model_dir = write_model(models / f"tiny-{model}", config)
    model_volume(cluster, SERVING, f"models-{model}", model_dir)
    model_config_map(cluster, SERVING, f"{model}-config", config)
    return f"models-{model}"


def _two_node_group(real_cluster, installed, name: str, model: str,
                    config: dict[str, Any], models: Path = MODELS) -> dict[str, Any]:
    """One replica of tiny/``model`` whose engines span both nodes (``engine.nodes`` 2,
    one rank per node by a required anti-affinity, as 8-GPU ranks on 8-GPU nodes would
    be), its folder on a volume and its config in a ConfigMap; no autoscaling. The
    caller adds the parallelism and the emulated GPU."""
    claim = _model_on_a_volume(real_cluster, model, config, models)
    obj = on_real_nodes(SAMPLE, installed["engine"], claim)
    obj["metadata"]["name"] = name
    spec = obj["spec"]
    spec["model"] = {"name": f"tiny/{model}", "configMapRef": {"name": f"{model}-config"}}
    spec["replicas"] = 1
    spec["autoscaling"] = {"enabled": False}
    spec["engine"] |= {"tensorParallelSize": 1, "nodes": 2}
    spec["resources"]["affinity"] = {"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"spillway.dev/inference-deployment": name}}}]}}
    return obj


def _pipeline_group(cluster, installed, name: str, models: Path = MODELS) -> dict[str, Any]:
    """A PP 2 replica of a 4-layer tiny Llama as one group across two nodes; each stage
    holds 2 of the 4 layers: 4096 bytes a block, 80 blocks per emulated GPU."""
    obj = _two_node_group(cluster, installed, name, "llama", llama_config(num_layers=4),
                          models)
    obj["spec"]["engine"]["pipelineParallelSize"] = 2
    obj["spec"]["engine"]["emulateGPU"] |= {"speed": 0, "kvBytes": 80 * 4096}
    return obj


def _both_stages_serve_from_host(leader: client.V1Pod, model: str) -> float:
    """A prompt pushed out of both stages' GPU caches (5 x 600 tokens after it) comes
    back from both host pools: the same completion, 0 KV mismatches; the host-hit
    tokens."""
    url = f"http://{leader.status.pod_ip}:{ENGINE_PORT}"
    prompt = [10 + i % 300 for i in range(600)]
    first = _complete(url, prompt, model=model)
    for seed in range(11, 16):
        _complete(url, [seed + i % 300 for i in range(600)], max_tokens=2, model=model)
    before = _metrics(leader.status.pod_ip)
    again = _complete(url, prompt, model=model)
    after = _metrics(leader.status.pod_ip)
    hits = after["spillway_host_hit_tokens_total"] - before.get(
        "spillway_host_hit_tokens_total", 0)
    assert hits >= 512, (before, after)
    per_token = 2 * 4096 // 16  # both stages' layers
    assert after["vllm:kv_offload_load_bytes_total"] - before.get(
        "vllm:kv_offload_load_bytes_total", 0) >= 512 * per_token
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert after.get("spillway_emulator_kv_mismatch_total", 0) == 0
    return hits


def _group_serving(api, name: str, old_uids: set[str] = frozenset()
                   ) -> dict[str, client.V1Pod] | None:  # fmt: skip
    """The group's pods by worker index once both are Ready (none of ``old_uids``) and
    the object is Available; None before."""
    pods = {p.metadata.labels.get("leaderworkerset.sigs.k8s.io/worker-index"): p
            for p in _pods(client.CoreV1Api(api), name)}
    cond = _condition(_obj(api, name), "Available")
    whole = len(pods) == 2 and all(
        p.metadata.uid not in old_uids and p.status.container_statuses
        and p.status.container_statuses[0].ready for p in pods.values())
    return pods if whole and cond and cond["status"] == "True" else None


def _group_state(real_cluster, api, name: str) -> tuple[Any, str]:
    """What a timed-out wait shows: the object's status and the serving pods."""
    return (_obj(api, name).get("status"),
            real_cluster.kubectl("get", "pods", "-n", SERVING, "-o", "wide", check=False))


def test_a_pipeline_parallel_replica_runs_as_a_leader_worker_set_group_on_both_nodes(
        real_cluster, api, installed):
    """engine.nodes 2 on real nodes: one LeaderWorkerSet group of two engine-image
    containers, one pipeline stage on each node, meeting through gloo over the pod
    network at the leader's DNS name (LWS_LEADER_ADDRESS, resolved by the cluster's DNS).
    Every rank checks its own stage; a prompt pushed out of both stages' GPU caches comes
    back from both host pools with 0 KV mismatches; SIGKILL of the worker's container
    makes LWS recreate the group and the object says Degraded=GroupRestarting until the
    group serves again."""
    core = client.CoreV1Api(api)
    name = "tiny-group"
    obj = _pipeline_group(real_cluster, installed, name)
    t0 = time.monotonic()
    _apply(real_cluster, obj)

    def state():
        return _group_state(real_cluster, api, name)

    try:
        pods = wait_for(lambda: _group_serving(api, name), START_S,
                        "the group's two ranks Ready and Available", interval=2,
                        on_timeout=state)
        print(f"PP 2 group on real containers: Available {time.monotonic() - t0:.0f}s "
              "after apply")
        leader, worker = pods["0"], pods["1"]
        assert {leader.spec.node_name, worker.spec.node_name} == {
            "spillway-node-a", "spillway-node-b"}
        logs = {r: core.read_namespaced_pod_log(p.metadata.name, SERVING, container="engine")
                for r, p in pods.items()}
        for stage in (0, 1):
            assert f"Spillway plan check passed (pipeline stage {stage})" in logs["0"]
        assert "plan check passed on worker rank 0 (pipeline stage 0)" in logs["0"]
        assert "plan check passed on worker rank 1 (pipeline stage 1)" in logs["1"]
        assert "FAILED" not in logs["0"] + logs["1"]
        model = obj["spec"]["model"]["name"]
        hits = _both_stages_serve_from_host(leader, model)
        print(f"PP 2 group: {hits:.0f} prompt tokens from the host pools of both stages")

        old = {p.metadata.uid for p in pods.values()}
        _kill_container(worker)
        cond = wait_for(lambda: (c := _condition(_obj(api, name), "Degraded")) and c[
            "reason"] == "GroupRestarting" and c, 120, "Degraded=GroupRestarting",
            interval=0.5, on_timeout=state)
        assert cond["status"] == "True", cond
        t1 = time.monotonic()
        pods = wait_for(lambda: _group_serving(api, name, old), START_S,
                        "the recreated group serving", interval=2, on_timeout=state)
        print(f"PP 2 group recreated by LWS and serving {time.monotonic() - t1:.0f}s "
              "after Degraded=GroupRestarting")
        wait_for(lambda: _condition(_obj(api, name), "Degraded")["reason"] == "AsExpected",
                 60, "Degraded cleared", on_timeout=state)
        url = f"http://{pods['0'].status.pod_ip}:{ENGINE_PORT}"
        assert _complete(url, [3] * 40, model=model)["usage"]["completion_tokens"] == 8
    finally:
        real_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", name,
                             "--wait=true", "--timeout=120s", check=False)


def test_a_data_parallel_expert_parallel_replica_serves_across_both_nodes(
        real_cluster, api, installed):
    """dataParallelSize 2 over engine.nodes 2 with --enable-expert-parallel on real
    nodes: one LeaderWorkerSet group of two engine-image containers, one whole engine on
    each node (vLLM's DP coordinator on the leader, the worker headless), the experts of
    a tiny DeepSeek-style MoE split over both. Each rank checks its plan; both ranks
    serve, pinned with vLLM's X-data-parallel-rank header; the chart's router, which asks
    only the leader, indexes what the worker's rank caches (its publisher on the worker
    pod's IP, listed at the leader's /kv_event_sources); and a prompt pushed out of the
    worker rank's GPU comes back from its host pool with 0 KV mismatches."""
    core = client.CoreV1Api(api)
    name = "tiny-dp"
    obj = _two_node_group(real_cluster, installed, name, "deepseek",
                          deepseek_v2_config(num_layers=3))  # the third layer is a MoE layer
    spec = obj["spec"]
    spec["engine"] |= {"dataParallelSize": 2, "extraArgs": ["--enable-expert-parallel"]}
    # 80 blocks of 55,296 bytes (3 MLA layers x 576 x 2 bytes x 16 tokens) per engine,
    # and a host pool per engine that keeps a prompt the next 3,000 tokens push out of
    # the GPU (the sample's 4 MiB holds about four 256-token chunks of this model)
    spec["engine"]["emulateGPU"] |= {"speed": 0, "kvBytes": 80 * 55296}
    spec["offload"]["hostMemory"] = "32Mi"
    t0 = time.monotonic()
    _apply(real_cluster, obj)

    def state():
        return _group_state(real_cluster, api, name)

    try:
        pods = wait_for(lambda: _group_serving(api, name), START_S,
                        "the DP group's two pods Ready and Available", interval=2,
                        on_timeout=state)
        print(f"DP 2 x EP group on real containers: Available {time.monotonic() - t0:.0f}s "
              "after apply")
        leader, worker = pods["0"], pods["1"]
        assert {leader.spec.node_name, worker.spec.node_name} == {
            "spillway-node-a", "spillway-node-b"}
        logs = {r: core.read_namespaced_pod_log(p.metadata.name, SERVING, container="engine")
                for r, p in pods.items()}
        assert "--data-parallel-size 2" in logs["0"] and "--headless" in logs["1"]
        for r in (0, 1):
            log = logs[str(r)]
            assert f"(EngineCore_DP{r}" in log and "Spillway plan check passed" in log
            assert f"(Worker_DP{r}_EP{r}" in log
        assert "FAILED" not in logs["0"] + logs["1"]
        url = f"http://{leader.status.pod_ip}:{ENGINE_PORT}"

        def complete(prompt: list[int], rank: int, max_tokens: int = 8) -> dict[str, Any]:
            body = json.dumps({"model": spec["model"]["name"], "prompt": prompt,
                               "max_tokens": max_tokens, "temperature": 0}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body, {
                "Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())

        def per_engine() -> dict[tuple[str, str], float]:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                text = r.read().decode()
            return {(s.name, s.labels["engine"]): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples
                    if "engine" in s.labels and not s.name.endswith("_created")}

        probe = [7 + i % 300 for i in range(48)]
        assert complete(probe, 0)["choices"][0]["text"] == complete(probe, 1)["choices"][0][
            "text"]

        [svc] = core.list_service_for_all_namespaces(
            label_selector="app.kubernetes.io/name=spillway-router").items
        router = f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}"

        def indexed() -> float:
            with urllib.request.urlopen(f"{router}/metrics", timeout=10) as r:
                text = r.read().decode()
            return sum(s.value for f in text_string_to_metric_families(text)
                       for s in f.samples if s.name == "spillway_router_index_blocks"
                       and s.labels.get("pod") == leader.metadata.name
                       and s.labels.get("source") == "events" and s.labels.get("tier") == "GPU")

        def rank1_indexed() -> bool:  # fresh prompts only rank 1 sees, 20 blocks each
            for seed in (40, 41, 42):
                held = indexed()
                complete([seed + i % 300 for i in range(320)], 1)
                with contextlib.suppress(AssertionError):
                    return wait_for(lambda: indexed() >= held + 19, 15,  # noqa: B023
                                    "the router indexing rank 1's blocks", interval=0.5)
            return False

        assert rank1_indexed(), real_cluster.kubectl(
            "logs", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/name=spillway-router",
            "--tail", "40", check=False)

        a = [10 + i % 300 for i in range(600)]
        first = complete(a, 1)
        for seed in range(11, 16):  # 5 x 600 tokens push a out of rank 1's 80 blocks
            complete([seed + i % 300 for i in range(600)], 1, max_tokens=2)
        before = per_engine()
        again = complete(a, 1)
        after = per_engine()

        def delta(series: str, rank: str) -> float:
            return after.get((series, rank), 0.0) - before.get((series, rank), 0.0)

        assert delta("spillway_host_hit_tokens_total", "1") >= 512, (before, after)
        assert delta("vllm:external_prefix_cache_hits_total", "0") == 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert after[("spillway_emulator_kv_mismatch_total", "1")] == 0
        print(f"DP 2 x EP group: {delta('spillway_host_hit_tokens_total', '1'):.0f} prompt "
              "tokens from the worker rank's host pool")
    finally:
        real_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", name,
                             "--wait=true", "--timeout=120s", check=False)


def test_a_worker_that_cannot_reach_its_leader_ends_in_engine_start_failed(
        real_cluster, api, installed):
    """The rendezvous port refused between the pods (as a NetworkPolicy that leaves it
    out would): the worker rank stops after its wait for the leader (15 minutes) with
    the line naming the address and the port, and the object says so."""
    from e2e.nodes.faults import NodeFaults

    name = "tiny-cut-group"
    obj = _pipeline_group(real_cluster, installed, name)
    faults = NodeFaults(real_cluster.real_nodes())
    faults.block_port(29500)
    t0 = time.monotonic()
    try:
        _apply(real_cluster, obj)

        def stopped():
            for c in _obj(api, name).get("status", {}).get("conditions", []):
                if "cannot reach its leader" in c.get("message", ""):
                    return c
            return None

        cond = wait_for(stopped, 1500, "a condition naming the unreachable leader",
                        interval=5, on_timeout=lambda: _group_state(real_cluster, api, name))
        print(f"after {time.monotonic() - t0:.0f}s: {cond['type']}={cond['status']} "
              f"{cond['reason']}: {cond['message'][:300]}")
        assert cond["reason"] == "EngineStartFailed", cond
        assert ":29500" in cond["message"], cond
    finally:
        faults.heal()
        real_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", name,
                             "--wait=true", "--timeout=120s", check=False)
