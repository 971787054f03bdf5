"""The people's entry point, ``python -m e2e.cluster`` (wrapped by e2e/cluster/up and
down): idempotent start, clean stop, and clear errors instead of hangs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from e2e.cluster.controlplane import REPO_ROOT, free_port, port_is_free
from e2e.processes import alive

# Needs the local control plane harness itself (not an external cluster).
pytestmark = pytest.mark.local_only

CLI = [sys.executable, "-m", "e2e.cluster"]


def run(*args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def consecutive_free_ports(n: int = 9) -> int:
    for _ in range(50):
        base = free_port()
        if base + n < 65535 and all(port_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def _alive(pid: int) -> bool:
    """The harness's own answer: an exited daemon left a zombie under an init that does
    not reap is dead (no ports, no memory), as ``down`` judges it."""
    return alive(pid)


def test_missing_binary_fails_fast_with_a_clear_message(tmp_path):
    start = time.monotonic()
    proc = run("up", "--dir", str(tmp_path / "c"), "--bin-cache", str(tmp_path / "empty"),
               timeout=60)
    assert proc.returncode == 1
    assert "missing binaries" in proc.stderr
    assert "kube-apiserver" in proc.stderr and "tools/build.sh" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 30


def test_port_in_use_fails_fast_with_a_clear_message(tmp_path, cluster):
    base = consecutive_free_ports()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 2))  # the apiserver's port
        blocker.listen()
        proc = run("up", "--dir", str(tmp_path / "c"), "--port-base", str(base), timeout=60)
    assert proc.returncode == 1
    assert f"{base + 2} (apiserver)" in proc.stderr
    assert "already in use" in proc.stderr
    assert not (tmp_path / "c" / "state.json").exists()


def test_bad_pod_network_is_a_usage_error(tmp_path):
    proc = run("up", "--dir", str(tmp_path / "c"), "--pod-net", "10.1", timeout=60)
    assert proc.returncode == 2
    assert "127.0.0.0/8" in proc.stderr


@pytest.mark.timeout(300)
def test_up_is_idempotent_and_down_leaves_no_process(tmp_path, cluster):
    import json

    workdir = tmp_path / "people"
    base = consecutive_free_ports()
    common = ["--dir", str(workdir), "--port-base", str(base), "--nodes", "1", "--pod-net", "127.3"]
    try:
        first = run("up", *common)
        assert first.returncode == 0, first.stderr
        assert "control plane ready in" in first.stdout
        assert "gpu-node-0" in first.stdout and "NVIDIA-H100-80GB-HBM3" in first.stdout
        kubeconfig = workdir / "kubeconfig"
        assert kubeconfig.exists()
        pids = json.loads((workdir / "state.json").read_text())["pids"]
        assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager",
                             "kube-scheduler", "kwok", "lws-controller"}

        second = run("up", *common)
        assert second.returncode == 0, second.stderr
        assert "already up" in second.stdout
        assert json.loads((workdir / "state.json").read_text())["pids"] == pids

        # The written kubeconfig works for a person's kubectl.
        from e2e.cluster.controlplane import locate_binaries

        nodes = subprocess.run(
            [str(locate_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}", "get", "nodes",
             "-o", "jsonpath={.items[*].status.capacity.nvidia\\.com/gpu}"],
            capture_output=True, text=True, timeout=30,
        )
        assert nodes.stdout.split() == ["8"]
    finally:
        down = run("down", "--dir", str(workdir), "--port-base", str(base))
    assert down.returncode == 0, down.stderr
    assert not any(_alive(int(pid)) for pid in pids.values())
    assert all(port_is_free(base + i) for i in range(9))
    status = run("status", "--dir", str(workdir), "--port-base", str(base))
    assert status.returncode == 1 and "down" in status.stdout


def lws_resources(kubeconfig) -> list[str]:
    from e2e.cluster.controlplane import locate_binaries

    proc = subprocess.run(
        [str(locate_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}", "api-resources",
         "--api-group=leaderworkerset.x-k8s.io", "-o", "name"],
        capture_output=True, text=True, timeout=30, check=True,
    )
    return proc.stdout.split()


@pytest.mark.timeout(300)
def test_no_lws_starts_a_cluster_without_leaderworkerset(tmp_path, cluster):
    """``up --no-lws``: no LWS controller process and no LeaderWorkerSet API (what the
    operator finds on a cluster that never installed LWS); the default has both."""
    import json

    from e2e.cluster.controlplane import free_pod_net

    assert lws_resources(cluster.config.kubeconfig) == ["leaderworkersets.leaderworkerset.x-k8s.io"]
    workdir = tmp_path / "no-lws"
    base = consecutive_free_ports()
    common = ["--dir", str(workdir), "--port-base", str(base), "--nodes", "1",
              "--pod-net", free_pod_net()]
    try:
        up = run("up", "--no-lws", *common)
        assert up.returncode == 0, up.stderr
        state = json.loads((workdir / "state.json").read_text())
        assert set(state["pids"]) == {"etcd", "kube-apiserver", "kube-controller-manager",
                                      "kube-scheduler", "kwok"}
        assert state["lws"] is False
        assert lws_resources(workdir / "kubeconfig") == []
        status = run("status", *common[:4])
        assert status.returncode == 0 and "up:" in status.stdout, status.stdout
    finally:
        down = run("down", "--dir", str(workdir), "--port-base", str(base))
    assert down.returncode == 0, down.stderr
    assert not any(_alive(int(pid)) for pid in state["pids"].values())


def test_the_demo_picks_a_pod_network_no_running_cluster_uses():
    """e2e/demo.py used a fixed 127.7: beside a cluster on 127.7 it bound that cluster's
    pod IPs. free_pod_net() skips KWOK --cidr networks and bound 127.N addresses."""
    from e2e.cluster.controlplane import free_pod_net, pod_nets_in_use

    first = free_pod_net()
    # A stand-in KWOK controller of another cluster on `first`, and a socket on the next.
    fake_kwok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                  f"--cidr={first}.255.0/24"])
    second = free_pod_net(avoid={first})
    sock = socket.socket()
    try:
        sock.bind((f"{second}.0.1", 0))
        sock.listen()
        deadline = time.monotonic() + 10
        while first not in pod_nets_in_use() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {first, second} <= pod_nets_in_use()
        assert free_pod_net() not in {first, second, "127.0", "127.1"}
    finally:
        sock.close()
        fake_kwok.kill()
        fake_kwok.wait()
