"""Faults the operator must survive, one of each, against a control plane of their own
(these tests stop its kube-apiserver and kill its etcd, which the session's shared
cluster must not see):

- kube-apiserver stopped for 30 s in the middle of a rollout, then started again;
- etcd killed (SIGKILL) in the middle of a rollout and started again 10 s later:
  in both, the operator process stays up (no exit, no restart, no traceback), its
  watches resume (work created after the fault and pods that turn Ready after it are
  seen without a resync) and every InferenceDeployment converges with exactly one
  Deployment, Service and plan ConfigMap;
- the children deleted or edited by hand (Deployment, Service, plan ConfigMap, PDB): each
  is repaired from its watch event, not from a periodic resync;
- objects whose plan is refused or whose model config cannot be read, among valid
  ones: the valid ones converge, the refused ones are not retried, the unreadable
  ones retry with back-off and say why in their condition.

The operator runs with a 10-minute resync, longer than any test here: what it
repairs or converges, it does from its watches. bench/faults repeats each fault and
prints the figures; nothing here is timed.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from e2e.cluster.controlplane import (
    REPO_ROOT,
    ClusterConfig,
    LocalCluster,
    Ports,
    free_pod_net,
    locate_binaries,
)
from e2e.operator_process import OperatorProcess, start_operator
from spillway_operator.flow.spec import GROUP
from tests.helpers import fresh_namespace, wait_for
from tests.integration.conftest import TEST_POD_NET
from tests.integration.test_operator import Env, infdep, model_configmap

pytestmark = pytest.mark.local_only  # stops and kills parts of a local control plane

OWNER_LABEL = f"{GROUP}/inference-deployment"
MANAGED_BY = "app.kubernetes.io/managed-by"


@pytest.fixture(scope="module")
def plane() -> Iterator[LocalCluster]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="spillway-faults-", dir=base) as workdir:
        # The nodes' leases go unrenewed while the API server is down: without the
        # longer grace the node controller marks every pod not Ready for good (KWOK
        # plays no kubelet that would mark them Ready again).
        lc = LocalCluster(ClusterConfig(workdir=Path(workdir), ports=Ports.free(), nodes=2,
                                        pod_net=free_pod_net(avoid={TEST_POD_NET}),
                                        binaries=locate_binaries(),
                                        node_monitor_grace_seconds=300))
        lc.start()
        try:
            lc.kubectl("apply", "--server-side", "-f", REPO_ROOT / "crds")
            lc.wait_established("inferencedeployments.spillway.dev")
            yield lc
        finally:
            lc.stop()


@pytest.fixture
def env(plane, request) -> Iterator[Env]:
    api = config.new_client_from_config(config_file=str(plane.config.kubeconfig))
    slug = request.node.name.lower().replace("_", "-").replace("[", "-").strip("]-")[:30]
    with fresh_namespace(api, f"{slug}-{uuid.uuid4().hex[:5]}".strip("-")) as ns:
        e = Env(api, ns, plane)
        model_configmap(e.core, ns, "model", "gemma-3-1b-it.json")
        yield e


@pytest.fixture
def operator(plane, env, tmp_path) -> Iterator[OperatorProcess]:
    op = start_operator(plane.config.kubeconfig, tmp_path / "operator.log", verbose=True,
                        scope=["-n", env.ns],
                        env={"SPILLWAY_RESYNC_SECONDS": "600", "SPILLWAY_WATCH_TIMEOUT": "60"})
    yield op
    if op.proc.poll() is None:
        op.stop()
    print(f"operator log: {op.log}")


def available(env: Env, name: str) -> bool:
    obj = env.get(name)
    status = obj.get("status") or {}
    conds = {c["type"]: c["status"] for c in status.get("conditions", [])}
    return (status.get("observedGeneration") == obj["metadata"]["generation"]
            and conds.get("Available") == "True")


def children(env: Env) -> dict[str, list]:
    sel = OWNER_LABEL
    return {
        "Deployment": env.apps.list_namespaced_deployment(env.ns, label_selector=sel).items,
        "Service": env.core.list_namespaced_service(env.ns, label_selector=sel).items,
        "ConfigMap": env.core.list_namespaced_config_map(env.ns, label_selector=sel).items,
    }


def assert_one_child_each(env: Env, names: list[str]) -> None:
    """Each InferenceDeployment owns exactly one Deployment, Service and plan
    ConfigMap, and nothing managed is left without an owner."""
    uids = sorted(env.get(n)["metadata"]["uid"] for n in names)
    for kind, items in children(env).items():
        owners = sorted(r.uid for i in items for r in (i.metadata.owner_references or []))
        assert owners == uids, (kind, [i.metadata.name for i in items])


def explain(env: Env, names: list[str]) -> dict:
    """What the objects that are not Available say, and their pods."""
    out = {}
    for n in names:
        if not available(env, n):
            st = env.get(n).get("status") or {}
            pods = env.core.list_namespaced_pod(env.ns, label_selector=f"{OWNER_LABEL}={n}")
            out[n] = {"status": {k: st.get(k) for k in ("observedGeneration", "replicas",
                                                        "readyReplicas")},
                      "conditions": [(c["type"], c["status"], c["reason"])
                                     for c in st.get("conditions", [])],
                      "pods": [(p.metadata.name, p.status.phase, [
                          (c.type, c.status) for c in p.status.conditions or []])
                          for p in pods.items]}
            # KWOK plays the kubelet: what it said of a pod it has not run is the cause.
            log = env.cluster.workdir / "logs" / "kwok.log"
            stuck = [p.metadata.name for p in pods.items if p.status.phase != "Running"]
            out[n]["kwok"] = [line[-400:] for line in log.read_text().splitlines()
                              if any(s in line for s in stuck) and '"level":"DEBUG"' not in line
                              ][-5:] if stuck and log.is_file() else []
    return out


def assert_stayed_up(op: OperatorProcess) -> None:
    """The operator survived: still running, started once, no traceback in its log."""
    assert op.proc.poll() is None, op.log_text()[-4000:]
    text = op.log_text()
    assert text.count("spillway operator started") == 1
    assert "Traceback" not in text, text[text.index("Traceback") - 2000:][:6000]


def writes(op: OperatorProcess) -> float:
    return sum(op.metric("spillway_operator_api_requests_total", verb=v)
               for v in ("patch", "post", "delete"))


def settle(op: OperatorProcess, quiet: float = 5.0) -> None:
    """Wait until the operator has neither reconciled nor written for ``quiet`` s."""
    def activity() -> float:
        return writes(op) + op.metric("spillway_operator_reconciles_total")

    last, since = activity(), time.monotonic()
    deadline = since + 90
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "the operator never went quiet"
        time.sleep(0.5)
        if (now := activity()) != last:
            last, since = now, time.monotonic()


# ------------------------------------------------------------------ outages


def _apiserver_outage(plane: LocalCluster) -> str:
    return f"kube-apiserver down {plane.restart_apiserver(30):.0f}s"


def _etcd_crash(plane: LocalCluster) -> str:
    return f"etcd SIGKILLed, API ready again after {plane.restart_etcd(10, kill=True):.0f}s"


@pytest.mark.parametrize("fault", [_apiserver_outage, _etcd_crash], ids=["apiserver-30s",
                                                                          "etcd-sigkill"])
def test_the_operator_rides_out_a_control_plane_outage_mid_rollout(env, operator, fault):
    first = [f"a{i}" for i in range(12)]
    for name in first:
        env.create(infdep(name, replicas=1))
    # Midway: some Deployments made, most pods not Ready yet, statuses still to write.
    wait_for(lambda: len(env.apps.list_namespaced_deployment(env.ns).items) >= 4, 60,
             "the first Deployments of the rollout")
    what = fault(env.cluster)
    assert operator.proc.poll() is None, operator.log_text()[-4000:]
    # Work that only the resumed watch of InferenceDeployments can bring in.
    second = [f"b{i}" for i in range(3)]
    for name in second:
        env.create(infdep(name, replicas=1))
    names = first + second
    wait_for(lambda: all(available(env, n) for n in names), 120,
             f"every InferenceDeployment Available after the fault ({what})",
             interval=1, on_timeout=lambda: explain(env, names))
    assert_one_child_each(env, names)
    assert_stayed_up(operator)
    if fault is _apiserver_outage:  # felt: requests refused, retried (etcd's restart
        text = operator.log_text()  # may hide behind the API server's own waiting)
        assert "failed; will retry" in text or "retrying with back-off" in text, text[-3000:]
    print(f"\n{what}")


# ------------------------------------------------------------------ hand edits


def _kubectl_patch(env: Env, kind: str, name: str, patch: dict, how: str = "merge") -> None:
    env.kubectl("patch", kind, name, f"--type={how}", "-p", json.dumps(patch))


def test_children_deleted_or_edited_by_hand_are_repaired(env, operator):
    # The autoscaler's tick writes status.autoscaling, and that event reconciles the
    # owner: once at start, then not for 10 minutes, so only the child's events count.
    env.create(infdep("gemma", replicas=1, autoscaling={"intervalSeconds": 600}))
    wait_for(lambda: available(env, "gemma"), 90, "gemma Available")
    dep = env.deployment("gemma")
    image = dep.spec.template.spec.containers[0].image
    svc = env.core.read_namespaced_service("gemma", env.ns)
    plan = env.core.read_namespaced_config_map("gemma-plan", env.ns).data

    def deployment_ok() -> bool:
        d = env.deployment("gemma")
        return bool(d and d.spec.replicas == 1
                    and d.spec.template.spec.containers[0].image == image
                    and (d.metadata.labels or {}).get(OWNER_LABEL) == "gemma"
                    and (d.metadata.labels or {}).get(MANAGED_BY) == "spillway")

    def service_ok() -> bool:
        try:
            s = env.core.read_namespaced_service("gemma", env.ns)
        except client.ApiException:
            return False
        return s.spec.selector == svc.spec.selector and [p.port for p in s.spec.ports] == [
            p.port for p in svc.spec.ports]

    def uid(kind: str, name: str) -> str | None:
        out = env.kubectl("get", kind, name, "-o", "jsonpath={.metadata.uid}", check=False)
        return out or None

    def configmap_ok() -> bool:
        try:
            return env.core.read_namespaced_config_map("gemma-plan", env.ns).data == plan
        except client.ApiException:
            return False

    def budget_ok() -> bool:
        return uid("poddisruptionbudget", "gemma") is not None

    # Labels removed (first, while nothing else moves: no pod event can stand in for
    # the child's own): the operator's label-selected watch sees the Deployment leave
    # (DELETED), its owner reads it afresh and puts the labels back.
    wait_for(lambda: (env.get("gemma").get("status") or {}).get("autoscaling"), 60,
             "the autoscaler's first status")
    settle(operator)
    _kubectl_patch(env, "deployment", "gemma",
                   {"metadata": {"labels": {OWNER_LABEL: None, MANAGED_BY: None}}})
    wait_for(deployment_ok, 60, "the Deployment's labels restored")

    # Deleted: recreated (a new object).
    for kind, name, ok in (("deployment", "gemma", deployment_ok),
                           ("service", "gemma", service_ok),
                           ("configmap", "gemma-plan", configmap_ok),
                           ("poddisruptionbudget", "gemma", budget_ok)):
        old_uid = uid(kind, name)
        env.kubectl("delete", kind, name, "--wait=true")
        wait_for(lambda k=kind, n=name, o=old_uid, f=ok: f() and uid(k, n) not in (None, o),
                 60, f"the {kind} recreated")

    # Edited: what the operator applies is restored, after an update (kubectl patch) ...
    container = dep.spec.template.spec.containers[0].name
    edits = [
        ("deployment", "gemma", {"spec": {"replicas": 3}}, deployment_ok),
        ("deployment", "gemma", {"spec": {"template": {"spec": {"containers": [
            {"name": container, "image": "busybox:hand"}]}}}}, deployment_ok),
        # spec.selector is an atomic map: the added key replaces the operator's.
        ("service", "gemma", {"spec": {"selector": {"app": "elsewhere"}}}, service_ok),
        ("configmap", "gemma-plan", {"data": {"plan.json": "{}"}}, configmap_ok),
    ]
    for kind, name, patch, ok in edits:
        _kubectl_patch(env, kind, name, patch, "strategic" if kind == "deployment" else "merge")
        wait_for(ok, 60, f"{kind}/{name} restored after the hand edit {patch}")

    # ... and by another field manager's forced server-side apply (it took the field).
    manifest = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "gemma-plan", "namespace": env.ns},
                "data": {"plan.json": '{"hand": true}'}}
    env.cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=hand",
                        "-f", "-", input=json.dumps(manifest))
    wait_for(configmap_ok, 60, "the plan ConfigMap restored after a forced apply")

    wait_for(lambda: available(env, "gemma"), 90, "gemma Available again")

    # An env var another manager added to the engine container stays after our apply
    # (env merges by name): no difference, so reconciles after it write nothing (before,
    # each one applied the Deployment again, for ever).
    _kubectl_patch(env, "deployment", "gemma", {"spec": {"template": {"spec": {"containers": [
        {"name": container, "env": [{"name": "BY_HAND", "value": "1"}]}]}}}}, "strategic")
    wait_for(lambda: available(env, "gemma"), 90, "gemma Available with the added env")
    settle(operator)
    before = writes(operator)
    for poke in ("1", "2"):
        _kubectl_patch(env, "inferencedeployment", "gemma",
                       {"metadata": {"annotations": {"poke": poke}}})
        settle(operator)
    assert writes(operator) == before
    env_names = [e.name for e in env.deployment("gemma").spec.template.spec.containers[0].env]
    assert "BY_HAND" in env_names
    assert_one_child_each(env, ["gemma"])
    assert_stayed_up(operator)
    for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget"):
        assert operator.metric("spillway_operator_child_writes_total", kind=kind,
                               action="created") >= 2, kind  # the first and the repair


def test_a_changed_model_config_re_plans_from_its_watch(env, operator):
    """The model ConfigMap a spec names is watched: a new config.json re-plans at once,
    not at the next resync (10 minutes here)."""
    from spillway_engine.planner.model_config import load_local
    from tests.integration.test_operator import MODELS

    env.create(infdep("gemma", replicas=0))
    wait_for(lambda: (env.get("gemma").get("status") or {}).get("plan"), 60, "a plan")
    before = env.core.read_namespaced_config_map("gemma-plan", env.ns).data["plan.json"]
    first_plan = env.get("gemma")["status"]["plan"]
    env.core.patch_namespaced_config_map("model", env.ns, {"data": {"config.json": json.dumps(
        load_local(MODELS / "gemma-3-12b-it.json"))}})
    wait_for(lambda: env.core.read_namespaced_config_map("gemma-plan", env.ns)
             .data["plan.json"] != before, 60, "the plan of the new config.json")
    # The status follows: the new plan's summary (other layers, other capacity).
    wait_for(lambda: env.get("gemma")["status"]["plan"] != first_plan, 60, "the new plan summary")
    assert_stayed_up(operator)


# ------------------------------------------------------------------ invalid among valid


def test_invalid_plans_do_not_hold_up_valid_ones(env, operator):
    """10 invalid objects created first (5 whose plan is refused, 5 whose model config
    does not exist), then 20 valid ones."""
    refused = [f"refused{i}" for i in range(5)]
    missing = [f"missing{i}" for i in range(5)]
    valid = [f"ok{i}" for i in range(20)]
    for name in refused:
        env.create(infdep(name, replicas=0, host_memory="1Ki"))
    for name in missing:
        env.create(infdep(name, replicas=0, config_map=f"absent-{name}"))
    started = time.monotonic()
    for name in valid:
        env.create(infdep(name, replicas=0))

    def converged(name: str) -> bool:
        c = env.condition(name, "PlanReady")
        return bool(c and c["status"] == "True" and env.deployment(name)
                    and env.get(name)["status"].get("observedGeneration") == 1)

    wait_for(lambda: all(converged(n) for n in valid), 120, "the valid objects converged",
             interval=1, on_timeout=lambda: [n for n in valid if not converged(n)])
    for name in refused:
        env.wait_condition(name, "PlanReady", "False", "OffloadPlanInvalid")
    for name in missing:
        env.wait_condition(name, "PlanReady", "False", "ModelConfigUnavailable")
    assert not any(env.deployment(n) for n in refused + missing)

    # Keep watching the unreadable ones for a while: they are retried, with back-off.
    retries0 = operator.metric("spillway_operator_reconciles_total", outcome="retry")
    time.sleep(30)
    retries = operator.metric("spillway_operator_reconciles_total", outcome="retry")
    elapsed = time.monotonic() - started
    assert retries > retries0, "the objects without a model config are not retried"
    # At most one try per object every 5 s (the floor of its back-off), plus the first.
    assert retries <= len(missing) * (elapsed / 5 + 2), (retries, elapsed)
    refused_total = operator.metric("spillway_operator_reconciles_total", outcome="refused")
    # A refused plan is not retried: one reconcile each, and one more for the status
    # write's own watch event at most.
    assert refused_total <= 2 * len(refused), refused_total
    assert_one_child_each(env, valid)
    assert_stayed_up(operator)
