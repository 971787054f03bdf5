"""Two operator replicas, one writer: leader election on a coordination.k8s.io/v1 Lease
against the real API server, with the chart's ServiceAccount token (as the chart runs
them; the chart is installed with its operator scaled to 0 so its RBAC is what the
processes get).

- one leader, visible in the Lease, its log and ``spillway_operator_leader``; the other
  stands by;
- the leader killed with SIGKILL in the middle of a rollout: the standby takes over and
  every InferenceDeployment converges, each with exactly one Deployment, Service and
  plan ConfigMap owned by it;
- the leader paused with SIGSTOP (as a frozen process or a partition looks to the
  others): the standby takes over no earlier than a lease duration after the last
  renew, and the old leader, resumed, sends no write and stands by.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime

import pytest
from kubernetes import client

from e2e.operator_process import OperatorProcess, start_operator
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import wait_for
from tests.integration.test_chart import (  # noqa: F401 - fixtures
    CHART,
    RELEASE,
    _adopt_crd,
    _sa_kubeconfig,
    bins,
    fence,
    helm,
    helm_env,
    infdep,
    model_configmap,
    work_namespace,
)

pytestmark = pytest.mark.local_only

LEASE = "spillway-leader"
WRITE_VERBS = ("patch", "post", "delete")  # children, status, scale, Events (not the Lease's put)


@pytest.fixture
def release(helm, cluster, namespace, work_namespace) -> Iterator[tuple[str, str]]:  # noqa: F811
    """The chart installed for ``work_namespace``, operator scaled to 0: its RBAC only."""
    _adopt_crd(cluster, namespace)
    helm("install", RELEASE, CHART, "-n", namespace, "--set", "operator.replicas=0",
         "--set", f"watchNamespaces={{{work_namespace}}}", "--wait", "--timeout", "60s")
    try:
        yield namespace, work_namespace
    finally:
        helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s", check=False)


@pytest.fixture
def replicas(cluster, release, tmp_path) -> Iterator:
    """Starts operator replicas named by the caller, with the chart's ServiceAccount."""
    release_ns, work = release
    kubeconfig = _sa_kubeconfig(cluster, release_ns, RELEASE, tmp_path / "sa.kubeconfig")
    started: list[OperatorProcess] = []

    def start(identity: str) -> OperatorProcess:
        op = start_operator(
            kubeconfig, tmp_path / f"{identity}.log", verbose=True, scope=["-n", work],
            env={"SPILLWAY_RESYNC_SECONDS": "5", "SPILLWAY_WATCH_TIMEOUT": "60"},
            extra_args=["--leader-elect", "--leader-election-namespace", release_ns,
                        "--leader-election-id", LEASE, "--leader-election-identity",
                        identity])
        started.append(op)
        return op

    yield start
    for op in started:
        if op.proc.poll() is None:
            os.kill(op.proc.pid, signal.SIGCONT)
            op.stop()


def lease(cluster, ns: str) -> dict:
    return json.loads(cluster.kubectl("get", "lease", LEASE, "-n", ns, "-o", "json"))["spec"]


def micro(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def writes(op: OperatorProcess) -> float:
    return sum(op.metric("spillway_operator_api_requests_total", verb=v) for v in WRITE_VERBS)


def available(custom, ns: str, name: str) -> bool:
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    conds = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions", [])}
    return conds.get("Available") == "True"


def assert_one_child_each(api, ns: str, names: list[str]) -> None:
    """Every InferenceDeployment owns exactly one Deployment, Service and plan ConfigMap."""
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    custom = client.CustomObjectsApi(api)
    uids = {n: custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, n)["metadata"][
        "uid"] for n in names}
    for kind, items in (("Deployment", apps.list_namespaced_deployment(ns).items),
                        ("Service", core.list_namespaced_service(ns).items),
                        ("ConfigMap", [c for c in core.list_namespaced_config_map(ns).items
                                       if c.metadata.name.endswith("-plan")])):
        owners = [r.uid for i in items for r in (i.metadata.owner_references or [])]
        assert sorted(owners) == sorted(uids.values()), (kind, [i.metadata.name for i in items])
        orphans = [i.metadata.name for i in items if not i.metadata.owner_references]
        assert not orphans, (kind, orphans)


def test_one_leader_and_the_standby_takes_over_after_sigkill(cluster, api, release, replicas,
                                                             fence):  # noqa: F811
    release_ns, work = release
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    custom = client.CustomObjectsApi(api)

    a = replicas("op-a")
    wait_for(a.leader, 30, "op-a to lead")
    b = replicas("op-b")
    wait_for(lambda: "the leader is op-a; standing by" in b.log_text(), 30, "op-b to stand by")
    spec = lease(cluster, release_ns)
    assert spec["holderIdentity"] == "op-a" and spec["leaseDurationSeconds"] == 15
    assert "became the leader: op-a holds lease" in a.log_text()
    assert not b.leader() and "became the leader" not in b.log_text()
    transitions = spec.get("leaseTransitions", 0)

    model_configmap(core, work, "model", "gemma-3-1b-it.json")
    fence()  # from here on only the ServiceAccount's operators can write the results
    first = [f"m{i}" for i in range(3)]
    for name in first:
        custom.create_namespaced_custom_object(GROUP, VERSION, work, PLURAL, infdep(name))
    # Midway through the rollout: the leader has made the Deployments, the pods are not
    # all ready (its status writes are still to come).
    wait_for(lambda: len(apps.list_namespaced_deployment(work).items) >= 2, 60,
             "op-a's first Deployments")
    assert writes(b) == 0  # the standby wrote nothing
    # ... and tried nothing: no reconcile or autoscaler loop ran there for its gate to stop.
    assert b.metric("spillway_operator_writes_fenced_total") == 0
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    killed = time.monotonic()
    # More work arrives while nobody leads.
    second = [f"n{i}" for i in range(3)]
    for name in second:
        custom.create_namespaced_custom_object(GROUP, VERSION, work, PLURAL, infdep(name))

    wait_for(b.leader, 40, "op-b to take over")
    took_over = time.monotonic() - killed
    spec = lease(cluster, release_ns)
    assert spec["holderIdentity"] == "op-b"
    assert spec["leaseTransitions"] == transitions + 1
    assert "(the lease of op-a expired)" in b.log_text()

    names = first + second
    wait_for(lambda: all(available(custom, work, n) for n in names), 120,
             f"all InferenceDeployments Available after the failover (log: {b.log})")
    assert_one_child_each(api, work, names)
    assert b.metric("spillway_operator_child_writes_total", action="created",
                    kind="Deployment") >= len(second)
    for needle in (" 403 ", "Forbidden", "Not enough permissions"):
        assert needle not in b.log_text(), needle
    print(f"\nleader SIGKILL -> standby leading: {took_over:.1f}s")  # a figure, not a check


def test_a_paused_leader_stops_writing_before_the_standby_takes_over(cluster, api, release,
                                                                     replicas, fence):  # noqa: F811
    release_ns, work = release
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    a = replicas("op-a")
    wait_for(a.leader, 30, "op-a to lead")
    b = replicas("op-b")
    wait_for(lambda: "standing by" in b.log_text(), 30, "op-b to stand by")

    model_configmap(core, work, "model", "gemma-3-1b-it.json")
    fence()
    custom.create_namespaced_custom_object(GROUP, VERSION, work, PLURAL, infdep("gemma"))
    wait_for(lambda: available(custom, work, "gemma"), 90, "gemma Available under op-a")
    a_writes = writes(a)
    assert a_writes > 0

    os.kill(a.proc.pid, signal.SIGSTOP)  # frozen mid-flight: no renew, no step-down either
    stopped_spec = lease(cluster, release_ns)
    wait_for(b.leader, 40, "op-b to take over from the frozen op-a")
    spec = lease(cluster, release_ns)
    assert spec["holderIdentity"] == "op-b"
    # The standby waited a whole lease duration after the last renew it could have seen.
    assert micro(spec["acquireTime"]) >= micro(stopped_spec["renewTime"]) + 15

    # Work that needs writes, while op-a is still frozen and then after it wakes.
    core.delete_namespaced_service("gemma", work)
    os.kill(a.proc.pid, signal.SIGCONT)
    wait_for(lambda: "stopped leading lease" in a.log_text(), 20, "op-a to notice it lost")
    wait_for(lambda: "the leader is op-b; standing by" in a.log_text(), 20,
             "op-a to follow op-b")
    wait_for(lambda: core.read_namespaced_service("gemma", work), 30,
             "op-b to repair the Service")
    time.sleep(7)  # a resync period of op-a's (5 s) passes: it would have reconciled
    assert not a.leader()
    # Not one write left the old leader after it was frozen past its renew deadline
    # (whatever it tried was refused by its own gate and counted as fenced).
    assert writes(a) == a_writes
    assert lease(cluster, release_ns)["holderIdentity"] == "op-b"
    assert b.leader()


def test_a_leader_stopped_gracefully_hands_the_lease_over(cluster, release, replicas):
    release_ns, _ = release
    a = replicas("op-a")
    wait_for(a.leader, 30, "op-a to lead")
    b = replicas("op-b")
    wait_for(lambda: "standing by" in b.log_text(), 30, "op-b to stand by")
    a.stop()  # SIGTERM: stop writing, then release the Lease
    assert "released lease" in a.log_text()
    wait_for(b.leader, 30, "op-b to take the released Lease")
    # Taken because it was released (at the standby's next retry), not because it expired.
    assert "(the lease was released)" in b.log_text()
    assert lease(cluster, release_ns)["holderIdentity"] == "op-b"


def test_a_leader_that_cannot_renew_stops_writing_at_its_renew_deadline(cluster, api, release,
                                                                        replicas, fence):  # noqa: F811
    """The leader can still reach the API server and write children, but can no longer
    renew its Lease (update revoked from the chart's Lease role): past its renew
    deadline it must stop writing on its own, with nobody else there to tell it."""
    release_ns, work = release
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    a = replicas("op-a")
    wait_for(a.leader, 30, "op-a to lead")
    model_configmap(core, work, "model", "gemma-3-1b-it.json")
    fence()
    custom.create_namespaced_custom_object(GROUP, VERSION, work, PLURAL, infdep("gemma"))
    wait_for(lambda: available(custom, work, "gemma"), 90, "gemma Available under op-a")

    role = f"{RELEASE}-leader-election"

    def lease_verbs(verbs: list[str]) -> None:
        cluster.kubectl("patch", "role", role, "-n", release_ns, "--type=json", "-p",
                        json.dumps([{"op": "replace", "path": "/rules/0/verbs",
                                     "value": verbs}]))
    lease_verbs(["get", "create"])
    wait_for(lambda: "stopped leading lease" in a.log_text(), 40,
             "op-a to stop leading at its renew deadline")
    assert "no renew within the renew deadline (10s)" in a.log_text()
    assert not a.leader()
    assert lease(cluster, release_ns)["holderIdentity"] == "op-a"  # nobody took it
    a_writes = writes(a)

    # Work that needs a write: op-a sees it (its watch and resync run) but must not act.
    core.delete_namespaced_service("gemma", work)
    time.sleep(7)  # longer than op-a's resync period (5 s)
    assert not core.list_namespaced_service(work).items
    assert writes(a) == a_writes

    # Renewing works again: op-a's own Lease is still valid for it; it leads and repairs.
    lease_verbs(["get", "create", "update"])
    wait_for(lambda: a.log_text().count("became the leader: op-a") == 2, 30, "op-a to lead again")
    wait_for(lambda: core.list_namespaced_service(work).items, 30, "op-a to repair the Service")
