"""A scale-down takes the pod with the least hot host cache, on the local control plane:
engine simulators on the pods' loopback IPs, the operator's autoscaler marking the pod
that should go (a low pod-deletion-cost, spillway.dev/draining) before it writes the
scale, and the real kube-controller-manager's ReplicaSet controller choosing whom to
delete."""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import urllib.request
from collections import Counter
from datetime import UTC, datetime

import pytest
import urllib3
from kubernetes import client, watch

from e2e.cluster.controlplane import REPO_ROOT
from e2e.simfleet import SimulatorFleet
from spillway_engine.planner.model_config import load_local
from spillway_operator.flow.pressure import DELETION_COST, DRAINING, parse_metrics
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import wait_for

pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.local_only]

INTERVAL = 2
WINDOW = 6
# A small GPU KV (4,096 tokens): eight 1,024-token prompts sent twice are served from
# the host tier the second time.
SIM_ARGS = ["--max-num-seqs", "4", "--gpu-kv-tokens", "4096", "--speed", "1"]
LABEL = f"{GROUP}/inference-deployment"


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def warm_host_tier(url: str, seed: int) -> float:
    """Give one engine a hot host tier; returns its host-hit tokens."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    for _ in range(2):
        for i in range(8):
            prompt = [100 + seed * 20000 + i * 1500 + j for j in range(1024)]
            _post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode(), 0.0).values.get("host_hit_tokens", 0.0)


def _ready_time(pod: client.V1Pod) -> datetime:
    return next(c.last_transition_time for c in pod.status.conditions or []
                if c.type == "Ready" and c.status == "True")


def controller_order(pods: list[client.V1Pod], now: datetime) -> list[str]:
    """The order in which the ReplicaSet controller deletes these ready, running pods
    when none has a deletion cost (kube-controller-manager's ActivePodsWithRanks with
    LogarithmicScaleDown): more pods of the set on its node first, then ready for less
    time by log2 buckets of nanoseconds, then the smaller UID."""
    per_node = Counter(p.spec.node_name for p in pods)

    def bucket(t: datetime) -> int:
        d = (now - t).total_seconds() * 1e9
        return int(math.log2(d)) if d > 0 else -1

    order = sorted(pods, key=lambda p: (-per_node[p.spec.node_name], bucket(_ready_time(p)),
                                        p.metadata.uid))
    return [p.metadata.name for p in order]


class PodLog:
    """Every pod event of a namespace in a thread: annotations seen, deletions."""

    def __init__(self, core: client.CoreV1Api, ns: str) -> None:
        self.core, self.ns = core, ns
        self.annotations: dict[str, list[dict[str, str]]] = {}
        self.deleted_at: dict[str, datetime] = {}
        self._w = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream = self._w.stream(self.core.list_namespaced_pod, self.ns, timeout_seconds=600)
        with contextlib.suppress(urllib3.exceptions.HTTPError):  # the stream closed at stop
            for ev in stream:
                meta = ev["object"].metadata
                self.annotations.setdefault(meta.name, []).append(dict(meta.annotations or {}))
                if meta.deletion_timestamp and meta.name not in self.deleted_at:
                    self.deleted_at[meta.name] = meta.deletion_timestamp

    def stop(self) -> None:
        self._w.stop()


def test_scale_down_removes_the_pod_with_the_least_hot_host_cache(api, namespace):
    ns, name = namespace, "marks"
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    config = load_local(REPO_ROOT / "tests/fixtures/models/llama-3.2-1b.json")
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="model"), data={"config.json": json.dumps(config)}))
    # minReplicas 3 holds the fleet at 3 while the test warms caches.
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": "meta-llama/Llama-3.2-1B", "configMapRef": {"name": "model"}},
                 "replicas": 3, "offload": {"hostMemory": "4Gi"},
                 "autoscaling": {"enabled": True, "intervalSeconds": INTERVAL, "minReplicas": 3,
                                 "maxReplicas": 3, "scaleDownStabilizationSeconds": WINDOW}},
    })
    events = PodLog(core, ns)

    def live() -> list[client.V1Pod]:
        pods = core.list_namespaced_pod(ns, label_selector=f"{LABEL}={name}").items
        return [p for p in pods if not p.metadata.deletion_timestamp]

    def running(n: int) -> list[client.V1Pod] | None:
        pods = live()
        ok = len(pods) == n and all(p.status.pod_ip and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            for p in pods)
        return pods if ok else None

    def url(pod: client.V1Pod) -> str:
        return f"http://{pod.status.pod_ip}:8000"

    try:
        with SimulatorFleet(api, ns, name, SIM_ARGS) as fleet:
            first = wait_for(lambda: running(3), 90, "three ready pods")
            wait_for(lambda: len(fleet.urls()) == 3, 60, "three simulators")
            # One pod replaced after a while: the newest pod, which the controller would
            # remove first if nothing said otherwise (it has been ready the shortest).
            t0 = max(_ready_time(p) for p in first)
            time.sleep(max(0.0, 30 - (datetime.now(UTC) - t0).total_seconds()))
            core.delete_namespaced_pod(first[0].metadata.name, ns)
            pods = wait_for(lambda: (p := running(3)) and first[0].metadata.name not in
                            {x.metadata.name for x in p} and p, 90, "the replacement pod")
            # (the new pod may have the old one's IP: wait for the old simulator to go)
            wait_for(lambda: first[0].metadata.name not in fleet.sims
                     and {p.metadata.name for p in pods} <= set(fleet.sims)
                     and {url(p) for p in pods} <= set(fleet.urls()), 60, "its simulator")
            # The cold pod is the one the controller would keep longest on its own.
            order = controller_order(pods, datetime.now(UTC))
            cold = order[-1]
            hot = order[:-1]
            by_name = {p.metadata.name: p for p in pods}
            for i, pod in enumerate(hot):
                assert warm_host_tier(url(by_name[pod]), i) > 0, f"{pod}: no host-tier hits"

            # Let it scale down to 2.
            custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, {
                "spec": {"autoscaling": {"minReplicas": 2}}})
            wait_for(lambda: custom.get_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name)["spec"]["replicas"] == 2, 60,
                "the scale-down to 2")
            survivors = wait_for(lambda: running(2), 60, "two pods left")
            gone = wait_for(lambda: set(events.deleted_at) - {first[0].metadata.name}, 30,
                            "the deleted pod")
    finally:
        events.stop()

    # The pod that went is the cold one, marked before it went ...
    assert gone == {cold}, (gone, cold, hot)
    assert {p.metadata.name for p in survivors} == set(hot)
    marks = [a for a in events.annotations[cold] if a.get(DRAINING) == "true"]
    assert marks and int(marks[0][DELETION_COST]) < 0, events.annotations[cold]
    # ... the others never were (no cost below theirs, nothing to drain) ...
    for pod in hot:
        assert not [a for a in events.annotations[pod] if DRAINING in a or DELETION_COST in a]
    # ... and the controller took it because of its cost: on its own order at the time of
    # the deletion it would have taken another pod.
    at = events.deleted_at[cold]
    on_its_own = controller_order(pods, at)
    assert on_its_own[0] != cold, (on_its_own, cold)
    # The Event names the pod and why.
    evs = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    down = [e.message for e in evs if e.reason == "ScaledDown"]
    assert down and cold in down[-1] and "host-hit tokens" in down[-1], down


def test_a_mark_no_scale_down_takes_is_removed(api, namespace):
    """A mark left on a live pod (the scale write failed, a standby took over, the
    decision was reversed) comes off at the next tick: never draining for good."""
    ns, name = namespace, "stale"
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    config = load_local(REPO_ROOT / "tests/fixtures/models/llama-3.2-1b.json")
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="model"), data={"config.json": json.dumps(config)}))
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": "meta-llama/Llama-3.2-1B", "configMapRef": {"name": "model"}},
                 "replicas": 2, "offload": {"hostMemory": "4Gi"},
                 "autoscaling": {"enabled": True, "intervalSeconds": INTERVAL, "minReplicas": 2,
                                 "maxReplicas": 2}},
    })
    with SimulatorFleet(api, ns, name, SIM_ARGS) as fleet:
        wait_for(lambda: len(fleet.urls()) == 2, 90, "two simulators")
        pods = core.list_namespaced_pod(ns, label_selector=f"{LABEL}={name}").items
        marked, other = pods[0].metadata.name, pods[1].metadata.name
        core.patch_namespaced_pod(marked, ns, {"metadata": {"annotations": {
            DELETION_COST: "-1", DRAINING: "true", "example.com/keep": "yes"}}})

        def annotations(pod: str) -> dict[str, str]:
            return core.read_namespaced_pod(pod, ns).metadata.annotations or {}

        wait_for(lambda: DRAINING not in annotations(marked), 10 * INTERVAL + 10,
                 "the stale mark to come off", on_timeout=lambda: annotations(marked))
        left = annotations(marked)
        assert DELETION_COST not in left and left.get("example.com/keep") == "yes"
        assert DRAINING not in annotations(other)
        assert len(core.list_namespaced_pod(ns, label_selector=f"{LABEL}={name}").items) == 2
