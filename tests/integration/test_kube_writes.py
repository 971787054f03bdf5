"""How the operator writes its children, against the real API server: a surely new
child is POSTed, and its first later change adopts the create's field ownership as
server-side apply's, so applies go on removing what they stop setting; an existing
child met by a create is applied instead; and a namespace being deleted is left alone
(nothing re-created in it, no status or Event saying its children are gone)."""

from __future__ import annotations

import json
import uuid

import pytest
from kubernetes import client

from spillway_operator.flow.reconciler import Reconciler
from spillway_operator.plumbing import metrics
from spillway_operator.plumbing.cache import WatchCache
from spillway_operator.plumbing.kube import Kube, NamespaceTerminating
from tests.helpers import wait_for
from tests.integration.test_operator import MODELS

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


HOLD = "spillway.dev/test-hold"


def _writes() -> float:
    return sum(metrics.API_REQUESTS.labels(verb=v)._value.get() for v in ("post", "patch"))


def test_a_namespace_being_deleted_is_left_alone(api):
    """Deleting a namespace deletes the children before (or beside) their owner; the
    owner's reconcile then meets "being terminated" on every create. Before, it applied
    them again, wrote Degraded=True ApplyRejected and posted Events (in bench.faults'
    teardown of 200 objects: 654 refused child writes, 436 status writes, 1,204 Events;
    now 3 refused child writes, one per reconcile in flight, and nothing else)."""
    core = client.CoreV1Api(api)
    ns = f"terminating-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    config = json.loads((MODELS / "gemma-3-1b-it.json").read_text())
    # The model config holds the namespace in Terminating (a finalizer) and stays readable.
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="model", finalizers=[HOLD]),
        data={"config.json": json.dumps(config)}))
    try:
        core.delete_namespace(ns)
        wait_for(lambda: core.read_namespace(ns).status.phase == "Terminating", 30,
                 f"{ns} Terminating")
        kube = Kube(api, cache=WatchCache("spillway.dev/inference-deployment"))
        child = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": "child", "namespace": ns}, "data": {"k": "v"}}
        with pytest.raises(NamespaceTerminating, match="being terminated"):
            kube.ensure(child, surely_absent=True)
        assert kube.namespace_terminating(ns) and not kube.namespace_terminating("default")

        # The owner's reconcile: nothing created, no status, no Event, not a retry.
        owner = {"apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment",
                 "metadata": {"name": "chat", "namespace": ns, "uid": str(uuid.uuid4()),
                              "generation": 1},
                 "spec": {"model": {"name": "google/gemma-3-1b-it",
                                    "configMapRef": {"name": "model"}},
                          "offload": {"hostMemory": "16Gi"}}}
        for told in (True, False):  # this Kube was told already; a fresh one asks once
            rec_kube = kube if told else Kube(api)
            before = _writes()
            result = Reconciler(rec_kube).reconcile(dict(owner))
            assert result.outcome == "ok" and result.writes == 0 and result.written is None
            # Looked at again once forgotten (a namespace of that name may be new then).
            assert result.requeue_after == Kube.TERMINATING_MEMORY
            assert _writes() - before == (0 if told else 1)  # the one refused create
            assert rec_kube.namespace_terminating(ns)
        names = {c.metadata.name for c in core.list_namespaced_config_map(ns).items}
        assert "model" in names and not names & {"child", "chat-plan"}
    finally:
        core.patch_namespaced_config_map("model", ns, {"metadata": {"finalizers": None}})
        wait_for(lambda: not [n for n in core.list_namespace().items if n.metadata.name == ns],
                 60, f"{ns} to go")
