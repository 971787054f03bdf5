"""Real-nodes tier: the local control plane with two real nodes (kubelet, containerd,
runc; pod networking, kube-proxy, a fake GPU device plugin), started once per session.

It owns its cluster, in one fixed folder ($SPILLWAY_NODES_TIER_DIR, default
/tmp/spillway-nodes-tier), so a session killed half-way is cleaned up by the next one.
Only one real-node cluster can exist per machine: when another one (e2e/cluster/up
--real-nodes) holds the machine, or another session of this tier runs, the tier fails
with a message saying which. It never skips: no root, a missing host package
(tools/host.sh) or binary (tools/build.sh), or a node that does not come up fail it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from e2e.cluster import ClusterConfig, ClusterError, LocalCluster
from e2e.cluster.controlplane import Ports, locate_binaries
from e2e.nodes.tier import tier_session
from tests.helpers import fresh_namespace, wait_for

WORKDIR = Path(os.environ.get("SPILLWAY_NODES_TIER_DIR", "/tmp/spillway-nodes-tier"))
_SUMMARY: list[str] = []


@pytest.fixture(scope="session")
def tier_lock() -> Iterator[None]:
    """One session of this tier per machine (they would share the folder and nodes)."""
    try:
        with tier_session("another session of tests/nodes"):
            yield
    except ClusterError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def real_cluster(tier_lock) -> Iterator[LocalCluster]:
    try:
        binaries = locate_binaries(real_nodes=True)
    except ClusterError as exc:
        pytest.fail(str(exc))
    lc = LocalCluster(ClusterConfig(workdir=WORKDIR, ports=Ports.free(), nodes=0,
                                    real_nodes=2, binaries=binaries))
    lc.stop()  # what a killed session of this tier left
    shutil.rmtree(WORKDIR, ignore_errors=True)
    try:
        seconds = lc.start()
    except ClusterError as exc:
        pytest.fail(f"the real-node cluster did not start: {exc}")
    _SUMMARY.append(
        f"real-nodes tier: control plane + {lc.config.real_nodes} real nodes ready in "
        f"{seconds:.1f}s (nodes {lc.timings.get('real_nodes', 0):.1f}s) at "
        f"{lc.config.server}; logs in {lc.logs}")
    try:
        yield lc
    finally:
        t0 = time.monotonic()
        lc.stop()
        _SUMMARY.append(f"real-nodes tier: down in {time.monotonic() - t0:.1f}s")


@pytest.fixture(scope="session")
def api(real_cluster: LocalCluster) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(real_cluster.config.kubeconfig))


@pytest.fixture(scope="session")
def core(api) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def namespace(request, api) -> Iterator[str]:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    with fresh_namespace(api, f"{slug}-{uuid.uuid4().hex[:5]}".strip("-")) as name:
        yield name


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)


# ------------------------------------------------------------------- pod helpers


def pod(name: str, command: str, *, node: str | None = None, image: str | None = None,
        limits: dict | None = None, volumes: list | None = None, mounts: list | None = None,
        labels: dict | None = None, restart: str = "Never") -> dict:
    """A one-container busybox pod running ``sh -c command``; ``node`` pins it through
    the scheduler (a nodeSelector on the hostname label, not nodeName)."""
    from e2e.nodes import BUSYBOX_REF

    container = {"name": "c", "image": image or BUSYBOX_REF, "command": ["sh", "-c", command]}
    if limits:
        container["resources"] = {"limits": limits}
    if mounts:
        container["volumeMounts"] = mounts
    spec = {"containers": [container], "restartPolicy": restart,
            "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": True}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if volumes:
        spec["volumes"] = volumes
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {"app": name}}, "spec": spec}


def create(core: client.CoreV1Api, namespace: str, *manifests: dict) -> None:
    for m in manifests:
        core.create_namespaced_pod(namespace, m)


def describe(core: client.CoreV1Api, namespace: str, name: str) -> str:
    p = core.read_namespaced_pod(name, namespace)
    events = core.list_namespaced_event(namespace,
                                        field_selector=f"involvedObject.name={name}").items
    return json.dumps({
        "phase": p.status.phase, "node": p.spec.node_name, "ip": p.status.pod_ip,
        "conditions": [(c.type, c.status, c.reason, c.message)
                       for c in p.status.conditions or []],
        "containers": [str(s.state) for s in p.status.container_statuses or []],
        "events": [f"{e.reason}: {e.message}" for e in events][-8:],
    }, default=str)


def wait_phase(core: client.CoreV1Api, namespace: str, name: str, phases: set[str],
               timeout: float = 90) -> client.V1Pod:
    def check():
        p = core.read_namespaced_pod(name, namespace)
        return p if p.status.phase in phases else None

    return wait_for(check, timeout, f"pod {name} in {sorted(phases)}", interval=0.5,
                    on_timeout=lambda: describe(core, namespace, name))


def logs(core: client.CoreV1Api, namespace: str, name: str) -> str:
    return core.read_namespaced_pod_log(name, namespace)


def finished(core: client.CoreV1Api, namespace: str, name: str, timeout: float = 90) -> str:
    """Wait for the pod to succeed; its log. A failed pod fails with its log and state."""
    p = wait_phase(core, namespace, name, {"Succeeded", "Failed"}, timeout)
    out = ""
    with contextlib.suppress(client.ApiException):
        out = logs(core, namespace, name)
    assert p.status.phase == "Succeeded", (
        f"pod {name} failed: {describe(core, namespace, name)}\nlog:\n{out}")
    return out
