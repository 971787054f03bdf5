"""How the operator writes its children, against the real API server: a surely new
child is POSTed, and its first later change adopts the create's field ownership as
server-side apply's, so applies go on removing what they stop setting; an existing
child met by a create is applied instead."""

from __future__ import annotations

from kubernetes import client

from spillway_operator.cache import WatchCache
from spillway_operator.kube import Kube

MANAGER = "spillway"


def _configmap(namespace: str, data: dict, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "child", "namespace": namespace, "labels": labels},
            "data": data}


def _ours(live) -> list[str]:
    return [e.operation for e in live.metadata.managed_fields or ()
            if e.manager == MANAGER]


def test_a_created_child_is_adopted_so_later_applies_remove_what_they_drop(api, namespace):
    core = client.CoreV1Api(api)
    kube = Kube(api, cache=WatchCache("spillway.dev/inference-deployment"))
    first = _configmap(namespace, {"keep": "1", "drop": "2"}, {"a": "1", "b": "2"})
    action, body = kube.ensure(first, surely_absent=True)
    assert action == "created" and body["data"] == first["data"]
    live = core.read_namespaced_config_map("child", namespace)
    assert _ours(live) == ["Update"]  # a POST: the create's Update entry

    # Unchanged: nothing written, the Update entry stays.
    assert kube.ensure(first)[0] == "unchanged"
    # A change of one value that also drops a data key and a label (a drop alone is
    # no difference: another manager may have added the field): adopted, then applied.
    second = _configmap(namespace, {"keep": "changed"}, {"a": "1"})
    action, body = kube.ensure(second)
    assert action == "updated"
    live = core.read_namespaced_config_map("child", namespace)
    assert live.data == {"keep": "changed"} and live.metadata.labels == {"a": "1"}
    assert _ours(live) == ["Apply"]
    # From then on plain applies: a field set, then dropped with another change.
    kube.ensure(_configmap(namespace, {"keep": "changed", "x": "3"}, {"a": "1"}))
    kube.ensure(_configmap(namespace, {"keep": "again"}, {"a": "1"}))
    live = core.read_namespaced_config_map("child", namespace)
    assert live.data == {"keep": "again"} and _ours(live) == ["Apply"]


def test_a_create_that_finds_the_child_applies_over_it(api, namespace):
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="child"), data={"old": "1"}))
    kube = Kube(api)  # no cache: the 409 makes it read the live object
    action, _ = kube.ensure(_configmap(namespace, {"new": "2"}, {"a": "1"}), surely_absent=True)
    assert action == "updated"
    live = core.read_namespaced_config_map("child", namespace)
    assert live.data == {"old": "1", "new": "2"} and live.metadata.labels == {"a": "1"}
    assert _ours(live) == ["Apply"]
    # The same again changes nothing.
    assert kube.ensure(_configmap(namespace, {"new": "2"}, {"a": "1"}),
                       surely_absent=True)[0] == "unchanged"


def test_adoption_from_a_stale_copy_reads_again_instead_of_failing(api, namespace):
    core = client.CoreV1Api(api)
    kube = Kube(api, cache=WatchCache("spillway.dev/inference-deployment"))
    kube.ensure(_configmap(namespace, {"keep": "1", "drop": "2"}, {"a": "1"}), surely_absent=True)
    # Someone else writes meanwhile (as the controllers do a Deployment's status): the
    # cached copy's resourceVersion is old now.
    core.patch_namespaced_config_map("child", namespace,
                                     {"metadata": {"annotations": {"other": "x"}}})
    action, _ = kube.ensure(_configmap(namespace, {"keep": "changed"}, {"a": "1"}))
    assert action == "updated"
    live = core.read_namespaced_config_map("child", namespace)
    assert live.data == {"keep": "changed"} and _ours(live) == ["Apply"]
