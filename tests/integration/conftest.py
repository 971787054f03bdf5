"""Integration tier: a real kube-apiserver, etcd, controller-manager, scheduler and
KWOK fake GPU nodes, started once per session on free loopback ports.

Missing binaries or a failed start fail the tier loudly (never a skip): CI builds
the binaries first with tools/build.sh.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import ClusterConfig, LocalCluster
from e2e.cluster.controlplane import REPO_ROOT, Ports, free_port, locate_binaries
from tests.helpers import wait_for

# Pod IPs of the test session's cluster: a random 127.N range (the people's cluster,
# e2e/cluster/up, uses 127.1), so sessions and the demo can run side by side.
TEST_POD_NET = f"127.{random.randint(10, 250)}"

# Lines for the end of the pytest report, so CI logs show what the tier ran against.
_CLUSTER_SUMMARY: list[str] = []


# The scenarios are written once: against the local control plane by default, or
# against any cluster whose kubeconfig this names (kind with GPUs, see e2e/kind/). Tests
# that need the local harness itself (KWOK stages, loopback pod IPs served by engine
# simulators, the operator as a local process) are marked local_only and deselected.
E2E_KUBECONFIG = os.environ.get("SPILLWAY_E2E_KUBECONFIG")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    if E2E_KUBECONFIG:
        keep = [i for i in items if not i.get_closest_marker("local_only")]
        dropped = [i for i in items if i.get_closest_marker("local_only")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    if E2E_KUBECONFIG:
        with tempfile.TemporaryDirectory(prefix="spillway-e2e-") as workdir:
            lc = LocalCluster(ClusterConfig(workdir=Path(workdir), ports=Ports.free(),
                                            binaries=locate_binaries(),
                                            external_kubeconfig=Path(E2E_KUBECONFIG)))
            _CLUSTER_SUMMARY.append(f"e2e against the cluster of {E2E_KUBECONFIG}")
            yield lc
        return
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="spillway-it-", dir=base) as workdir:
        lc = LocalCluster(
            ClusterConfig(
                workdir=Path(workdir),
                ports=Ports.free(),
                nodes=3,
                pod_net=TEST_POD_NET,
                binaries=locate_binaries(),
            )
        )
        seconds = lc.start()
        version = lc.kubectl("version", "-o", "json")
        server = json.loads(version)["serverVersion"]["gitVersion"]
        _CLUSTER_SUMMARY.append(
            f"integration tier: real kube-apiserver {server} at {lc.config.server} with "
            f"{lc.config.nodes} KWOK fake GPU nodes, ready in {seconds:.1f}s"
        )
        try:
            yield lc
        finally:
            lc.stop()


@pytest.fixture(scope="session")
def api(cluster: LocalCluster) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(cluster.config.kubeconfig))


@pytest.fixture
def namespace(request, cluster: LocalCluster, api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace per test, with its default ServiceAccount ready."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    name = f"{slug}-{uuid.uuid4().hex[:5]}".strip("-")
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_for(lambda: _has_default_sa(core, name), 30, f"default ServiceAccount in {name}")
    yield name
    core.delete_namespace(name)
    # Wait for the pods to go, so the GPUs they held are free for the next test.
    wait_for(lambda: not core.list_namespaced_pod(name).items, 60, f"pods of {name} to go")


def _has_default_sa(core: client.CoreV1Api, ns: str) -> bool:
    try:
        core.read_namespaced_service_account("default", ns)
    except client.ApiException:
        return False
    return True


def pytest_terminal_summary(terminalreporter):
    for line in _CLUSTER_SUMMARY:
        terminalreporter.write_line(line)


@dataclass
class OperatorProcess:
    proc: subprocess.Popen
    log: Path
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one sample of the operator's /metrics (0 if absent)."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    return sample.value
        return 0.0

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="session")
def crd_installed(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", REPO_ROOT / "crds")
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/inferencedeployments.spillway.dev")


@pytest.fixture(scope="session")
def operator(cluster: LocalCluster, crd_installed, tmp_path_factory) -> Iterator[OperatorProcess]:
    """The operator as a real process, cluster-wide, against the real API server
    (on an external cluster: the one the chart installed there)."""
    if E2E_KUBECONFIG:
        yield None
        return
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    port = free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.config.kubeconfig),
        "SPILLWAY_RESYNC_SECONDS": "20",
        "SPILLWAY_WATCH_TIMEOUT": "60",
        "PYTHONUNBUFFERED": "1",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spillway_operator", "--all-namespaces", "--liveness", "",
             "--metrics-port", str(port), "--verbose"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
        )
    op = OperatorProcess(proc, log, f"http://127.0.0.1:{port}/metrics")
    try:
        wait_for(lambda: proc.poll() is not None or "spillway operator started" in op.log_text(),
                 60, "the operator to start")
        assert proc.poll() is None, op.log_text()[-3000:]
        yield op
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        _CLUSTER_SUMMARY.append(f"operator log: {log}")
