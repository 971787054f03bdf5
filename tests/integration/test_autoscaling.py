"""Autoscaling on offload pressure, end to end on the local control plane: engine
simulators bound to the pods' loopback IPs, load from `spillway loadgen`, and the
operator writing replicas through the scale subresource."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from kubernetes import client

from e2e.cluster.controlplane import REPO_ROOT
from e2e.simfleet import SimulatorFleet
from spillway_engine.planner.model_config import load_local
from spillway_operator.flow.pressure import parse_metrics
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import fresh_namespace, wait_for

# Engine simulators on loopback pod IPs and KWOK gating: the local harness only.
pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.local_only]

INTERVAL = 2
# A small, busy engine: 4 sequences at a time, so a steady request rate queues up.
SIM_ARGS = ["--max-num-seqs", "4", "--gpu-kv-tokens", "16384", "--speed", "1"]


@pytest.fixture
def gated_namespace(api):
    """A namespace whose pods stay unready until the simulator fleet says so."""
    with fresh_namespace(api, f"gated-{uuid.uuid4().hex[:8]}") as name:
        yield name


def setup(api, ns, name, replicas, autoscaling):
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    config = load_local(REPO_ROOT / "tests/fixtures/models/llama-3.2-1b.json")
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="model"), data={"config.json": json.dumps(config)}))
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": "meta-llama/Llama-3.2-1B", "configMapRef": {"name": "model"}},
                 "replicas": replicas, "offload": {"hostMemory": "4Gi"},
                 "autoscaling": {"enabled": True, "intervalSeconds": INTERVAL, **autoscaling}},
    })
    return custom


def get(custom, ns, name):
    return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def condition(obj, ctype):
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == ctype),
                None)


def sim_queue_ratio(url: str) -> float:
    """Waiting per running request, as the engine itself reports it."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=3).read().decode()
    values = parse_metrics(text, time.monotonic()).values
    return values.get("waiting", 0.0) / max(1.0, values.get("running", 0.0))


def test_scales_up_on_pressure_and_waits_for_starting_pods(api, gated_namespace):
    ns, name = gated_namespace, "busy"
    custom = setup(api, ns, name, 1, {"minReplicas": 1, "maxReplicas": 6,
                                      "scaleDownStabilizationSeconds": 600})
    with SimulatorFleet(api, ns, name, SIM_ARGS, load_seconds=10) as fleet:
        wait_for(lambda: get(custom, ns, name).get("status", {}).get("readyReplicas") == 1, 60,
                 "the first pod to load and turn Ready")
        url = wait_for(lambda: fleet.urls() and fleet.urls()[0], 30, "the first simulator")
        load = subprocess.Popen(
            [sys.executable, "-m", "spillway_cli.main", "loadgen", "--url", url, "--trace",
             "chat", "--rate", "30", "--duration", "40", "--arrival", "constant"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # Pressure (queue) above target as the engine itself reports it ...
            wait_for(lambda: sim_queue_ratio(url) > 0.5 * 1.5, 30, "the engine to queue")
            t_high = time.monotonic()
            # ... gives a scale-up within two decision intervals.
            first = wait_for(lambda: (r := get(custom, ns, name)["spec"]["replicas"]) > 1 and r,
                             2 * INTERVAL + 4, "a scale-up")
            assert time.monotonic() - t_high <= 2 * INTERVAL + 4
            # While the new pods load (10 s), pressure stays high but no second scale-up.
            saw_guard = False
            deadline = time.monotonic() + 7
            while time.monotonic() < deadline:
                obj = get(custom, ns, name)
                assert obj["spec"]["replicas"] == first, "scaled up again while pods started"
                reason = obj["status"].get("autoscaling", {}).get("lastDecisionReason", "")
                saw_guard |= "starting pod" in reason
                time.sleep(0.5)
            assert saw_guard, get(custom, ns, name)["status"].get("autoscaling")
        finally:
            load.terminate()
            load.wait(10)
    obj = get(custom, ns, name)
    assert obj["status"]["autoscaling"]["pressure"] is not None
    events = client.CoreV1Api(api).list_namespaced_event(
        ns, field_selector=f"involvedObject.name={name}").items
    assert any(e.reason == "ScaledUp" for e in events)


def test_scales_down_after_the_window_and_never_without_metrics(api, namespace):
    ns, name, window = namespace, "idle", 12
    custom = setup(api, ns, name, 3, {"minReplicas": 1, "maxReplicas": 3,
                                      "scaleDownStabilizationSeconds": window})
    core = client.CoreV1Api(api)
    with SimulatorFleet(api, ns, name, SIM_ARGS) as fleet:
        wait_for(lambda: len(fleet.urls()) == 3, 60, "three simulators")
        # One pod's metrics go unreachable: no scale-down, and the status says why.
        pods = core.list_namespaced_pod(ns, label_selector=f"{GROUP}/inference-deployment={name}")
        fleet.pause(pods.items[0].metadata.name)
        t_idle = time.monotonic()
        cond = wait_for(lambda: (c := condition(get(custom, ns, name), "ScalingActive"))
                        and c["status"] == "False" and c, 30, "ScalingActive=False")
        assert cond["reason"] == "MetricsUnavailable"
        while time.monotonic() < t_idle + window + 3 * INTERVAL:
            assert get(custom, ns, name)["spec"]["replicas"] == 3, "scaled down blind"
            time.sleep(1)

        # Metrics back, still idle: scale down, one pod per decision, never below min.
        fleet.resume_all()
        t_back = time.monotonic()
        wait_for(lambda: get(custom, ns, name)["spec"]["replicas"] == 2, 30,
                 "scale-down to 2", on_timeout=lambda: get(custom, ns, name)["status"])
        assert time.monotonic() - t_back >= INTERVAL  # needs a fresh pair of samples
        wait_for(lambda: get(custom, ns, name)["spec"]["replicas"] == 1, 40, "scale-down to 1")
        obj = get(custom, ns, name)
        assert condition(obj, "ScalingActive")["status"] == "True"
        assert obj["status"]["autoscaling"]["pressure"] < 1.0
        time.sleep(3 * INTERVAL)
        assert get(custom, ns, name)["spec"]["replicas"] == 1


def test_first_idle_scale_down_waits_for_the_window(api, namespace):
    ns, name, window = namespace, "calm", 10
    custom = setup(api, ns, name, 2, {"minReplicas": 1, "maxReplicas": 2,
                                      "scaleDownStabilizationSeconds": window})
    with SimulatorFleet(api, ns, name, SIM_ARGS):
        wait_for(lambda: "pressure" in get(custom, ns, name).get("status", {}).get(
            "autoscaling", {}), 60, "a first pressure reading")
        t_first = time.monotonic()
        wait_for(lambda: get(custom, ns, name)["spec"]["replicas"] == 1, window + 20,
                 "the scale-down")
        assert time.monotonic() - t_first >= window - INTERVAL
