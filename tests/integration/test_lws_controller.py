"""LeaderWorkerSet v0.8.0's real controller and webhooks in the local control plane: a
LeaderWorkerSet becomes a leader pod and a worker pod per group on the KWOK nodes, the
API server's call to LWS's pod webhook (a host process on 127.0.0.1) injects the
group's environment, scaling adds groups, and a worker that goes recreates its group."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from tests.helpers import wait_for

# Needs the local control plane harness itself (its LWS controller, KWOK nodes).
pytestmark = pytest.mark.local_only

GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
HOLD = "spillway.dev/test-hold"


def lws_manifest(name: str, size: int, replicas: int) -> dict:
    pod_spec = {
        "nodeSelector": {"type": "kwok"},
        "containers": [{"name": "main", "image": "example.invalid/trivial:0",
                        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}],
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {"spec": pod_spec},
            },
        },
    }


def running(pod: client.V1Pod) -> bool:
    return pod.status.phase == "Running" and pod.metadata.deletion_timestamp is None


def env_of(pod: client.V1Pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env or []}


def test_leaderworkerset_groups_run_with_injected_env_scale_and_recreate(api, namespace):
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    name = "lws"

    def pods() -> list[client.V1Pod]:
        return core.list_namespaced_pod(namespace, label_selector=f"{NAME_LABEL}={name}").items

    def running_by_name(count: int):
        now = [p for p in pods() if running(p)]
        return {p.metadata.name: p for p in now} if len(now) == count else None

    def state() -> list[tuple]:
        return [(p.metadata.name, p.status.phase, p.metadata.uid[:8]) for p in pods()]

    created = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                     lws_manifest(name, size=2, replicas=1))
    # LWS's defaulting webhook answered the API server's call for the create.
    rolling = created["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert created["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"
    assert rolling["maxUnavailable"] == 1 and rolling["partition"] == 0

    # Its validating webhook refuses what the schema alone would take.
    bad = lws_manifest("lws-bad", size=2, replicas=1)
    bad["spec"]["leaderWorkerTemplate"]["subGroupPolicy"] = {"subGroupSize": 3}
    with pytest.raises(client.ApiException) as refused:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)
    assert refused.value.status == 403  # a webhook's denial, not the schema's 422
    message = json.loads(refused.value.body)["message"]
    assert message.startswith('admission webhook "vleaderworkerset.kb.io" denied'), message
    assert "subGroupSize cannot be larger than size" in message

    # One group: the leader (a StatefulSet's pod) and its worker, both Running on KWOK nodes.
    group = wait_for(lambda: running_by_name(2), 90, "the leader and the worker Running",
                     on_timeout=state)
    assert set(group) == {f"{name}-0", f"{name}-0-1"}
    leader, worker = group[f"{name}-0"], group[f"{name}-0-1"]
    for pod in (leader, worker):
        assert pod.spec.node_name.startswith("gpu-node-")
        assert pod.metadata.labels[GROUP_LABEL] == "0"
    assert leader.metadata.labels[WORKER_LABEL] == "0"
    assert worker.metadata.labels[WORKER_LABEL] == "1"
    # LWS's pod webhook, called by the API server on 127.0.0.1, put the group's
    # environment into both pods: the leader's stable DNS name, the size, the index.
    address = f"{name}-0.{name}.{namespace}"
    assert env_of(worker) == {"LWS_LEADER_ADDRESS": address, "LWS_GROUP_SIZE": "2",
                              "LWS_WORKER_INDEX": "1"}
    assert env_of(leader) == {"LWS_LEADER_ADDRESS": address, "LWS_GROUP_SIZE": "2",
                              "LWS_WORKER_INDEX": "0"}
    # The headless Service that name resolves in.
    service = core.read_namespaced_service(name, namespace)
    assert service.spec.cluster_ip == "None"

    # Two groups: four pods, group 1's the same shape.
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                          {"spec": {"replicas": 2}})
    four = wait_for(lambda: running_by_name(4), 90, "two groups (4 pods) Running",
                    on_timeout=state)
    assert set(four) == {f"{name}-0", f"{name}-0-1", f"{name}-1", f"{name}-1-1"}
    assert env_of(four[f"{name}-1-1"])["LWS_LEADER_ADDRESS"] == f"{name}-1.{name}.{namespace}"
    assert four[f"{name}-0"].metadata.uid == leader.metadata.uid  # group 0 untouched
    status = wait_for(
        lambda: (s := custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name).get("status", {})).get(
            "readyReplicas") == 2 and s, 60, "the LeaderWorkerSet's status: 2 ready groups")
    assert status["replicas"] == 2

    # Group 0's worker goes. KWOK removes a deleted pod at once where a kubelet takes
    # the grace period to stop its containers; a finalizer the test holds plays that
    # period, in which LWS's pod controller sees the worker terminating.
    group1 = {four[f"{name}-1"].metadata.uid, four[f"{name}-1-1"].metadata.uid}
    core.patch_namespaced_pod(f"{name}-0-1", namespace, {"metadata": {"finalizers": [HOLD]}})
    try:
        core.delete_namespaced_pod(f"{name}-0-1", namespace)

        def leader_going():
            try:
                now = core.read_namespaced_pod(f"{name}-0", namespace)
            except client.ApiException as exc:
                return exc.status == 404 and "gone"
            return (now.metadata.uid != leader.metadata.uid
                    or now.metadata.deletion_timestamp is not None) and "deleted"

        wait_for(leader_going, 60, "LWS to delete group 0's leader (RecreateGroupOnPodRestart)",
                 on_timeout=state)
    finally:
        core.patch_namespaced_pod(f"{name}-0-1", namespace,
                                  {"metadata": {"finalizers": None}})

    def recreated():
        now = running_by_name(4)
        if not now or now[f"{name}-0"].metadata.uid == leader.metadata.uid:
            return None
        if now[f"{name}-0-1"].metadata.uid == worker.metadata.uid:
            return None
        return now

    after = wait_for(recreated, 90, "group 0 recreated: a new leader and worker Running",
                     on_timeout=state)
    # Only group 0 was recreated; group 1 kept its pods.
    assert {after[f"{name}-1"].metadata.uid, after[f"{name}-1-1"].metadata.uid} == group1
    assert env_of(after[f"{name}-0-1"])["LWS_WORKER_INDEX"] == "1"
    events = core.list_namespaced_event(
        namespace, field_selector="reason=RecreateGroupOnPodRestart").items
    assert any(f"deleted leader pod {name}-0" in e.message for e in events)


def test_a_unique_per_replica_subdomain_gives_each_group_its_own_headless_service(
        api, namespace):
    """The operator's LeaderWorkerSets (UniquePerReplica): LWS's controller makes a
    headless Service per group, named after its leader, and no Service of the set's
    own name, which is the serving Service's."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    name = "unique"
    manifest = lws_manifest(name, size=2, replicas=2)
    manifest["spec"]["networkConfig"] = {"subdomainPolicy": "UniquePerReplica"}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)

    def running_pods():
        pods = core.list_namespaced_pod(namespace, label_selector=f"{NAME_LABEL}={name}").items
        now = {p.metadata.name: p for p in pods if running(p)}
        return now if len(now) == 4 else None

    pods = wait_for(running_pods, 90, "two groups (4 pods) Running")
    for group in (0, 1):
        leader = f"{name}-{group}"
        assert env_of(pods[f"{leader}-1"])["LWS_LEADER_ADDRESS"] == (
            f"{leader}.{leader}.{namespace}")
        service = wait_for(lambda s=leader: _service(core, namespace, s), 30,
                           f"the headless Service {leader}")
        assert service.spec.cluster_ip == "None"
    assert _service(core, namespace, name) is None


def _service(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Service | None:
    try:
        return core.read_namespaced_service(name, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
