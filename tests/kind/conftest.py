"""kind tier: a kind cluster made from a node image built on this machine
(tools/kind-node.sh), created by e2e/kind/create-cluster.sh as a user creates it, with
the fake-GPU device plugin and LeaderWorkerSet in it (e2e/kind/cluster.py; three
workers: a drain needs somewhere to go), and Spillway installed by e2e/kind/install.sh
from the images tools/images.sh built.

Its own target (``make test-kind``): the cluster, the engine image in three kind nodes and
real engines on 2 cores take 15-25 minutes. It never skips: no docker, no root, a node
image that does not build or a cluster that does not come up fail it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from e2e.cluster import ClusterError
from e2e.cluster.controlplane import locate_binaries
from e2e.install import image_refs
from e2e.kind.cluster import KIND_DIR, KindCluster, KindConfig
from e2e.nodes.images import DOCKER_HOST

WORKDIR = Path(os.environ.get("SPILLWAY_KIND_TIER_DIR", "/tmp/spillway-kind-tier"))
#: SPILLWAY_KIND_KEEP=1: reuse a cluster an earlier session kept and keep this one (its
#: engine image stays loaded: minutes saved per session while working on the tier)
KEEP = os.environ.get("SPILLWAY_KIND_KEEP") == "1"
NAME = "spillway-tier"
_SUMMARY: list[str] = []


@pytest.fixture(scope="session")
def kind_cluster() -> Iterator[KindCluster]:
    try:
        cluster = KindCluster(KindConfig(workdir=WORKDIR, name=NAME, workers=3,
                                         binaries=locate_binaries(real_nodes=True)))
        if not KEEP:
            cluster.stop()  # what a killed session of this tier left
        seconds = cluster.start()
    except ClusterError as exc:
        pytest.fail(f"the kind cluster did not come up: {exc}")
    _SUMMARY.append(f"kind tier: cluster {NAME} up in {seconds:.1f}s ("
                    + ", ".join(f"{k} {v:.1f}s" for k, v in cluster.timings.items()) + ")")
    try:
        yield cluster
    finally:
        if KEEP:
            _SUMMARY.append(f"kind tier: cluster {NAME} kept (SPILLWAY_KIND_KEEP=1)")
        else:
            t0 = time.monotonic()
            cluster.stop()
            _SUMMARY.append(f"kind tier: deleted in {time.monotonic() - t0:.1f}s")


@pytest.fixture(scope="session")
def api(kind_cluster: KindCluster) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(kind_cluster.config.kubeconfig))


@pytest.fixture(scope="session")
def core(api) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture(scope="session")
def installed(kind_cluster: KindCluster) -> dict[str, str]:
    """Spillway's images in the workers (kind load), then e2e/kind/install.sh: the chart
    from the operator image, as the README's kind section runs it."""
    refs = image_refs()
    kind_cluster.kubectl("create", "namespace", "spillway-serving", check=False)
    seconds = kind_cluster.kind_load(refs["operator"], workers_only=True)
    _SUMMARY.append(f"kind tier: kind load docker-image {refs['operator']} in {seconds:.0f}s")
    t0 = time.monotonic()
    loaded = kind_cluster.load_image(refs["engine"])
    _SUMMARY.append(f"kind tier: {refs['engine']} into the workers in "
                    f"{time.monotonic() - t0:.0f}s: {loaded}")
    t0 = time.monotonic()
    done = subprocess.run(
        [str(KIND_DIR / "install.sh"), "--name", NAME, "--no-samples", "--",
         "--set", "image.pullPolicy=Never", "--set", "router.enabled=true",
         "--set", "router.namespace=spillway-serving", "--set", "router.replicas=1",
         "--set", "operator.resources.requests.cpu=50m"],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "DOCKER_HOST": DOCKER_HOST, "OPERATOR_IMAGE": refs["operator"],
             "KUBECONFIG": str(kind_cluster.config.kubeconfig),
             "PATH": f"{Path(kind_cluster.kind).parent}:"
                     f"{kind_cluster.config.binaries['kubectl'].parent}:"
                     f"{kind_cluster.config.binaries['helm'].parent}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-3000:]
    _SUMMARY.append(f"kind tier: e2e/kind/install.sh in {time.monotonic() - t0:.0f}s")
    return refs


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)
