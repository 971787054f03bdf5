"""The InferencePool (Gateway API Inference Extension) per InferenceDeployment: its pure
render, the decision whether to make one, the operator's --endpoint-picker setting, the
reconcile that applies it (and reports status.routing), and the discovery that notices
GIE's CRD coming and going while the operator runs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from spillway_engine.planner.model_config import load_local
from spillway_operator.flow import render, routing
from spillway_operator.flow.reconciler import Reconciler
from spillway_operator.flow.routing import EndpointPicker, parse_endpoint_picker
from spillway_operator.flow.status_model import Routing
from spillway_operator.main import add_arguments
from spillway_operator.plumbing.cache import WatchCache
from spillway_operator.plumbing.kube import Kube
from tests.unit.operator.flow.test_operator_render import OWNER, plan_for, spec_of
from tests.unit.operator.flow.test_operator_status import (
    MODELS,
    STATUS_SCHEMA,
    FakeKube,
    infdep,
    undeclared,
)

PICKER = EndpointPicker("spillway-router", 9002)


# ---------------------------------------------------------------- render


def test_pool_selects_the_engine_pods_on_their_http_port():
    spec = spec_of(offload={"hostMemory": "16Gi"})
    pool = render.inference_pool(OWNER, spec, PICKER)
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1",
                                                  "InferencePool")
    assert pool["metadata"]["name"] == OWNER.name and pool["metadata"]["namespace"] == "team-a"
    dep = render.deployment(OWNER, spec, plan_for(spec))
    selector = pool["spec"]["selector"]["matchLabels"]
    # The Deployment's own selector, which its pods' labels carry, and the router's
    # pod watch (app.kubernetes.io/name=spillway-engine, by InferenceDeployment label).
    assert selector == dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert selector["app.kubernetes.io/name"] == "spillway-engine"
    assert selector["spillway.dev/inference-deployment"] == "chat"
    ports = dep["spec"]["template"]["spec"]["containers"][0]["ports"]
    [port] = [p for p in ports if p["name"] == "http"]  # beside it, the KV-event ports
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "spillway-router", "port": {"number": 9002},
        "failureMode": "FailOpen"}


def test_pool_is_owned_by_its_inference_deployment_and_copies_the_failure_mode():
    spec = spec_of(routing={"endpointPicker": {"failureMode": "FailClose"}})
    pool = render.inference_pool(OWNER, spec, EndpointPicker("epp", 9100, "team-a"))
    (ref,) = pool["metadata"]["ownerReferences"]
    assert ref == {"apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment",
                   "name": "chat", "uid": "uid-123", "controller": True,
                   "blockOwnerDeletion": True}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
    assert pool["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "spillway"


def test_failure_mode_defaults_to_fail_open_and_refuses_other_words():
    assert spec_of().routing.endpoint_picker.failure_mode.value == "FailOpen"
    with pytest.raises(ValueError, match="failureMode"):
        spec_of(routing={"endpointPicker": {"failureMode": "FailSometimes"}})


# ---------------------------------------------------------------- decision and setting


@pytest.mark.parametrize(("picker", "namespace", "served", "want"), [
    (PICKER, "team-a", True, Routing.INFERENCE_POOL),
    (PICKER, "team-a", False, Routing.SPILLWAY_ROUTER),  # no CRD
    (None, "team-a", True, Routing.SPILLWAY_ROUTER),  # no picker configured
    (None, "team-a", False, Routing.SPILLWAY_ROUTER),
    (EndpointPicker("epp", 9002, "team-a"), "team-a", True, Routing.INFERENCE_POOL),
    # An InferencePool names a Service of its own namespace: none where the picker is not.
    (EndpointPicker("epp", 9002, "team-b"), "team-a", True, Routing.SPILLWAY_ROUTER),
])
def test_a_pool_only_with_a_picker_for_the_namespace_and_the_api_served(picker, namespace,
                                                                         served, want):
    assert routing.decide(picker, namespace, served) is want


@pytest.mark.parametrize(("text", "want"), [
    ("spillway-router:9002", EndpointPicker("spillway-router", 9002)),
    ("spillway-system/spillway-router:9002",
     EndpointPicker("spillway-router", 9002, "spillway-system")),
    (" epp:1 ", EndpointPicker("epp", 1)),
])
def test_endpoint_picker_setting_parses(text, want):
    picker = parse_endpoint_picker(text)
    assert picker == want
    assert parse_endpoint_picker(str(picker)) == picker


@pytest.mark.parametrize("text", ["spillway-router", ":9002", "router:0", "router:65536",
                                  "Router:9002", "1router:9002", "a/b/c:9002", "router:90o2",
                                  "ns/:9002"])
def test_endpoint_picker_setting_refuses_what_is_not_a_service_and_port(text):
    with pytest.raises(ValueError, match=r"SERVICE:PORT|not in 1\.\.65535"):
        parse_endpoint_picker(text)


def test_the_command_line_takes_the_picker_from_the_flag_or_the_environment(monkeypatch):
    import argparse

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser.parse_args(["-A", *argv])

    monkeypatch.delenv("SPILLWAY_ENDPOINT_PICKER", raising=False)
    assert parse().endpoint_picker is None
    assert parse("--endpoint-picker", "ns/epp:9002").endpoint_picker == "ns/epp:9002"
    monkeypatch.setenv("SPILLWAY_ENDPOINT_PICKER", "epp:9002")
    assert parse().endpoint_picker == "epp:9002"


def test_a_bad_picker_setting_stops_the_operator_before_it_starts(capsys):
    from spillway_operator.main import main

    assert main(["-A", "--endpoint-picker", "router", "--metrics-port", "0"]) == 2
    assert "SERVICE:PORT" in capsys.readouterr().err


# ---------------------------------------------------------------- the reconcile


class PoolKube(FakeKube):
    """FakeKube with the InferencePool API (served or not) and its failures."""

    def __init__(self, obj: dict[str, Any], served: bool = True):
        super().__init__(obj, load_local(MODELS / "gemma-3-1b-it.json"))
        self.served = served
        self.discoveries: list[float] = []
        self.pool_error: ApiException | None = None
        self.api_changes = 0
        self.gone = 0

    def inference_pools_served(self, max_age: float = 30) -> bool:
        self.discoveries.append(max_age)
        return self.served

    def inference_pools_gone(self) -> None:
        self.gone += 1
        self.served = False

    def ensure(self, desired: dict, *, surely_absent: bool = False) -> tuple[str, dict]:
        if desired["kind"] == "InferencePool" and self.pool_error is not None:
            raise self.pool_error
        return super().ensure(desired, surely_absent=surely_absent)


def test_with_the_api_served_the_reconcile_applies_the_pool_and_says_so():
    obj = infdep()
    kube = PoolKube(obj)
    first = Reconciler(kube, PICKER).reconcile(obj)
    assert first.outcome == "ok"
    assert ("apply", "InferencePool") in kube.writes
    pool = kube.children["InferencePool"]
    assert pool["spec"]["selector"]["matchLabels"] == kube.children["Deployment"]["spec"][
        "selector"]["matchLabels"]
    assert obj["status"]["routing"] == "InferencePool"
    assert undeclared(obj["status"], STATUS_SCHEMA) == []
    # Steady: the same object again writes nothing, the pool included.
    writes = len(kube.writes)
    assert Reconciler(kube, PICKER).reconcile(obj).writes == 0 and len(kube.writes) == writes


def test_a_changed_failure_mode_updates_the_pool_alone():
    obj = infdep()
    kube = PoolKube(obj)
    rec = Reconciler(kube, PICKER)
    rec.reconcile(obj)
    writes = len(kube.writes)
    obj["spec"]["routing"] = {"endpointPicker": {"failureMode": "FailClose"}}
    obj["metadata"]["generation"] = 2
    rec.reconcile(obj)
    assert kube.children["InferencePool"]["spec"]["endpointPickerRef"]["failureMode"] == \
        "FailClose"
    # The pool, and the status's observedGeneration: no other child moved.
    assert [w for w in kube.writes[writes:] if w[0] == "apply"] == [("apply", "InferencePool")]


@pytest.mark.parametrize(("picker", "served"), [(None, True), (PICKER, False),
                                                (EndpointPicker("epp", 9002, "other"), True)])
def test_without_a_picker_or_the_api_no_pool_and_the_status_says_spillway_router(picker,
                                                                                   served):
    obj = infdep()
    kube = PoolKube(obj, served=served)
    result = Reconciler(kube, picker).reconcile(obj)
    assert result.outcome == "ok"
    assert "InferencePool" not in kube.children
    assert obj["status"]["routing"] == "SpillwayRouter"
    if picker is None:  # no picker: not even a discovery request
        assert kube.discoveries == []


def test_the_pool_follows_the_api_when_it_comes_later():
    obj = infdep()
    kube = PoolKube(obj, served=False)
    rec = Reconciler(kube, PICKER, discovery_seconds=7)
    rec.reconcile(obj)
    assert obj["status"]["routing"] == "SpillwayRouter"
    assert kube.discoveries == [7]  # reconciles take an answer up to 7 s old
    kube.served = True  # GIE's CRD installed
    rec.reconcile(obj)
    assert obj["status"]["routing"] == "InferencePool" and "InferencePool" in kube.children
    assert rec.recheck_routing() == kube.api_changes and kube.discoveries[-1] == 0


def test_a_404_on_the_pool_means_the_crd_went_not_an_error():
    obj = infdep()
    kube = PoolKube(obj)
    rec = Reconciler(kube, PICKER)
    rec.reconcile(obj)
    assert obj["status"]["routing"] == "InferencePool"
    kube.pool_error = ApiException(status=404, reason="Not Found")
    obj["metadata"]["generation"] = 2
    result = rec.reconcile(obj)
    assert result.outcome == "ok" and kube.gone == 1
    assert obj["status"]["routing"] == "SpillwayRouter"
    assert {c["type"]: c["status"] for c in obj["status"]["conditions"]}["Degraded"] == "False"


def test_a_forbidden_pool_is_reported_not_crashed_on():
    """An operator role without inferencepools (an older chart): a condition and an
    Event that say so, instead of an exception the controller retries for ever."""
    obj = infdep()
    kube = PoolKube(obj)
    kube.pool_error = ApiException(status=403, reason="Forbidden")
    result = Reconciler(kube, PICKER).reconcile(obj)
    assert result.outcome == "refused"
    degraded = {c["type"]: c for c in obj["status"]["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyRejected")
    assert "InferencePool team-a/chat: HTTP 403" in degraded["message"]
    assert "routing" not in obj["status"]  # nothing known to route to the pods
    assert ("Warning", "ApplyRejected") in kube.events
    assert "Deployment" in kube.children  # the other children went first


# ---------------------------------------------------------------- discovery


def _discovery(kube: Kube, answers: list[dict | None]) -> list[str]:
    asked: list[str] = []

    def get(path: str, **_: Any) -> dict | None:
        asked.append(path)
        return answers.pop(0)

    kube.get = get  # type: ignore[method-assign]
    return asked


POOLS = {"resources": [{"name": "inferencepools"}, {"name": "inferencepools/status"}]}


def test_discovery_is_cached_and_counts_the_api_coming_and_going():
    cache = WatchCache("spillway.dev/inference-deployment")
    kube = Kube(None, cache=cache)
    asked = _discovery(kube, [None, POOLS, POOLS, {"resources": []}])
    assert kube.inference_pools_served() is False  # 404: no such group
    assert kube.inference_pools_served() is False  # cached: no second request
    assert asked == ["/apis/inference.networking.k8s.io/v1"] and kube.api_changes == 0
    assert kube.inference_pools_served(max_age=0) is True  # installed
    assert kube.api_changes == 1
    cache.remember({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                    "metadata": {"namespace": "a", "name": "chat", "resourceVersion": "5"}})
    cache.remember({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"namespace": "a", "name": "chat", "resourceVersion": "6"}})
    assert kube.inference_pools_served(max_age=0) is True and kube.api_changes == 1
    assert kube.inference_pools_served(max_age=0) is False  # the group is there, the kind gone
    assert kube.api_changes == 2
    # The pools went with their CRD: the cache no longer claims them (else a CRD
    # installed again would find its pool "unchanged" and never get it).
    assert cache.get("inference.networking.k8s.io/v1", "InferencePool", "a", "chat") is None
    assert cache.get("v1", "Service", "a", "chat") is not None


def test_a_404_on_a_pool_forgets_the_api_until_discovery_finds_it_again():
    kube = Kube(None, cache=WatchCache("x"))
    _discovery(kube, [POOLS, POOLS])
    assert kube.inference_pools_served() is True
    kube.inference_pools_gone()
    assert kube.api_changes == 1
    assert kube.inference_pools_served() is False  # held, no request
    assert kube.inference_pools_served(max_age=0) is True and kube.api_changes == 2


def test_workers_share_one_inference_pool_discovery():
    from concurrent.futures import ThreadPoolExecutor

    kube = Kube(None)
    asked = []

    def get(path: str, **_: Any) -> dict:
        asked.append(path)
        time.sleep(0.05)  # a slow API server: the other workers arrive meanwhile
        return POOLS

    kube.get = get  # type: ignore[method-assign]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda _: kube.inference_pools_served(), range(8))) == [True] * 8
    assert asked == ["/apis/inference.networking.k8s.io/v1"]


def test_the_controller_reconciles_everything_when_the_api_comes_or_goes():
    from spillway_operator.controller import Controller

    class Recorder:
        endpoint_picker = PICKER

        def __init__(self):
            self.seen: list[str] = []
            self.changes = 0

        def recheck_routing(self) -> int:
            return self.changes

        def reconcile(self, body, defer_status=False):
            self.seen.append(body["metadata"]["name"])

            class Result:
                requeue_after = None
            return Result()

    async def scenario():
        rec = Recorder()
        c = Controller(rec, workers=2, discovery_seconds=0.05)
        for name in ("a", "b"):
            c.observe({"metadata": {"namespace": "ns", "name": name}}, "ADDED")
        c.start()
        await asyncio.sleep(0.3)
        assert sorted(rec.seen) == ["a", "b"]  # the start's reconciles, nothing more
        rec.changes = 1  # GIE's CRD installed
        await asyncio.sleep(0.3)
        assert sorted(rec.seen) == ["a", "a", "b", "b"]
        await asyncio.sleep(0.2)
        assert len(rec.seen) == 4  # once per change
        await c.stop()

    asyncio.run(scenario())


def test_without_a_picker_the_controller_never_asks():
    from spillway_operator.controller import Controller

    class Recorder:
        endpoint_picker = None

        def recheck_routing(self) -> int:
            raise AssertionError("asked about InferencePools without an endpoint picker")

    async def scenario():
        c = Controller(Recorder(), workers=1, discovery_seconds=0.01)
        c.start()
        await asyncio.sleep(0.1)
        await c.stop()

    asyncio.run(scenario())


def test_status_routing_reads_back_typed():
    from spillway_operator.flow.status import read_status

    assert read_status({"routing": "InferencePool"}).routing is Routing.INFERENCE_POOL
    assert read_status({}).routing is None
