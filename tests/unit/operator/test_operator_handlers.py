"""The kopf wiring's pure parts: settings from the environment, and which
InferenceDeployment a managed child's event re-reconciles."""

from __future__ import annotations

import kopf

from spillway_operator.handlers import OWNER_LABEL, configure, make_controller, owner_key
from spillway_operator.plumbing.kube import Kube


def test_settings_come_from_the_environment():
    settings = kopf.OperatorSettings()
    configure(settings, {"SPILLWAY_WATCH_TIMEOUT": "60"})
    assert settings.posting.enabled is False
    assert (settings.watching.server_timeout, settings.watching.client_timeout) == (60, 90)
    assert settings.persistence.finalizer == "spillway.dev/operator"
    # Only event handlers: kopf keeps no essence of the objects (a deep copy per event).
    from spillway_operator.handlers import NoDiffBase

    assert isinstance(settings.persistence.diffbase_storage, NoDiffBase)
    assert settings.persistence.diffbase_storage.build(body=kopf.Body({"spec": {"a": 1}})) == {}


def test_controller_sizing_comes_from_the_environment():
    c = make_controller(Kube(None), {"SPILLWAY_WORKERS": "2", "SPILLWAY_RESYNC_SECONDS": "7"})
    assert (c.workers, c.resync_seconds) == (2, 7.0) and c.autoscaler is not None


def test_a_child_names_its_owner_by_label():
    assert owner_key("team-a", {OWNER_LABEL: "chat"}) == ("team-a", "chat")
    assert owner_key("team-a", {}) is None
    assert owner_key(None, {OWNER_LABEL: "chat"}) is None


def test_only_a_leading_controller_reconciles_and_a_new_leader_reconciles_everything():
    import asyncio

    from spillway_operator.controller import Controller

    class Recorder:  # the reconciler's place: records what it was asked to reconcile
        def __init__(self):
            self.seen = []

        def reconcile(self, body, defer_status=False):
            self.seen.append(body["metadata"]["name"])

            class Result:
                requeue_after = None
            return Result()

    def body(name):
        return {"metadata": {"namespace": "ns", "name": name}}

    async def scenario():
        rec = Recorder()
        c = Controller(rec, workers=2)
        c.observe(body("a"), "ADDED")  # a standby's watch: cached, not reconciled
        c.observe(body("b"), "ADDED")
        await asyncio.sleep(0.05)
        assert rec.seen == [] and not c.leading
        c.start()  # became the leader
        await asyncio.sleep(0.2)
        assert sorted(rec.seen) == ["a", "b"] and c.leading
        c.pause()  # stopped leading
        assert not c.leading
        c.observe(body("c"), "ADDED")
        await asyncio.sleep(0.1)
        assert "c" not in rec.seen and ("ns", "c") in c.objects
        c.start()
        await asyncio.sleep(0.2)
        assert sorted(rec.seen) == ["a", "a", "b", "b", "c"]
        await c.stop()

    asyncio.run(scenario())


def test_the_autoscaler_runs_only_while_leading_and_a_standby_exports_no_pressure():
    import asyncio

    from spillway_operator.flow.pressure import State
    from spillway_operator.flow.scaler import Autoscaler
    from spillway_operator.plumbing import metrics

    async def scenario():
        s = Autoscaler(Kube(None))  # a standby from the start: nothing runs until activated
        body = {"metadata": {"namespace": "ns", "name": "a", "uid": "u"}, "spec": {}}
        s.observe(("ns", "a"), body)
        assert s._tasks == {} and ("ns", "a") in s.objects
        s.activate()  # became the leader: one loop per known object, fresh windows
        s.objects[("ns", "a")].state = State(observing_since=1.0)
        assert set(s._tasks) == {("ns", "a")}
        metrics.OFFLOAD_PRESSURE.labels("ns", "a").set(0.5)
        s.objects[("ns", "a")].exported = True
        s.deactivate()
        await asyncio.sleep(0)
        assert s._tasks == {}
        assert ("ns", "a") not in {tuple(m.labels.values()) for f in
                                    metrics.OFFLOAD_PRESSURE.collect() for m in f.samples}
        s.activate()
        assert s.objects[("ns", "a")].state is None  # the new term starts from what it observes
        await s.stop()

    asyncio.run(scenario())


def test_a_new_objects_autoscaler_waits_for_its_first_reconcile():
    """Ticking at once read a Deployment and listed pods that did not exist yet, and
    wrote a status, for every new object while its children were being created."""
    import asyncio

    from spillway_operator.flow.scaler import Autoscaler

    async def scenario():
        s = Autoscaler(Kube(None))
        s.activate()
        new = {"metadata": {"namespace": "ns", "name": "a", "uid": "u"},
               "spec": {"autoscaling": {"intervalSeconds": 600}}}
        s.observe(("ns", "a"), new)
        assert s._tasks == {}  # not reconciled yet
        s.observe(("ns", "a"), {**new, "status": {"observedGeneration": 1}})
        assert set(s._tasks) == {("ns", "a")}
        # Its first tick comes a while after, at most 15 s however long the interval.
        assert all(7.5 <= s._first_delay(600) <= 15 for _ in range(50))
        assert 1 <= s._first_delay(2) <= 2
        await s.stop()

    asyncio.run(scenario())


def test_a_burst_of_new_objects_gets_its_children_before_its_statuses():
    """While other new objects wait, a reconcile applies the children and leaves the
    status for later: every Deployment of a burst comes before the burst's status
    writes, and a status written once the Deployment reports is written once."""
    import asyncio

    from spillway_operator.controller import Controller
    from spillway_operator.flow.reconciler import Result

    calls: list[tuple[str, bool]] = []

    class Recorder:
        def reconcile(self, body, defer_status=False):
            calls.append((body["metadata"]["name"], defer_status))
            return Result("ok", deferred=defer_status)

    async def scenario():
        c = Controller(Recorder(), workers=1)
        for name in ("a", "b", "c"):
            c.observe({"metadata": {"namespace": "ns", "name": name, "generation": 1}},
                      "ADDED")
        c.start()
        await asyncio.sleep(0.1)
        await c.stop()

    asyncio.run(scenario())
    # a and b deferred while others waited; c had nobody behind it; then the statuses.
    assert calls == [("a", True), ("b", True), ("c", False), ("a", False), ("b", False)]


def test_the_handlers_keep_the_process_state_in_one_record_in_kopfs_memo():
    """No module-level state: the controller and the cache reach the handlers through
    the Running record startup puts in kopf's memo; before startup and after cleanup
    the handlers do nothing."""
    import asyncio

    from spillway_operator import handlers
    from spillway_operator.plumbing.cache import WatchCache

    mutable = [name for name, value in vars(handlers).items()
               if isinstance(value, (dict, list, set)) and not name.startswith("__")]
    assert mutable == []

    deployment = kopf.Body({"apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment",
                            "metadata": {"namespace": "ns", "name": "chat", "generation": 1}})

    async def scenario():
        memo = kopf.Memo()
        await handlers.on_inference_deployment(body=deployment, type="ADDED", memo=memo)
        state = handlers.Running(make_controller(Kube(None), {}), WatchCache(OWNER_LABEL))
        memo.running = state
        await handlers.on_inference_deployment(body=deployment, type="ADDED", memo=memo)
        assert ("ns", "chat") in state.controller.objects
        await handlers.on_inference_deployment(body=deployment, type="DELETED", memo=memo)
        assert ("ns", "chat") not in state.controller.objects
        await handlers.cleanup(memo=memo)
        assert handlers.running(memo) is None
        await handlers.cleanup(memo=memo)  # a second cleanup finds nothing to stop

    asyncio.run(scenario())
