"""The watch cache: versions only move forward, deletes of old incarnations are
ignored, pods are trusted only when their count agrees with the Deployment, and a
reconcile against a warm cache sends no request at all."""

from __future__ import annotations

from spillway_operator.handlers import OWNER_LABEL
from spillway_operator.plumbing.cache import WatchCache
from spillway_operator.plumbing.kube import Kube


def dep(rv: int, replicas: int | None = None, image: str = "a") -> dict:
    body = {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"namespace": "ns", "name": "chat", "resourceVersion": str(rv)},
            "spec": {"template": {"spec": {"containers": [{"name": "e", "image": image}]}}}}
    if replicas is not None:
        body["status"] = {"replicas": replicas}
    return body


def pod(name: str, rv: int = 1, terminating: bool = False) -> dict:
    meta = {"namespace": "ns", "name": name, "resourceVersion": str(rv),
            "labels": {OWNER_LABEL: "chat"}}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta}


def test_a_late_event_never_replaces_a_newer_body():
    cache = WatchCache(OWNER_LABEL)
    cache.remember(dep(7, image="new"))  # the answer to our own apply
    cache.observe(dep(5, image="old"), "MODIFIED")  # the watch catching up
    assert cache.get("apps/v1", "Deployment", "ns", "chat")["metadata"]["resourceVersion"] == "7"
    cache.observe(dep(9, image="hand-edit"), "MODIFIED")
    assert cache.get("apps/v1", "Deployment", "ns", "chat")["metadata"]["resourceVersion"] == "9"


def test_a_delete_removes_it_but_not_a_newer_incarnation():
    cache = WatchCache(OWNER_LABEL)
    cache.observe(dep(5), None)
    cache.observe(dep(6), "DELETED")
    assert cache.get("apps/v1", "Deployment", "ns", "chat") is None
    cache.remember(dep(10))  # re-created by the operator
    cache.observe(dep(6), "DELETED")  # the old delete, delivered late
    assert cache.get("apps/v1", "Deployment", "ns", "chat") is not None


def test_only_news_queues_the_owner_again():
    """The answer to the operator's own write, coming back by the watch, and a status
    moving on a kind whose status no reconcile reads, queue nothing; a hand edit, a
    Deployment's status, a first sight and a delete do."""
    cache = WatchCache(OWNER_LABEL)
    assert cache.observe(dep(5), None)  # first sight
    cache.remember(dep(6, image="b"))  # our apply's answer
    assert not cache.observe(dep(6, image="b"), "MODIFIED")  # ... by the watch
    assert not cache.observe(dep(5), "MODIFIED")  # late
    assert cache.observe(dep(7, replicas=1, image="b"), "MODIFIED")  # the Deployment's status
    assert cache.observe(dep(8, replicas=1, image="hand"), "MODIFIED")
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": {"namespace": "ns", "name": "chat", "resourceVersion": "3"},
           "spec": {"maxUnavailable": 1}}
    assert cache.observe(pdb, None)
    moved = {**pdb, "metadata": {**pdb["metadata"], "resourceVersion": "4",
                                 "managedFields": [{"manager": "kcm"}]},
             "status": {"currentHealthy": 0}}
    assert not cache.observe(moved, "MODIFIED")  # only its status (and bookkeeping)
    edited = {**moved, "metadata": {**moved["metadata"], "resourceVersion": "5"},
              "spec": {"maxUnavailable": 3}}
    assert cache.observe(edited, "MODIFIED")
    assert cache.observe({**edited, "metadata": {**edited["metadata"],
                                                 "resourceVersion": "6"}}, "DELETED")


def test_memo_keeps_the_latest_entries():
    from spillway_operator.plumbing.cache import Memo

    memo = Memo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.get("a") == 1  # now the latest used
    memo.put("c", 3)
    assert (memo.get("a"), memo.get("b"), memo.get("c")) == (1, None, 3)


def test_pods_are_trusted_only_when_the_deployment_agrees():
    cache = WatchCache(OWNER_LABEL)
    owner = ("ns", "chat")
    assert cache.pods(owner, None) == []  # no Deployment, no pods expected
    assert cache.pods(owner, dep(1, replicas=2)) is None  # the watch has not caught up
    cache.observe_pod(pod("a"), None)
    cache.observe_pod(pod("b"), None)
    cache.observe_pod(pod("c", terminating=True), "MODIFIED")  # not counted by the Deployment
    evicted = pod("e")
    evicted["status"] = {"phase": "Failed"}  # nor is a finished one
    cache.observe_pod(evicted, None)
    assert sorted(p["metadata"]["name"] for p in cache.pods(owner, dep(1, replicas=2))) == \
        ["a", "b", "c", "e"]
    cache.observe_pod(pod("b"), "DELETED")
    assert cache.pods(owner, dep(1, replicas=2)) is None
    cache.replace_pods(owner, [pod("a"), pod("d")])
    assert len(cache.pods(owner, dep(1, replicas=2))) == 2


def test_model_configmaps_are_kept_for_their_readers_only():
    cache = WatchCache(OWNER_LABEL)
    cache.read_by("ns", "model", ("ns", "chat"))
    cache.read_by("ns", "model", ("ns", "code"))
    assert cache.readers("ns", "model") == {("ns", "chat"), ("ns", "code")}
    cache.remember({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"namespace": "ns", "name": "model", "resourceVersion": "3"}})
    cache.forget_reader(("ns", "chat"))
    assert cache.get("v1", "ConfigMap", "ns", "model") is not None
    cache.forget_reader(("ns", "code"))
    assert cache.readers("ns", "model") == set()
    assert cache.get("v1", "ConfigMap", "ns", "model") is None


def test_a_steady_reconcile_against_a_warm_cache_sends_nothing():
    cache = WatchCache(OWNER_LABEL)
    kube = Kube(None, cache=cache)  # no API client: any request would raise
    live = dep(4, replicas=0)
    cache.observe(live, None)
    desired = dep(0)
    del desired["metadata"]["resourceVersion"]
    assert kube.ensure(desired) == ("unchanged", live)
    assert kube.get_deployment("ns", "chat") == live
    assert kube.owned_pods(("ns", "chat"), "sel", live) == []


def test_a_status_only_change_is_not_reconciled_again():
    from spillway_operator.controller import only_status_changed

    old = {"metadata": {"generation": 1, "uid": "u", "resourceVersion": "5"},
           "spec": {"replicas": 1, "autoscaling": {"enabled": True}}}
    status_write = {**old, "metadata": {**old["metadata"], "resourceVersion": "6"},
                    "status": {"observedGeneration": 1}}
    assert only_status_changed(old, status_write)
    scaler_write = {**status_write, "status": {"autoscaling": {"pressure": 1.2}}}
    assert not only_status_changed(status_write, scaler_write)  # ScalingActive follows it
    off = {**old, "spec": {"replicas": 1}}  # autoscaling off: the reconciler reads none of it
    assert only_status_changed({**status_write, "spec": off["spec"]},
                               {**scaler_write, "spec": off["spec"]})
    spec_change = {**old, "metadata": {**old["metadata"], "generation": 2}}
    assert not only_status_changed(old, spec_change)
    poked = {**old, "metadata": {**old["metadata"], "annotations": {"poke": "1"}}}
    assert not only_status_changed(old, poked)
    deleting = {**old, "metadata": {**old["metadata"], "deletionTimestamp": "now"}}
    assert not only_status_changed(old, deleting)


def test_the_next_reconcile_sees_the_status_just_written():
    """A reconcile queued again before the watch delivers our status write must
    compare against that write, not the body before it (else it writes again, with
    its Events). The answer replaces the cached body only when it is newer."""
    import asyncio

    from spillway_operator.controller import Controller
    from spillway_operator.flow.reconciler import Result

    seen: list[dict] = []

    class Writer:
        def reconcile(self, body, defer_status=False):
            seen.append(body)
            rv = int(body["metadata"]["resourceVersion"])
            return Result("ok", written={**body, "metadata": {**body["metadata"],
                                                             "resourceVersion": str(rv + 1)},
                                         "status": {"observedGeneration": 1}})

    body = {"metadata": {"namespace": "ns", "name": "a", "generation": 1,
                         "resourceVersion": "5"}}

    async def scenario():
        c = Controller(Writer(), workers=1)
        c.observe(body, "ADDED")
        c.start()
        await asyncio.sleep(0.05)
        c.enqueue(("ns", "a"))  # a child's event, before the watch caught up
        await asyncio.sleep(0.05)
        await c.stop()
        return c.objects[("ns", "a")]

    held = asyncio.run(scenario())
    assert held["metadata"]["resourceVersion"] == "7"  # each write answered newer
    assert [b.get("status") for b in seen] == [None, {"observedGeneration": 1}]


def test_events_wait_while_new_objects_do_but_not_for_ever():
    """A burst of new objects: their children go first, Events after (each held at
    most EVENT_HOLD seconds from its queueing, so a queue that never empties cannot
    silence them, nor hold each Event behind another for a new EVENT_HOLD)."""
    import threading
    import time

    posted: list[tuple[str, float]] = []
    sent = threading.Event()

    class Recording(Kube):
        def request(self, verb, path, body=None, **_):
            posted.append((body["reason"], time.monotonic()))
            sent.set()

    owner = {"apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment",
             "metadata": {"name": "a", "namespace": "ns", "uid": "u"}}
    kube = Recording(None)
    busy = True
    kube.hold_events = lambda: busy
    kube.post_event(owner, "Normal", "PlanComputed", "m")
    time.sleep(0.3)
    assert posted == []  # held while the burst lasts
    busy, released = False, time.monotonic()
    assert sent.wait(2) and posted[0][0] == "PlanComputed" and posted[0][1] >= released

    sent.clear()
    kube2 = Recording(None)
    kube2.EVENT_HOLD = 0.5
    kube2.hold_events = lambda: True  # never quiet
    start = time.monotonic()
    kube2.post_event(owner, "Warning", "OffloadPlanInvalid", "m")
    kube2.post_event(owner, "Normal", "PlanComputed", "m")
    deadline = time.monotonic() + 3
    while len(posted) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r for r, _ in posted[1:]] == ["OffloadPlanInvalid", "PlanComputed"]
    assert posted[1][1] - start >= 0.5
    assert posted[2][1] - start < 0.9  # not a second half second behind the first
