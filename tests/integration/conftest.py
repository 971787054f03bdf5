"""Integration tier: a real kube-apiserver, etcd, controller-manager, scheduler and
KWOK fake GPU nodes, started once per session on free loopback ports.

Missing binaries or a failed start fail the tier loudly (never a skip): CI builds
the binaries first with tools/build.sh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from e2e.cluster import ClusterConfig, LocalCluster
from e2e.cluster.controlplane import REPO_ROOT, Ports, locate_binaries, pod_net_share
from e2e.operator_process import OperatorProcess, start_operator
from tests.helpers import SECOND_GPU, fresh_namespace, wait_for

# Pod IPs of the test session's cluster: a random 127.N range (the people's cluster,
# e2e/cluster/up, uses 127.1), so sessions and the demo can run side by side; from this
# process's share when pytest-xdist runs several (make test), so no two workers' networks meet.
TEST_POD_NET = f"127.{random.choice([n for n in pod_net_share() if n >= 10])}"

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
    with fresh_namespace(api, f"{slug}-{uuid.uuid4().hex[:5]}".strip("-")) as name:
        yield name


def pytest_terminal_summary(terminalreporter):
    for line in _CLUSTER_SUMMARY:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def crd_installed(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", REPO_ROOT / "crds")
    cluster.wait_established("inferencedeployments.spillway.dev")


@pytest.fixture(scope="session")
def operator(cluster: LocalCluster, crd_installed, tmp_path_factory) -> Iterator[OperatorProcess]:
    """The operator as a real process, cluster-wide, against the real API server
    (on an external cluster: the one the chart installed there)."""
    if E2E_KUBECONFIG:
        yield None
        return
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = start_operator(cluster.config.kubeconfig, log, verbose=True,
                        env={"SPILLWAY_RESYNC_SECONDS": "20", "SPILLWAY_WATCH_TIMEOUT": "60"})
    try:
        yield op
    finally:
        op.stop()
        _CLUSTER_SUMMARY.append(f"operator log: {log}")


#: The GPU of the ``second_node`` fixture's node (tests.helpers.SECOND_GPU).
SECOND = SECOND_GPU


@pytest.fixture
def second_node(cluster: LocalCluster) -> Iterator[dict]:
    """One more KWOK node, of SECOND, made as the cluster makes its nodes: the next
    index (its own pod CIDR) with GFD's product, compute capability and memory labels
    from the catalogue; removed afterwards."""
    config = cluster.config
    more = dataclasses.replace(config, nodes=config.nodes + 1,
                               gpu_products=("h100",) * config.nodes + (SECOND,))
    node = LocalCluster(more).node_manifests()[-1]
    name = node["metadata"]["name"]
    cluster.kubectl("apply", "--server-side", "--field-manager=spillway-harness", "-f", "-",
                    input=json.dumps(node))
    wait_for(lambda: "True" in cluster.kubectl(
        "get", "node", name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
        check=False), 60, f"{name} Ready")
    try:
        yield node
    finally:
        cluster.kubectl("delete", "node", name, "--timeout=60s", check=False)
