"""The InferencePool per InferenceDeployment, against a real API server that serves the
Gateway API Inference Extension's own CRD (v1.2.0, from its Go module: tools/build.sh).

A control plane of its own: GIE's CRD is cluster-scoped and is installed and removed
here while the operator runs, and this operator (with --endpoint-picker) must be the
only one reconciling; the session's cluster-wide operator would fight it over status.

The operator starts before the CRD exists: no pool, status.routing SpillwayRouter, no
error. Then the CRD is installed and, without a restart (discovery every second;
resync far away), every InferenceDeployment in the picker's namespace gets a pool the
API server accepted under GIE's schema (read back: selector, ports, picker, failure
mode, owner), a changed failureMode updates it, the garbage collector removes it with
its owner, and the CRD's removal (and return) is followed the same way.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from e2e.cluster.controlplane import (
    GIE_INFERENCE_POOL_CRD,
    REPO_ROOT,
    ClusterConfig,
    LocalCluster,
    Ports,
    free_pod_net,
    locate_binaries,
    locate_gie_crds,
)
from e2e.operator_process import OperatorProcess, start_operator
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import fresh_namespace, wait_for
from tests.integration.conftest import TEST_POD_NET
from tests.integration.test_operator import Env, infdep, model_configmap
from tests.integration.test_steady_state import writes_into

pytestmark = pytest.mark.local_only  # its own control plane and operator process

POOL_GROUP, POOL_VERSION, POOLS = "inference.networking.k8s.io", "v1", "inferencepools"
POOL_CRD = f"{POOLS}.{POOL_GROUP}"
PICKER_SERVICE, PICKER_PORT = "spillway-router", 9002


@pytest.fixture(scope="module")
def gie_crd() -> Path:
    """GIE's real InferencePool CRD; missing fails the module, naming tools/build.sh."""
    return locate_gie_crds() / GIE_INFERENCE_POOL_CRD


@pytest.fixture(scope="module")
def plane(gie_crd) -> Iterator[LocalCluster]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="spillway-pool-", dir=base) as workdir:
        lc = LocalCluster(ClusterConfig(workdir=Path(workdir), ports=Ports.free(), nodes=1,
                                        pod_net=free_pod_net(avoid={TEST_POD_NET}),
                                        binaries=locate_binaries()))
        lc.start()
        try:
            lc.kubectl("apply", "--server-side", "-f", REPO_ROOT / "crds")
            lc.wait_established(f"{PLURAL}.{GROUP}")
            yield lc
        finally:
            lc.stop()


@pytest.fixture(scope="module")
def api(plane) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(plane.config.kubeconfig))


@pytest.fixture(scope="module")
def team(api) -> Iterator[str]:
    """The endpoint picker's namespace: InferenceDeployments here get pools."""
    with fresh_namespace(api, f"pool-team-{uuid.uuid4().hex[:5]}") as ns:
        yield ns


@pytest.fixture(scope="module")
def elsewhere(api) -> Iterator[str]:
    """Another namespace: no picker Service there, so no pools."""
    with fresh_namespace(api, f"pool-other-{uuid.uuid4().hex[:5]}") as ns:
        yield ns


@pytest.fixture(scope="module")
def operator(plane, team, elsewhere, tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("pool-operator") / "operator.log"
    op = start_operator(plane.config.kubeconfig, log, verbose=True,
                        extra_args=["--endpoint-picker",
                                    f"{team}/{PICKER_SERVICE}:{PICKER_PORT}"],
                        # Only the discovery may bring the pools: no resync in the test's time.
                        env={"SPILLWAY_DISCOVERY_SECONDS": "1", "SPILLWAY_RESYNC_SECONDS": "3600",
                             "SPILLWAY_WATCH_TIMEOUT": "60"})
    try:
        yield op
    finally:
        op.stop()
        print(f"operator log: {log}")


@pytest.fixture(scope="module")
def envs(api, plane, team, elsewhere) -> tuple[Env, Env]:
    env, other = Env(api, team, plane), Env(api, elsewhere, plane)
    for e in (env, other):
        model_configmap(e.core, e.ns, "model", "gemma-3-1b-it.json")
    return env, other


def pool(env: Env, name: str) -> dict | None:
    try:
        return env.custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, env.ns, POOLS,
                                                       name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def routing(env: Env, name: str) -> str | None:
    return (env.get(name).get("status") or {}).get("routing")


def wait_routing(env: Env, name: str, want: str, timeout: float = 30) -> None:
    wait_for(lambda: routing(env, name) == want, timeout, f"{env.ns}/{name} routing {want}",
             on_timeout=lambda: env.get(name).get("status"))


def no_traceback(op: OperatorProcess) -> None:
    text = op.log_text()
    assert op.proc.poll() is None, text[-3000:]
    assert "Traceback" not in text, text[text.index("Traceback") - 2000:][:5000]
    assert text.count("spillway operator started") == 1  # never restarted


def install_crd(plane: LocalCluster, crd: Path) -> None:
    plane.kubectl("apply", "--server-side", "-f", crd)
    plane.wait_established(POOL_CRD)


def remove_crd(plane: LocalCluster) -> None:
    plane.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait", "--timeout=60s")


def test_without_gie_crd_no_pool_and_status_says_spillway_router(plane, operator, envs):
    env, _ = envs
    remove_crd(plane)
    env.create(infdep("early"))
    env.wait_condition("early", "Available", "True")
    wait_routing(env, "early", "SpillwayRouter")
    # The API really is absent (not merely unlisted): the server has no such resource.
    proc = subprocess.run([str(plane.config.binaries["kubectl"]),
                           f"--kubeconfig={plane.config.kubeconfig}", "get", POOLS, "-A"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "doesn't have a resource type" in proc.stderr, proc.stderr
    time.sleep(3)  # three discovery rounds that find nothing, quietly
    assert routing(env, "early") == "SpillwayRouter"
    no_traceback(operator)
    assert not re.search(rf'"(POST|PATCH) /apis/{POOL_GROUP}/', operator.log_text())


def test_gie_crd_installed_later_gives_pools_followed_to_the_end(plane, operator, envs,
                                                                   gie_crd):
    env, other = envs
    remove_crd(plane)  # as the first test left it (and the same when run alone)
    if not _exists(env, "early"):
        env.create(infdep("early"))
    env.wait_condition("early", "Available", "True")
    other.create(infdep("elsewhere"))
    other.wait_condition("elsewhere", "Available", "True")
    wait_routing(other, "elsewhere", "SpillwayRouter")

    # Installed while the operator runs: the object already there gets its pool.
    install_crd(plane, gie_crd)
    wait_routing(env, "early", "InferencePool")
    early = pool(env, "early")
    assert early is not None
    owner = env.get("early")
    dep = env.apps.read_namespaced_deployment("early", env.ns)
    spec = early["spec"]
    # The engine pods' labels: the Deployment's selector, which selects exactly its pods.
    assert spec["selector"]["matchLabels"] == dep.spec.selector.match_labels
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    pods = env.core.list_namespaced_pod(env.ns, label_selector=selector).items
    assert [p.metadata.owner_references[0].name for p in pods] and all(
        p.metadata.labels["spillway.dev/inference-deployment"] == "early" for p in pods)
    # the http port; beside it the KV-event ports, which the pool does not target
    (port,) = [p for p in dep.spec.template.spec.containers[0].ports if p.name == "http"]
    assert spec["targetPorts"] == [{"number": port.container_port}]
    # GIE's schema defaulted the group: the API server applied its real schema.
    assert spec["endpointPickerRef"] == {"group": "", "kind": "Service", "name": PICKER_SERVICE,
                                         "port": {"number": PICKER_PORT},
                                         "failureMode": "FailOpen"}
    (ref,) = early["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "InferenceDeployment", "early", owner["metadata"]["uid"], True)
    # ... and the schema has teeth: what it forbids is refused.
    bad = json.loads(json.dumps(early))
    bad["metadata"] = {"name": "bad"}
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(client.ApiException) as refused:
        env.custom.create_namespaced_custom_object(POOL_GROUP, POOL_VERSION, env.ns, POOLS, bad)
    assert refused.value.status == 422 and "FailSometimes" in refused.value.body

    # A new object gets its pool from its first reconcile; another namespace gets none
    # (the picker's Service is in this one).
    env.create(infdep("late", routing={"endpointPicker": {"failureMode": "FailClose"}}))
    wait_routing(env, "late", "InferencePool")
    assert pool(env, "late")["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert routing(other, "elsewhere") == "SpillwayRouter"
    assert not other.custom.list_namespaced_custom_object(POOL_GROUP, POOL_VERSION, other.ns,
                                                          POOLS)["items"]

    # Steady state: nothing is written while nothing changes (the discovery asks every
    # second, the pools are not re-applied).
    env.wait_condition("late", "Available", "True")
    # (The autoscaler's first word, "autoscaling is off", comes up to an interval, 15 s,
    # after an object's first reconcile: not a write of this feature's.)
    for e, name in ((env, "early"), (env, "late"), (other, "elsewhere")):
        wait_for(lambda e=e, n=name: (e.get(n).get("status") or {}).get("autoscaling"), 30,
                 f"{name}'s status.autoscaling")
    time.sleep(2)
    start = len(operator.log_text())
    time.sleep(5)
    writes = writes_into(operator.log_text()[start:], {env.ns, other.ns})
    assert writes == [], "\n".join(writes)

    # failureMode edited: the pool follows.
    env.patch("early", {"spec": {"routing": {"endpointPicker": {"failureMode": "FailClose"}}}})
    wait_for(lambda: pool(env, "early")["spec"]["endpointPickerRef"]["failureMode"]
             == "FailClose", 30, "the pool's failureMode to follow the spec")

    # Deleted: the garbage collector takes the pool with its owner (it learns of a CRD
    # installed after it started on its next discovery round, up to 30 s).
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "early")
    wait_for(lambda: pool(env, "early") is None, 120, "the garbage collector to take the pool")

    # GIE's CRD removed while running: its pools went with it, the status says so ...
    remove_crd(plane)
    wait_routing(env, "late", "SpillwayRouter")
    # ... and installed again, the pool comes back (nothing stale remembered).
    install_crd(plane, gie_crd)
    wait_routing(env, "late", "InferencePool")
    assert pool(env, "late")["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    no_traceback(operator)


def _exists(env: Env, name: str) -> bool:
    try:
        env.get(name)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_a_gateway_built_from_the_pool_follows_its_pods(plane, operator, envs, api,
                                                        gie_crd, tmp_path):
    """e2e.gateway.PoolGateway reads the operator's pool (GIE's real API), runs Envoy with
    the picker it names and keeps the endpoints to the pool's Ready pods: requests go
    through Envoy and the picker (spillway-router --epp-port watching the namespace) to
    simulator engines on the pods' IPs, and a scale-up's pod is picked once Ready."""
    import os
    import sys
    import urllib.error
    import urllib.request

    from e2e.engine_process import free_port, kill_group
    from e2e.gateway.pool import PoolGateway
    from e2e.simfleet import ENGINE_PORT, SimulatorFleet

    env, _ = envs
    install_crd(plane, gie_crd)
    env.create(infdep("served", replicas=1))
    wait_routing(env, "served", "InferencePool", timeout=60)
    epp_port = free_port()
    router = None
    with SimulatorFleet(api, env.ns, "served") as fleet:
        try:
            router_port = free_port()
            router = subprocess.Popen(
                [str(Path(sys.executable).with_name("spillway-router")), "--host", "127.0.0.1",
                 "--port", str(router_port), "--epp-port", str(epp_port), "--mode", "approx",
                 "--kube-namespace", env.ns, "--probe-interval", "0.5"],
                stdout=(tmp_path / "router.log").open("wb"), stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "KUBECONFIG": str(plane.config.kubeconfig)})
            wait_for(lambda: len(fleet.urls()) == 1, 120, "the first engine")
            with PoolGateway(api, env.ns, "served", tmp_path / "gateway", port=free_port(),
                             admin_port=free_port(), picker=f"127.0.0.1:{epp_port}",
                             interval_s=0.5).start() as gateway:
                assert gateway.endpoints == [f"{fleet.sims[p].ip}:{ENGINE_PORT}"
                                             for p in fleet.sims]
                # the pool says FailOpen (the spec's default): Envoy fails open
                assert '"failure_mode_allow": true' in (
                    tmp_path / "gateway" / "envoy.json").read_text()

                def complete(seed: int) -> str:
                    body = json.dumps({"model": "google/gemma-3-1b-it", "max_tokens": 2,
                                       "prompt": [seed % 400 + 3] * 64}).encode()
                    req = urllib.request.Request(gateway.url + "/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                    try:
                        with urllib.request.urlopen(req, timeout=60) as r:
                            return r.headers.get("x-spillway-upstream", "")
                    except urllib.error.HTTPError as e:
                        raise AssertionError(f"{e.code}: {e.read()[:500]!r}") from None

                def answered() -> bool:
                    try:
                        return complete(1) != ""
                    except AssertionError:
                        return False  # 404 until the picker's pod watch has the pod

                wait_for(answered, 60, "a completion through the gateway",
                         interval=0.5,
                         on_timeout=lambda: (
                             (tmp_path / "router.log").read_text()[-2000:],
                             urllib.request.urlopen(
                                 f"http://127.0.0.1:{router_port}/healthz").read(),
                             plane.kubectl("get", "pods", "-A", "-o", "wide", "--show-labels")))
                env.patch("served", {"spec": {"replicas": 2}})
                wait_for(lambda: len(gateway.endpoints) == 2, 120,
                         "the gateway to list the scale-up's pod", interval=0.5)

                def picker_ready() -> int:
                    with urllib.request.urlopen(
                            f"http://127.0.0.1:{router_port}/healthz", timeout=10) as r:
                        return sum(json.loads(r.read())["ready_pods"].values())

                wait_for(lambda: picker_ready() == 2, 120, "the picker to probe both engines",
                         interval=0.5)
                upstreams = {complete(seed) for seed in range(40)}
                # the picker's cold prompts spread by consistent hashing: both pods answer
                assert upstreams == set(gateway.endpoints), (upstreams, gateway.endpoints)
        finally:
            if router is not None:
                kill_group(router)
    no_traceback(operator)
