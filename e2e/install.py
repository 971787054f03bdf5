"""Spillway on real nodes as a user installs it: the images built from the
repository's Dockerfile (tools/images.sh) loaded into the nodes' containerd, the Helm
chart from them (operator with leader election, router), a model folder on a volume
the engine pods mount, and an InferenceDeployment on the emulated GPU that requests
the fake GPUs the nodes' device plugin advertises.

Used by the real-nodes tier (tests/nodes) and by the demo (e2e/demo.py). Only the GPU
is emulated: the kubelet, containerd and runc start the engine image's container with
the plan mounted, the memory-backed /dev/shm, the memory limit, the probes and the
preStop drain.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.controlplane import REPO_ROOT, ClusterError, LocalCluster

RELEASE = "spillway"
RELEASE_NAMESPACE = "spillway-system"
MODELS_MOUNT = "/models"


def image_refs() -> dict[str, str]:
    """operator/engine refs tools/images.sh built (it prints them; --refs builds nothing)."""
    done = subprocess.run([str(REPO_ROOT / "tools" / "images.sh"), "--refs"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClusterError(f"tools/images.sh --refs failed: {done.stderr.strip()[-500:]}")
    refs = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return {"operator": refs["operator"], "engine": refs["engine"]}


def load_images(refs: dict[str, str]) -> dict[str, dict[str, str]]:
    """Both images into every real node (a node that holds the same image id is skipped)."""
    from e2e.nodes import load_image

    # All nodes from one docker save where the disk holds it (load_image checks), else
    # one node at a time.
    return {"operator": load_image(refs["operator"]), "engine": load_image(refs["engine"])}


def helm_install(cluster: LocalCluster, operator_ref: str, serving_namespace: str,
                 *extra: str, release_namespace: str = RELEASE_NAMESPACE) -> None:
    """The chart as a user installs it, from the locally built operator image (it is in
    every node's containerd: pull policy Never, there is no registry); the router routes
    to ``serving_namespace``'s engine pods."""
    repo, _, tag = operator_ref.rpartition(":")
    helm = cluster.config.binaries["helm"]
    cmd = [str(helm), "upgrade", "--install", RELEASE, str(REPO_ROOT / "charts" / "spillway"),
           "--kubeconfig", str(cluster.config.kubeconfig), "-n", release_namespace,
           "--create-namespace", "--wait", "--timeout", "5m",
           "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
           "--set", "image.pullPolicy=Never",
           "--set", "router.enabled=true", "--set", f"router.namespace={serving_namespace}",
           "--set", "router.replicas=1", "--set", "operator.resources.requests.cpu=50m",
           *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pods = cluster.kubectl("get", "pods", "-n", release_namespace, "-o", "wide",
                               check=False)
        raise ClusterError(f"helm install failed: {done.stderr.strip()[-1500:]}\n{pods}")


def model_volume(cluster: LocalCluster, namespace: str, name: str, model_dir: Path) -> None:
    """A PersistentVolume over the model folder on this machine (both real nodes share
    its filesystem) and a claim bound to it, read by the engine pods as weights.pvc.
    The folder, its parent and its files are made readable by the engine's user (1000)."""
    for p in [model_dir.parent, model_dir, *model_dir.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    pv = f"{namespace}-{name}"[:63]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                  "hostPath": {"path": str(model_dir), "type": "Directory"},
                  "claimRef": {"namespace": namespace, "name": name}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": name, "namespace": namespace},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]))


def model_config_map(cluster: LocalCluster, namespace: str, name: str,
                     config: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
        "data": {"config.json": json.dumps(config)}}))


def on_real_nodes(sample: dict[str, Any], engine_ref: str, claim: str) -> dict[str, Any]:
    """An InferenceDeployment (an emulated-GPU sample) made to run on the real nodes:
    the locally built engine image, the model from ``claim``, the planned GPUs requested
    from the device plugin, and a CPU request the 2-core nodes can hold."""
    obj = json.loads(json.dumps(sample))
    spec = obj["spec"]
    spec["engine"]["image"] = engine_ref
    spec["engine"].setdefault("emulateGPU", {})["requestGPUs"] = True
    spec["weights"] = {"source": "pvc", "pvc": {"claimName": claim, "path": MODELS_MOUNT}}
    spec.setdefault("resources", {})["cpu"] = "250m"
    return obj


def wait(predicate, timeout: float, what: str, interval: float = 1.0, on_timeout=None):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            extra = f": {on_timeout()}" if on_timeout else ""
            raise ClusterError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(interval)
