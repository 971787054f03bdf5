"""Spillway on kind, end to end: the cluster from a node image built here, the fake GPUs
from the device plugin, the chart from e2e/kind/install.sh, and engine pods that are
containers of the engine image in kind's nodes (containers in containers), serving the
tiny hybrid on the emulated GPU through the chart's router with host hits, and a
pipeline-parallel replica as one LeaderWorkerSet group across both workers."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request

import pytest
from kubernetes import client

from e2e.install import on_real_nodes
from e2e.kind.cluster import GPUS_PER_NODE, KIND_DIR
from spillway_engine.emulator.tiny import qwen3_next_config
from tests.helpers import wait_for
from tests.product.test_product import (
    SAMPLE,
    SERVING,
    _apply,
    _both_stages_serve_from_host,
    _complete,
    _condition,
    _group_serving,
    _group_state,
    _metrics,
    _model_on_a_volume,
    _obj,
    _pipeline_group,
    _pods,
)

START_S = 900  # an engine start in a kind node on 2 cores
pytestmark = pytest.mark.timeout(2400)


def test_the_workers_advertise_fake_gpus_from_the_device_plugin(kind_cluster, core):
    nodes = core.list_node().items
    workers = [n for n in nodes
               if "node-role.kubernetes.io/control-plane" not in n.metadata.labels]
    assert len(workers) == kind_cluster.config.workers and len(nodes) == len(workers) + 1
    for n in nodes:
        assert n.status.node_info.kubelet_version == "v1.35.4", n.status.node_info
        ready = next(c for c in n.status.conditions if c.type == "Ready")
        assert ready.status == "True", (n.metadata.name, ready.message)
    for n in workers:
        assert n.status.allocatable["nvidia.com/gpu"] == str(GPUS_PER_NODE)
        assert n.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    plugin = core.list_namespaced_pod(
        "kube-system", label_selector="app=spillway-fake-gpu-plugin").items
    assert sorted(p.spec.node_name for p in plugin) == sorted(n.metadata.name for n in workers)


def test_a_node_image_that_does_not_start_is_one_line_naming_the_step(kind_cluster):
    """create-cluster.sh with an image that is no kind node (Spillway's Debian base: no
    systemd) stops with one line that names the step."""
    done = subprocess.run(
        [str(KIND_DIR / "create-cluster.sh"), "--name", "spillway-bad-image", "--workers", "0",
         "--image", "spillway-base:bookworm"], capture_output=True, text=True,
        timeout=600, env=kind_cluster._env(), check=False)
    try:
        assert done.returncode != 0
        errors = [line for line in done.stderr.splitlines() if "[kind] error:" in line]
        assert len(errors) == 1, done.stderr[-2000:]
        print(errors[0])
    finally:
        subprocess.run([kind_cluster.kind, "delete", "cluster", "--name", "spillway-bad-image"],
                       capture_output=True, env=kind_cluster._env(), check=False)


def test_the_tiny_hybrid_serves_through_the_router_with_host_hits(kind_cluster, api, core,
                                                                    installed):
    name = "tiny"
    config = qwen3_next_config(num_layers=4)
    obj = on_real_nodes(SAMPLE, installed["engine"], _model_on_a_volume(
        kind_cluster, "qwen3-next", config, kind_cluster.workdir / "models"))
    obj["metadata"]["name"] = name
    obj["spec"]["model"]["configMapRef"]["name"] = "qwen3-next-config"
    obj["spec"]["replicas"] = 1
    obj["spec"]["autoscaling"] = {"enabled": False}
    t0 = time.monotonic()
    _apply(kind_cluster, obj)
    try:
        wait_for(lambda: (c := _condition(_obj(api, name), "Available")) and
                 c["status"] == "True", START_S, "Available=True", interval=2,
                 on_timeout=lambda: _group_state(kind_cluster, api, name))
        [pod] = _pods(core, name)
        print(f"engine pod Ready in a kind node {time.monotonic() - t0:.0f}s after apply")
        assert pod.status.container_statuses[0].container_id.startswith("containerd://")
        log = core.read_namespaced_pod_log(pod.metadata.name, SERVING, container="engine")
        assert "Spillway plan check passed" in log, log[-2000:]
        [svc] = core.list_service_for_all_namespaces(
            label_selector="app.kubernetes.io/name=spillway-router").items
        router = f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}"

        def router_ready() -> bool:
            with urllib.request.urlopen(f"{router}/healthz", timeout=10) as r:
                return json.loads(r.read())["ready_pods"].get(SAMPLE["spec"]["model"]["name"]) == 1

        wait_for(router_ready, 120, "the chart's router counting the pod", interval=1)
        prompt = [10 + i % 300 for i in range(768)]
        first = _complete(router, prompt)
        # 14 more prompts of 12 blocks (64 tokens each) push it out of the emulated
        # GPU's 128 blocks
        for seed in range(11, 25):
            _complete(router, [seed + i % 300 for i in range(768)], max_tokens=2)
        before = _metrics(pod.status.pod_ip)
        again = _complete(router, prompt)
        after = _metrics(pod.status.pod_ip)
        hits = after["spillway_host_hit_tokens_total"] - before.get(
            "spillway_host_hit_tokens_total", 0)
        assert hits >= 512, (before, after)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert after.get("spillway_emulator_kv_mismatch_total", 0) == 0
        print(f"kind: {hits:.0f} prompt tokens from the host pool through the router")
    finally:
        kind_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", name,
                             "--wait=true", "--timeout=120s", check=False)


def test_a_pipeline_parallel_replica_runs_as_a_group_on_both_workers(kind_cluster, api, core,
                                                                      installed):
    name = "tiny-group"
    obj = _pipeline_group(kind_cluster, installed, name, kind_cluster.workdir / "models")
    t0 = time.monotonic()
    _apply(kind_cluster, obj)
    try:
        pods = wait_for(lambda: _group_serving(api, name), START_S,
                        "the group's two ranks Ready and Available", interval=2,
                        on_timeout=lambda: _group_state(kind_cluster, api, name))
        print(f"PP 2 group on kind: Available {time.monotonic() - t0:.0f}s after apply")
        leader, worker = pods["0"], pods["1"]
        assert leader.spec.node_name != worker.spec.node_name
        logs = {r: core.read_namespaced_pod_log(p.metadata.name, SERVING, container="engine")
                for r, p in pods.items()}
        assert "plan check passed on worker rank 0 (pipeline stage 0)" in logs["0"]
        assert "plan check passed on worker rank 1 (pipeline stage 1)" in logs["1"]
        hits = _both_stages_serve_from_host(leader, obj["spec"]["model"]["name"])
        print(f"kind PP 2 group: {hits:.0f} prompt tokens from both stages' host pools")
    finally:
        kind_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", name,
                             "--wait=true", "--timeout=120s", check=False)


def test_the_operator_runs_in_kind_with_the_charts_service_account(kind_cluster, core,
                                                                     installed):
    pods = core.list_namespaced_pod(
        "spillway-system", label_selector="app.kubernetes.io/name=spillway").items
    assert pods and all(p.spec.service_account_name == "spillway" for p in pods), [
        p.spec.service_account_name for p in pods]
    assert all(p.status.phase == "Running" for p in pods)


def test_a_drain_moves_two_groups_one_at_a_time_under_the_disruption_budget(
        kind_cluster, api, core, installed):
    """Two PP 2 groups over three workers (a group's ranks on two nodes, by a required
    anti-affinity per group): draining a node that holds a rank of each evicts one
    group's rank, LWS recreates that group elsewhere, and the operator's
    PodDisruptionBudget refuses the other group's eviction until the first serves again,
    so one group serves all through the drain; then the second moves too."""
    name = "tiny-groups"
    obj = _pipeline_group(kind_cluster, installed, name, kind_cluster.workdir / "models")
    obj["spec"]["replicas"] = 2
    # one rank per node within a group, not across the groups
    [term] = obj["spec"]["resources"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    term["matchLabelKeys"] = ["leaderworkerset.sigs.k8s.io/group-key"]
    _apply(kind_cluster, obj)

    def groups() -> dict[str, list]:
        out: dict[str, list] = {}
        for p in _pods(core, name):
            out.setdefault(p.metadata.labels["leaderworkerset.sigs.k8s.io/group-index"],
                           []).append(p)
        return out

    def serving_groups() -> int:
        return sum(len(ps) == 2 and all(p.status.container_statuses and
                                        p.status.container_statuses[0].ready for p in ps)
                   for ps in groups().values())

    node = None
    try:
        wait_for(lambda: serving_groups() == 2, START_S, "both groups serving", interval=2,
                 on_timeout=lambda: _group_state(kind_cluster, api, name))
        pdb = client.PolicyV1Api(api).read_namespaced_pod_disruption_budget(name, SERVING)
        assert pdb.spec.max_unavailable == 1, pdb.spec
        by_node: dict[str, set[str]] = {}
        for g, ps in groups().items():
            for p in ps:
                by_node.setdefault(p.spec.node_name, set()).add(g)
        node = next(n for n, gs in by_node.items() if len(gs) == 2)  # pigeonhole: 4 on 3
        low = [2]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                low[0] = min(low[0], serving_groups())
                time.sleep(1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        drained = subprocess.run(
            [str(kind_cluster.config.binaries["kubectl"]),
             f"--kubeconfig={kind_cluster.config.kubeconfig}", "drain", node,
             "--ignore-daemonsets", "--delete-emptydir-data",
             f"--pod-selector=spillway.dev/inference-deployment={name}",
             f"--timeout={2 * START_S}s"], capture_output=True, text=True,
            timeout=2 * START_S + 60, check=False)
        drain_s = time.monotonic() - t0
        wait_for(lambda: serving_groups() == 2, START_S, "both groups serving after the drain",
                 interval=2, on_timeout=lambda: _group_state(kind_cluster, api, name))
        stop.set()
        watcher.join(5)
        out = drained.stdout + drained.stderr
        assert drained.returncode == 0, out[-3000:]
        assert "violate the pod's disruption budget" in out, out[-3000:]
        assert low[0] >= 1, "both groups were down at once during the drain"
        assert node not in {p.spec.node_name for p in _pods(core, name)}
        print(f"drain of {node}: {drain_s:.0f}s, the budget refused the second group's "
              f"eviction until the first served again; groups serving never below {low[0]}")
    finally:
        if node:
            kind_cluster.kubectl("uncordon", node, check=False)
        kind_cluster.kubectl("delete", "-n", SERVING, "inferencedeployment", name,
                             "--wait=true", "--timeout=120s", check=False)

