"""The operator's own watches (``watch.Reflector``) against the real API server:
only what the label selector matches, resumed without replay after every server
timeout, label removal and deletes seen as DELETED, and a compacted version (410)
answered by a fresh list that reports what vanished meanwhile. ConfigMaps and a
custom resource stand in for the children: the Reflector treats every kind alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from spillway_operator.plumbing import metrics, watch

CONFIGMAPS = watch.Kind("v1", "ConfigMap", "configmaps")
PROBE_GROUP = "watch-test.spillway.dev"
SELECTOR = "app.kubernetes.io/managed-by=spillway,spillway.dev/inference-deployment"
MANAGED = {"app.kubernetes.io/managed-by": "spillway", "spillway.dev/inference-deployment": "x"}


class Recorder:
    def __init__(self):
        self.events: list[tuple[str, str, str]] = []  # (type, name, resourceVersion)
        self.bodies: list[dict] = []
        self._cond = threading.Condition()

    def __call__(self, event_type: str, body: dict) -> None:
        meta = body["metadata"]
        with self._cond:
            self.events.append((event_type, meta["name"], meta.get("resourceVersion", "")))
            self.bodies.append(body)
            self._cond.notify_all()

    def wait_for(self, predicate, timeout: float = 20) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self.events), timeout), self.events

    def names(self, event_type: str) -> list[str]:
        return [n for t, n, _ in self.events if t == event_type]


def _configmap(core: client.CoreV1Api, namespace: str, name: str, labels: dict) -> None:
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name, labels=labels), data={"k": "v"}))


def test_lists_then_watches_only_what_the_selector_matches(api, namespace):
    core = client.CoreV1Api(api)
    _configmap(core, namespace, "before", MANAGED)
    _configmap(core, namespace, "foreign", {"app.kubernetes.io/managed-by": "helm"})
    seen = Recorder()
    lists = metrics.API_REQUESTS.labels(verb="list")._value.get()
    r = watch.Reflector(api, CONFIGMAPS, namespace, SELECTOR, seen, timeout=2).start()
    try:
        assert r.synced.wait(20)
        assert metrics.API_REQUESTS.labels(verb="list")._value.get() == lists + 1
        assert seen.names("ADDED") == ["before"]
        body = seen.bodies[0]
        assert (body["apiVersion"], body["kind"]) == ("v1", "ConfigMap")  # lists omit them
        _configmap(core, namespace, "after", MANAGED)
        _configmap(core, namespace, "foreign-2", {})
        core.patch_namespaced_config_map("before", namespace, {"data": {"k": "w"}})
        seen.wait_for(lambda ev: [n for t, n, _ in ev if t != "ADDED" or n != "before"]
                      == ["after", "before"])
        # Several server timeouts (2 s each) later: resumed from the last version, so
        # nothing is delivered twice, and a change after them still arrives.
        time.sleep(5)
        core.patch_namespaced_config_map("after", namespace, {"data": {"k": "w"}})
        seen.wait_for(lambda ev: len(ev) == 4)
        time.sleep(1)
        assert [(t, n) for t, n, _ in seen.events] == [
            ("ADDED", "before"), ("ADDED", "after"), ("MODIFIED", "before"),
            ("MODIFIED", "after")]
        assert metrics.API_REQUESTS.labels(verb="list")._value.get() == lists + 1
        versions = [int(v) for _, _, v in seen.events]
        assert versions[1:] == sorted(versions[1:])
    finally:
        r.stop(timeout=10)
    assert not r._thread.is_alive()


def test_label_removal_and_delete_are_deletes_that_still_name_the_owner(api, namespace):
    core = client.CoreV1Api(api)
    _configmap(core, namespace, "relabelled", MANAGED)
    _configmap(core, namespace, "deleted", MANAGED)
    seen = Recorder()
    r = watch.Reflector(api, CONFIGMAPS, namespace, SELECTOR, seen).start()
    try:
        assert r.synced.wait(20)
        core.patch_namespaced_config_map(
            "relabelled", namespace,
            {"metadata": {"labels": {"spillway.dev/inference-deployment": None}}})
        core.delete_namespaced_config_map("deleted", namespace)
        seen.wait_for(lambda ev: len([e for e in ev if e[0] == "DELETED"]) == 2)
        assert sorted(seen.names("DELETED")) == ["deleted", "relabelled"]
        for body in seen.bodies[2:]:  # the owner is still named (the last matching labels)
            assert body["metadata"]["labels"]["spillway.dev/inference-deployment"] == "x"
        # Labelled again: it comes back as ADDED.
        core.patch_namespaced_config_map("relabelled", namespace,
                                         {"metadata": {"labels": MANAGED}})
        seen.wait_for(lambda ev: ev[-1][:2] == ("ADDED", "relabelled"))
    finally:
        r.stop(timeout=10)


@pytest.fixture
def probes(api) -> Iterator[watch.Kind]:
    """A custom resource defined now: its watch cache starts at the current revision,
    so a watch from an older one is answered 410 Gone, as after a compaction."""
    ext = client.ApiextensionsV1Api(api)
    name = f"probes.{PROBE_GROUP}"
    ext.create_custom_resource_definition({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
        "spec": {"group": PROBE_GROUP, "scope": "Namespaced",
                 "names": {"plural": "probes", "singular": "probe", "kind": "Probe"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                     "openAPIV3Schema": {"type": "object",
                                         "x-kubernetes-preserve-unknown-fields": True}}}]}})
    deadline = time.monotonic() + 60
    while not any(c.type == "Established" and c.status == "True" for c in
                  (ext.read_custom_resource_definition(name).status.conditions or ())):
        assert time.monotonic() < deadline, "the probe CRD never became Established"
        time.sleep(0.2)
    try:
        yield watch.Kind(f"{PROBE_GROUP}/v1", "Probe", "probes")
    finally:
        ext.delete_custom_resource_definition(name)


def test_a_compacted_version_lists_again_and_reports_what_vanished(api, namespace, probes):
    objects = client.CustomObjectsApi(api)

    def create(name: str) -> None:
        body = {"apiVersion": f"{PROBE_GROUP}/v1", "kind": "Probe",
                "metadata": {"name": name, "labels": MANAGED}}
        for _ in range(50):  # the new resource's endpoint may lag Established briefly
            try:
                objects.create_namespaced_custom_object(PROBE_GROUP, "v1", namespace,
                                                        "probes", body)
                return
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
                time.sleep(0.2)
        raise AssertionError("the probe resource was never served")

    create("live")
    seen = Recorder()
    lists = metrics.API_REQUESTS.labels(verb="list")._value.get()
    r = watch.Reflector(api, probes, namespace, SELECTOR, seen)
    # As if it had watched from etcd's first revision, long gone from the watch cache,
    # and known an object deleted while it was away: the API server answers 410 Gone.
    r.version = "1"
    r._known[(namespace, "vanished")] = {"namespace": namespace, "name": "vanished",
                                         "labels": MANAGED}
    r.start()
    try:
        assert r.synced.wait(30)
        assert metrics.API_REQUESTS.labels(verb="list")._value.get() == lists + 1
        seen.wait_for(lambda ev: len(ev) == 2)
        assert [(t, n) for t, n, _ in seen.events] == [("ADDED", "live"), ("DELETED", "vanished")]
        gone = seen.bodies[1]
        assert gone["metadata"]["labels"] == MANAGED and gone["kind"] == "Probe"
        # Dated at the list, so a cache keeps any newer body of a re-created object.
        assert int(gone["metadata"]["resourceVersion"]) >= int(seen.events[0][2])
        assert r.version == gone["metadata"]["resourceVersion"]
        create("later")
        seen.wait_for(lambda ev: ev[-1][:2] == ("ADDED", "later"))
    finally:
        r.stop(timeout=10)


def test_an_optional_watch_the_role_does_not_grant_ends_with_one_line(cluster, caplog):
    """The namespaces' watch is optional (rbac.clusterScopedReads: false grants none):
    a 403 ends it with one line saying what the operator does instead, where a required
    watch would retry for ever."""
    from kubernetes import config

    nobody = config.new_client_from_config(config_file=str(cluster.config.kubeconfig))
    nobody.set_default_header("Impersonate-User", "spillway-test-nobody")
    seen = Recorder()
    caplog.set_level("INFO", logger="spillway.watch")
    r = watch.Reflector(nobody, watch.NAMESPACES, None, "", seen, timeout=2,
                        optional="learned from refused writes").start()
    try:
        assert r.synced.wait(20)
        r._thread.join(10)
        assert not r._thread.is_alive() and seen.events == []
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "spillway.watch"]
        assert lines == ["watch namespaces in all namespaces: not granted by the operator's "
                         "role; learned from refused writes"], lines
    finally:
        r.stop(timeout=10)


def test_the_namespaces_watch_sees_a_deletion_before_its_contents_go(api, cluster):
    """What Kube.observe_namespace is told: a namespace being deleted arrives as a
    MODIFIED event with a deletionTimestamp and phase Terminating, while an object in
    it (held by a finalizer in case the controller is quick) is still there."""
    from spillway_operator.plumbing.kube import Kube

    core = client.CoreV1Api(api)
    ns = f"ns-watch-{int(time.time() * 1000) % 10**8}"
    kube = Kube(api)
    r = watch.Reflector(api, watch.NAMESPACES, None, "", kube.observe_namespace,
                        timeout=5).start()
    try:
        assert r.synced.wait(20)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
        core.create_namespaced_config_map(ns, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="held", finalizers=["spillway.dev/test-hold"])))
        time.sleep(1)
        assert not kube.namespace_terminating(ns)
        core.delete_namespace(ns)
        deadline = time.monotonic() + 20
        while not kube.namespace_terminating(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kube.namespace_terminating(ns)
        # Known as going while its contents are still there (the namespace controller
        # had not even marked the ConfigMap for deletion yet in the runs here).
        assert core.read_namespaced_config_map("held", ns).metadata.name == "held"
    finally:
        core.patch_namespaced_config_map("held", ns, {"metadata": {"finalizers": None}})
        r.stop(timeout=10)
