"""Faults on the real nodes, at the platform's layer (the engine-level run with
streaming load through spillway-router is ``python -m bench.node_faults``): a serving
pod's kubelet restarted, its containerd killed and restarted, its network cut with
iptables. Each asserts what happens and that everything converges, never how fast.

The pod is busybox's httpd with a readiness probe, asked from the host (every node's
network namespace) five times a second all along.
"""

from __future__ import annotations

import datetime as dt
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from kubernetes import client

from e2e.nodes.faults import NodeFaults
from tests.helpers import wait_for
from tests.nodes.conftest import create, describe, pod, wait_phase

NODE = "spillway-node-a"


class Poller:
    """GETs the pod's page from the host until stopped; counts answers and failures."""

    def __init__(self, url: str) -> None:
        self.url, self.ok, self.failed = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=3) as r:
                    r.read()
                self.ok += 1
            except OSError as e:
                self.failed.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}")
            self._stop.wait(0.2)


@pytest.fixture
def web(core: client.CoreV1Api, namespace: str) -> Iterator[client.V1Pod]:
    manifest = pod("web", "mkdir -p /www && echo up > /www/index.html && "
                          "exec httpd -f -p 8080 -h /www", node=NODE, restart="Always")
    manifest["spec"]["containers"][0]["readinessProbe"] = {
        "httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1, "failureThreshold": 2}
    create(core, namespace, manifest)
    wait_phase(core, namespace, "web", {"Running"})
    yield wait_for(lambda: _ready(core, namespace), 60, "web Ready")


def _ready(core: client.CoreV1Api, namespace: str) -> client.V1Pod | None:
    p = core.read_namespaced_pod("web", namespace)
    ready = any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    return p if ready else None


def _node_ready_since(core: client.CoreV1Api, since: dt.datetime) -> bool:
    """The node Ready with a heartbeat its (restarted) kubelet sent after ``since``."""
    cond = {c.type: c for c in core.read_node(NODE).status.conditions}["Ready"]
    return cond.status == "True" and cond.last_heartbeat_time > since


def _container(p: client.V1Pod) -> tuple[str, int]:
    s = p.status.container_statuses[0]
    return s.container_id, s.restart_count


def test_a_kubelet_restart_leaves_its_pods_running_and_serving(real_cluster, core, namespace,
                                                              web):
    faults = NodeFaults(real_cluster.real_nodes())
    before = _container(web)
    with Poller(f"http://{web.status.pod_ip}:8080/") as poller:
        since = dt.datetime.now(dt.UTC).replace(microsecond=0)
        faults.stop("kubelet", NODE)
        time.sleep(10)
        faults.start("kubelet", NODE)
        wait_for(lambda: _node_ready_since(core, since), 120, "the node's heartbeat again")
        wait_for(lambda: _ready(core, namespace), 60, "web Ready after the restart",
                 on_timeout=lambda: describe(core, namespace, "web"))
        time.sleep(3)
    # The container was never touched: no request failed, same container, no restart.
    assert poller.failed == [], poller.failed
    assert poller.ok > 50
    assert _container(core.read_namespaced_pod("web", namespace)) == before


def test_containerd_killed_and_restarted_the_pod_serves_again(real_cluster, core, namespace,
                                                              web):
    faults = NodeFaults(real_cluster.real_nodes())
    before = _container(web)
    with Poller(f"http://{web.status.pod_ip}:8080/") as poller:
        since = dt.datetime.now(dt.UTC).replace(microsecond=0)
        faults.stop("containerd", NODE, signal.SIGKILL)
        time.sleep(5)
        faults.start("containerd", NODE)
        wait_for(lambda: _node_ready_since(core, since), 120, "the node Ready")
        after = wait_for(lambda: _ready(core, namespace), 120, "web Ready again",
                         on_timeout=lambda: describe(core, namespace, "web"))
        served = poller.ok
        wait_for(lambda: poller.ok > served + 5, 30, "web answering again")
    # containerd's shims hold the containers: killing containerd stops none of them.
    print(f"containerd restart: container {before} -> {_container(after)}, "
          f"{len(poller.failed)} failed GETs of {poller.ok + len(poller.failed)}")
    assert _container(after) == before
    assert poller.failed == [], poller.failed


def test_a_pod_cut_off_the_network_goes_unready_and_comes_back(real_cluster, core, namespace,
                                                                web):
    faults = NodeFaults(real_cluster.real_nodes())
    before = _container(web)
    try:
        faults.cut(web.status.pod_ip)
        # The kubelet's readiness probe (from the host) gets no answer: Ready=False.
        wait_for(lambda: _ready(core, namespace) is None, 60, "web NotReady while cut")
    finally:
        faults.heal()
    wait_for(lambda: _ready(core, namespace), 60, "web Ready once the network is back",
             on_timeout=lambda: describe(core, namespace, "web"))
    with urllib.request.urlopen(f"http://{web.status.pod_ip}:8080/", timeout=5) as r:
        assert r.read().strip() == b"up"
    # A readiness failure restarts nothing.
    assert _container(core.read_namespaced_pod("web", namespace)) == before
