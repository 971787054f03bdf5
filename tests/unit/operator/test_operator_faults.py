"""What the fault tests (tests/integration/test_faults.py) found, as pure functions:
kopf must never give up on the API server, a hand edit of a child must reach its
owner and be seen as a difference, and a failing object keeps one retry pending."""

from __future__ import annotations

import asyncio
import collections.abc
import itertools

import kopf

from spillway_operator.controller import Backoff, Controller
from spillway_operator.handlers import OWNER_LABEL, configure, is_child, owner_key
from spillway_operator.plumbing.kube import contains


def test_kopf_retries_api_errors_for_ever_so_an_outage_never_ends_the_operator():
    """kopf gives up after the last delay of a sized list, and a watch that gives up
    stops the operator; ours has no last delay, and every request starts afresh."""
    settings = kopf.OperatorSettings()
    configure(settings, {})
    backoffs = settings.networking.error_backoffs
    assert not isinstance(backoffs, collections.abc.Sized)  # kopf: no "last attempt"
    first = list(itertools.islice(backoffs, 1000))
    assert first[:4] == [1, 2, 5, 10] and len(first) == 1000 and max(first) == 10
    assert list(itertools.islice(backoffs, 4)) == [1, 2, 5, 10]  # the next request


REF = {"apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment", "name": "chat",
       "uid": "u", "controller": True}


def test_a_child_whose_labels_were_removed_still_names_its_owner():
    assert owner_key("team-a", {}, [REF]) == ("team-a", "chat")
    # The reference wins over a label edited to name another object.
    assert owner_key("team-a", {OWNER_LABEL: "other"}, [REF]) == ("team-a", "chat")
    assert owner_key("team-a", {OWNER_LABEL: "chat"}, None) == ("team-a", "chat")  # pods
    foreign = {**REF, "apiVersion": "example.com/v1"}
    assert owner_key("team-a", {}, [foreign, {"kind": "ReplicaSet", "name": "x"}]) is None
    assert owner_key(None, {}, [REF]) is None


def test_the_children_filter_takes_labelled_or_owned_objects_only():
    labels = {"app.kubernetes.io/managed-by": "spillway", OWNER_LABEL: "chat"}
    assert is_child(labels=labels, meta={})
    assert is_child(labels={}, meta={"ownerReferences": [REF]})  # labels removed by hand
    assert not is_child(labels={OWNER_LABEL: "chat"}, meta={})  # not managed by us
    assert not is_child(labels={}, meta={"ownerReferences": [{**REF, "kind": "Other"}]})


def test_a_key_added_to_the_service_selector_is_a_difference():
    """spec.selector is an atomic map: applying ours replaces a hand-added key, so it
    must not be ignored as another manager's field (the Service selected no pod)."""
    desired = {"spec": {"selector": {"app": "a", "owner": "chat"}, "type": "ClusterIP"}}
    live = {"spec": {"selector": {"app": "a", "owner": "chat"}, "type": "ClusterIP",
                     "clusterIP": "10.0.0.7"}}
    assert contains(live, desired)
    live["spec"]["selector"]["by-hand"] = "x"
    assert not contains(live, desired)
    # Elsewhere a map still ignores what others add (labels, annotations).
    assert contains({"metadata": {"labels": {"a": "1", "b": "2"}}},
                    {"metadata": {"labels": {"a": "1"}}})
    # The Deployment's selector: same keys, compared as before.
    assert contains({"spec": {"selector": {"matchLabels": {"a": "1"}}}},
                    {"spec": {"selector": {"matchLabels": {"a": "1"}}}})


def test_a_failing_key_keeps_one_retry_pending_whatever_else_reconciles_it():
    """Before: each reconcile of a failing key scheduled a retry of its own, so every
    extra event (its own status write, a resync, a pod) started another chain of
    retries that never ended. Now one retry is pending per key."""

    class Failing:  # the reconciler's place: a key whose model config never appears
        def __init__(self):
            self.calls = 0

        def reconcile(self, body, defer_status=False):
            self.calls += 1

            class Result:
                requeue_after = 0.1
            return Result()

    body = {"metadata": {"namespace": "ns", "name": "a"}}

    async def scenario() -> int:
        rec = Failing()
        c = Controller(rec, workers=2, backoff=Backoff(base=0.01, cap=0.1))
        c.start()
        for i in range(10):  # ten changes (not of status alone), each reconciled
            c.observe({"metadata": {**body["metadata"], "annotations": {"n": str(i)}}},
                      "MODIFIED")
            await asyncio.sleep(0.03)
        assert len(c._retries) == 1
        before = rec.calls
        await asyncio.sleep(1.0)
        during = rec.calls - before
        c.observe(body, "DELETED")  # gone: its retry goes with it
        assert c._retries == {}
        await c.stop()
        return during

    # One chain retries every 0.1 s: about 10 in a second; ten chains would make ~100.
    assert asyncio.run(scenario()) <= 15


def test_an_item_another_manager_added_to_a_merged_list_is_no_difference():
    """env, containers, volumes... are merged by key under server-side apply: a
    hand-added item stays after our apply, so treating it as a difference re-applied
    on every reconcile, for ever. An atomic list (args) is ours whole: any extra item
    is a difference, and our apply replaces it."""
    desired = {"spec": {"containers": [{"name": "engine", "args": ["--a"],
                                        "env": [{"name": "A", "value": "1"}],
                                        "ports": [{"containerPort": 8000}]}]}}
    live = {"spec": {"containers": [
        {"name": "sidecar", "image": "x"},  # injected by a webhook
        {"name": "engine", "args": ["--a"], "image": "e",
         "env": [{"name": "DEBUG", "value": "1"}, {"name": "A", "value": "1"}],
         "ports": [{"containerPort": 8000, "protocol": "TCP"}]}]}}
    assert contains(live, desired)
    live["spec"]["containers"][1]["env"][1]["value"] = "2"  # ours, edited: a difference
    assert not contains(live, desired)
    live["spec"]["containers"][1]["env"][1]["value"] = "1"
    live["spec"]["containers"][1]["args"].append("--by-hand")  # atomic: a difference
    assert not contains(live, desired)
    live["spec"]["containers"][1]["args"].pop()
    del live["spec"]["containers"][1]["env"][1]  # ours, removed: a difference
    assert not contains(live, desired)


def test_a_terminating_namespace_is_forgotten_after_a_while(monkeypatch):
    """A namespace refused as "being terminated" holds writes for TERMINATING_MEMORY
    seconds only: a namespace of that name created afterwards is a new one."""

    from kubernetes import client

    from spillway_operator.plumbing import kube as kube_module
    from spillway_operator.plumbing.kube import Kube, _namespace_terminating

    refusal = (b'{"kind":"Status","code":403,"reason":"Forbidden","details":{"causes":'
               b'[{"reason":"NamespaceTerminating","field":"metadata.namespace"}]}}')
    assert _namespace_terminating(refusal)
    assert not _namespace_terminating(b'{"kind":"Status","code":403,"reason":"Forbidden"}')
    assert not _namespace_terminating(b"not json") and not _namespace_terminating(None)

    kube = Kube(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")))  # no one
    now = [1000.0]
    monkeypatch.setattr(kube_module.time, "monotonic", lambda: now[0])
    kube._terminating["gone"] = now[0]
    assert kube.namespace_terminating("gone") and not kube.namespace_terminating("other")
    now[0] += Kube.TERMINATING_MEMORY - 1
    assert kube.namespace_terminating("gone")
    now[0] += 1
    assert not kube.namespace_terminating("gone") and "gone" not in kube._terminating


def test_a_terminating_namespace_is_held_while_a_read_shows_its_deletion(monkeypatch):
    """Without the namespaces' watch, the memory of a "being terminated" refusal ends
    with a read of the namespace: still being deleted (pods in their grace period hold
    it for minutes), writes stay held and none is sent; gone or new, it opens. Before,
    it opened after TERMINATING_MEMORY seconds whatever, and statuses, plan ConfigMaps
    and Events went into it again (one right after the refusal had been said)."""
    import json

    import pytest
    from kubernetes import client

    from spillway_operator.plumbing import kube as kube_module
    from spillway_operator.plumbing.kube import Kube, NamespaceTerminating

    answers = {"deleting": (200, {"metadata": {"name": "ns", "deletionTimestamp": "t"}}),
               "gone": (404, {"kind": "Status", "code": 404}),
               "new": (200, {"metadata": {"name": "ns"}})}
    sent: list[str] = []
    state = ["deleting"]

    class Answer:  # what call_api gives back: a status, a reason, a body to read
        def __init__(self, status: int, body: dict) -> None:
            self.status, self.reason, self._data = status, "", json.dumps(body).encode()

        def read(self) -> bytes:
            return self._data

    class Api(client.ApiClient):  # the API server's answers, every request counted
        def call_api(self, method, url, *args, **kwargs):
            sent.append(f"{method} {url}")
            return Answer(*answers[state[0]])

    kube = Kube(Api())
    now = [1000.0]
    monkeypatch.setattr(kube_module.time, "monotonic", lambda: now[0])
    kube._terminating["ns"] = now[0]
    status = "/apis/spillway.dev/v1alpha1/namespaces/ns/inferencedeployments/a/status"
    for _ in range(3):  # minutes of Terminating: held, one read a TERMINATING_MEMORY
        now[0] += Kube.TERMINATING_MEMORY
        with pytest.raises(NamespaceTerminating):
            kube.request("patch", status, body={})
        assert kube.namespace_terminating("ns")
    assert [s.split("?")[0] for s in sent] == ["GET /api/v1/namespaces/ns"] * 3
    for after in ("gone", "new"):
        kube._terminating["ns"] = now[0]
        state[0] = after
        now[0] += Kube.TERMINATING_MEMORY
        assert not kube.namespace_terminating("ns")


def test_no_write_goes_into_a_namespace_the_watch_shows_being_deleted():
    """The namespace watch's news closes the namespace to every write (statuses,
    Events, children) before anything in it is gone, and opens it again when it is
    gone or a new one takes its name. Reads still go."""
    import pytest
    from kubernetes import client

    from spillway_operator.plumbing.kube import Kube, NamespaceTerminating

    sent: list[str] = []

    class Api(client.ApiClient):  # counts what would reach the API server
        def call_api(self, method, url, *args, **kwargs):
            sent.append(f"{method} {url}")
            raise OSError("not sent anywhere in this test")

    kube = Kube(Api())
    ns = {"metadata": {"name": "team-a"}, "status": {"phase": "Active"}}
    kube.observe_namespace("ADDED", ns)
    assert not kube.namespace_terminating("team-a")
    kube.observe_namespace("MODIFIED", {"metadata": {"name": "team-a",
                                                     "deletionTimestamp": "2026-01-01T00:00:00Z"},
                                        "status": {"phase": "Terminating"}})
    assert kube.namespace_terminating("team-a") and not kube.namespace_terminating("team-b")
    for verb in ("patch", "post", "put", "delete"):
        with pytest.raises(NamespaceTerminating, match="team-a is being deleted"):
            kube.request(verb, "/apis/spillway.dev/v1alpha1/namespaces/team-a/"
                         "inferencedeployments/chat/status", body={})
    assert sent == []
    with pytest.raises(Exception, match="unreachable"):  # a read is sent
        kube.request("get", "/api/v1/namespaces/team-a/pods")
    assert len(sent) == 1
    kube.observe_namespace("DELETED", {"metadata": {"name": "team-a"}})
    assert not kube.namespace_terminating("team-a")
    kube.observe_namespace("ADDED", {"metadata": {"name": "team-a",
                                                  "deletionTimestamp": "x"}})
    assert kube.namespace_terminating("team-a")
    kube.observe_namespace("ADDED", ns)  # listed again after a 410: a new namespace
    assert not kube.namespace_terminating("team-a")
