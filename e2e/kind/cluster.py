"""A kind cluster from a node image built on this machine, with what Spillway's users
install on a GPU cluster before Spillway: a device plugin advertising the GPUs, GPU
Feature Discovery's labels, and LeaderWorkerSet from its release manifests.

    cluster = KindCluster(KindConfig(workdir=Path("/tmp/spillway-kind")))
    cluster.start()                  # node image (cached), cluster, add-ons, host routes
    cluster.kind_load("spillway-operator:local", workers_only=True)     # kind load
    cluster.load_image("spillway-engine:local-cpu")  # the same, layer blobs freed after
    cluster.kubectl("get", "nodes")
    cluster.stop()                   # e2e/kind/delete-cluster.sh: cluster, routes

``KindCluster`` answers what the demo and the install helpers ask of the local
control plane (``config.kubeconfig``, ``config.workdir``, ``config.binaries``,
``kubectl``, ``wait_established``, ``running``, ``start``, ``stop``), so the same demo
runs on either. Everything here goes through the user-facing paths: ``kind create
cluster`` (e2e/kind/create-cluster.sh), ``kind load``, ``kubectl apply`` of manifests.

The GPUs are fake: the project's device plugin (tools/node/gpuplugin) runs as a
DaemonSet in the workers and advertises ``nvidia.com/gpu`` to their kubelets, as
NVIDIA's does on a GPU node; the workers carry GFD's labels for an H100.

The host reaches pod IPs and ClusterIPs through routes to the kind nodes' addresses on
docker's network that create-cluster.sh --host-routes adds (each node's podCIDR via that
node; the Service range via a worker, whose kube-proxy answers it), as the real nodes'
pod network is reached here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from e2e.cluster.controlplane import REPO_ROOT, ClusterError, locate_binaries, read_versions
from e2e.cluster.gfd import gfd_labels
from e2e.install import wait
from e2e.nodes import ociimage
from e2e.nodes.images import DOCKER, DOCKER_HOST, load_image

KIND_DIR = REPO_ROOT / "e2e" / "kind"
GPU_PRODUCT = "h100"
GPUS_PER_NODE = 8
DEVICE_PLUGIN_NAMESPACE = "kube-system"
LWS_NAMESPACE = "lws-system"


@dataclass
class KindConfig:
    workdir: Path
    name: str = "spillway"
    workers: int = 2
    #: kubectl and helm from tools/build.sh (the local control plane's names)
    binaries: dict[str, Path] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"


def _lines(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


class KindCluster:
    def __init__(self, config: KindConfig) -> None:
        self.config = config
        self.workdir = config.workdir
        self.timings: dict[str, float] = {}
        self._kind: str | None = None

    # ------------------------------------------------------------------ tools

    def _env(self) -> dict[str, str]:
        kubectl = self.config.binaries["kubectl"]
        return {**os.environ, "DOCKER_HOST": DOCKER_HOST,
                "PATH": f"{Path(self.kind).parent}:{kubectl.parent}:{os.environ['PATH']}"}

    def _run(self, cmd: list[str], step: str, timeout: float = 600,
             input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              input=input, env=self._env(), check=False)
        if check and proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
            raise ClusterError(f"{step}: {' '.join(map(str, cmd[:4]))} ... failed: {tail}")
        return proc

    @property
    def kind(self) -> str:
        """kind as tools/kind-node.sh names it: tools/build.sh's kind, run against
        Spillway's docker daemon with its nodes on the runc wrapper."""
        if self._kind is None:
            self._kind = self.node_image_refs(build=False)["kind"]
        return self._kind

    @staticmethod
    def node_image_refs(build: bool = True) -> dict[str, str]:
        """tools/kind-node.sh's NAME=VALUE lines: ``node_image`` and ``kind``; it builds
        the node image (and kind) when ``build`` and they are not cached."""
        cmd = [str(REPO_ROOT / "tools" / "kind-node.sh"), *([] if build else ["--refs"])]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              env={**os.environ, "DOCKER_HOST": DOCKER_HOST})
        if done.returncode != 0:
            raise ClusterError(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                               else f"{cmd[0]} failed ({done.returncode})")
        return _lines(done.stdout)

    def kubectl(self, *args: str | Path, check: bool = True, input: str | None = None) -> str:
        proc = subprocess.run(
            [str(self.config.binaries["kubectl"]), f"--kubeconfig={self.config.kubeconfig}",
             *map(str, args)], capture_output=True, text=True, input=input, timeout=120)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(map(str, args))} failed: {proc.stderr.strip()}")
        return proc.stdout

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        for name in (c.removeprefix("crd/") for c in crds):
            wait(lambda n=name: self.kubectl(
                "get", "crd", n, "-o",
                "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                check=False) == "True", timeout, f"the {name} CRD Established")

    # ------------------------------------------------------------------ lifecycle

    def running(self) -> bool:
        try:
            out = self._run([self.kind, "get", "clusters"], "list kind clusters", 60).stdout
        except (ClusterError, KeyError, OSError):
            return False
        return self.config.name in out.split()

    def start(self, timeout: float = 600) -> float:
        """The node image (cached), the cluster with its host routes (kept when it
        runs), the fake GPUs and LeaderWorkerSet; returns the seconds it took."""
        t0 = time.monotonic()
        if not self.config.binaries:
            self.config.binaries = locate_binaries()
        self.workdir.mkdir(parents=True, exist_ok=True)
        refs = self.node_image_refs(build=True)
        self._kind = refs["kind"]
        self.timings["node_image"] = time.monotonic() - t0
        if not self.running():
            t1 = time.monotonic()
            self._run([str(KIND_DIR / "create-cluster.sh"), "--local-image", "--host-routes",
                       "--name", self.config.name, "--workers", str(self.config.workers),
                       "--extra-mount", str(self.workdir),
                       "--kubeconfig", str(self.config.kubeconfig)],
                      "create the kind cluster", timeout)
            self.timings["cluster"] = time.monotonic() - t1
        else:  # a kept cluster: its routes and forwarding are still there
            self.config.kubeconfig.write_text(self._run(
                [self.kind, "get", "kubeconfig", "--name", self.config.name],
                "read the cluster's kubeconfig", 60).stdout)
        self.config.kubeconfig.chmod(0o600)
        t1 = time.monotonic()
        self.install_device_plugin(timeout)
        self.timings["device_plugin"] = time.monotonic() - t1
        t1 = time.monotonic()
        self.install_lws(timeout)
        self.timings["lws"] = time.monotonic() - t1
        return time.monotonic() - t0

    def stop(self) -> None:
        """The cluster, its host routes and its API server's forwarding (a cluster that
        does not exist is no error)."""
        self._run([str(KIND_DIR / "delete-cluster.sh"), "--name", self.config.name],
                  "delete the kind cluster", 300)

    # ------------------------------------------------------------------ nodes

    def nodes(self) -> list[dict]:
        return json.loads(self.kubectl("get", "nodes", "-o", "json"))["items"]

    def workers(self) -> list[str]:
        return [n["metadata"]["name"] for n in self.nodes()
                if "node-role.kubernetes.io/control-plane" not in n["metadata"]["labels"]]

    # ------------------------------------------------------------------ images

    def kind_load(self, ref: str, workers_only: bool = False) -> float:
        """``kind load docker-image`` from the project's docker daemon (tools/images.sh's)
        into every node, or the workers only (the control plane takes no pods); returns
        the seconds it took."""
        t0 = time.monotonic()
        nodes = ["--nodes", ",".join(self.workers())] if workers_only else []
        self._run([self.kind, "load", "docker-image", ref, "--name", self.config.name, *nodes],
                  f"kind load docker-image {ref}", 1800)
        return time.monotonic() - t0

    def load_image(self, ref: str) -> dict[str, str]:
        """The engine image into the workers: what ``kind load`` does (``docker save``
        into each node's ``ctr images import``) through e2e/nodes' loader, which then
        frees the node's copy of the layer blobs and goes one node at a time when the
        disk cannot hold every node's import at once. ``kind load`` keeps both copies:
        for the 6.3 GB engine image on three workers that is 38 GB."""
        runtimes = [(node, (DOCKER, "-H", DOCKER_HOST, "exec", "-i", node, "ctr"))
                    for node in self.workers()]
        return load_image(ref, runtimes)

    def load_archive(self, image: ociimage.OCIImage) -> None:
        self._run([self.kind, "load", "image-archive", str(image.archive),
                   "--name", self.config.name], f"kind load image-archive {image.ref}", 300)

    def _binary_image(self, name: str, tag: str, binary: Path, path: str) -> ociimage.OCIImage:
        """A one-binary image (busybox beside it, user 65532) for an add-on."""
        return ociimage.write_image(
            self.workdir / "images" / f"{name}.tar", f"spillway.local/{name}:{tag}", [path],
            ociimage.busybox_layer(static={path: binary}), user="65532")

    # ------------------------------------------------------------------ add-ons

    def install_device_plugin(self, timeout: float) -> None:
        """The fake GPU device plugin as a DaemonSet on the workers, and GFD's labels."""
        versions = read_versions()
        binary = locate_binaries(real_nodes=True)["gpuplugin"]
        image = self._binary_image("gpuplugin", versions["GPUPLUGIN_BUILD"], binary,
                                   "/usr/local/bin/gpuplugin")
        self.load_archive(image)
        labels = gfd_labels(GPU_PRODUCT, GPUS_PER_NODE)
        for node in self.workers():
            self.kubectl("label", "--overwrite", "node", node,
                         *(f"{k}={v}" for k, v in labels.items()))
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(
            device_plugin_daemonset(image.ref)))
        workers = set(self.workers())

        def advertised() -> bool:
            gpus = {n["metadata"]["name"]: n["status"].get("allocatable", {}).get(
                "nvidia.com/gpu") for n in self.nodes()}
            return all(gpus.get(w) == str(GPUS_PER_NODE) for w in workers)

        wait(advertised, timeout, "nvidia.com/gpu allocatable on every worker from the "
             "device plugin", on_timeout=lambda: self.kubectl(
                 "get", "pods", "-n", DEVICE_PLUGIN_NAMESPACE, "-o", "wide", check=False))

    def install_lws(self, timeout: float) -> None:
        """LeaderWorkerSet as its release installs it (its kustomize config/default,
        rendered by kubectl from the module tools/build.sh pinned), from a controller
        image built here; ready when its webhook defaults a dry-run LeaderWorkerSet."""
        binary = locate_binaries()["lws-controller"]
        version = read_versions()["LWS_VERSION"]
        image = self._binary_image("lws-controller", f"v{version}", binary, "/manager")
        self.load_archive(image)
        docs = lws_release_manifests(self.kubectl("kustomize", lws_config_dir(version)),
                                     image.ref)
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     input=yaml.safe_dump_all(docs))
        self.wait_established("leaderworkersets.leaderworkerset.x-k8s.io", timeout=timeout)
        probe = yaml.safe_dump({
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "spillway-webhook-probe", "namespace": "default"},
            "spec": {"leaderWorkerTemplate": {"size": 1, "workerTemplate": {"spec": {
                "containers": [{"name": "c", "image": "example.invalid/probe:0"}]}}}}})

        def defaulted() -> bool:
            out = self.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                               input=probe, check=False)
            try:
                return (json.loads(out)["spec"].get("networkConfig") or {}).get(
                    "subdomainPolicy") == "Shared"
            except ValueError:
                return False

        wait(defaulted, timeout, "LeaderWorkerSet's webhooks answering the API server",
             interval=2, on_timeout=lambda: self.kubectl(
                 "get", "pods", "-n", LWS_NAMESPACE, "-o", "wide", check=False))


def device_plugin_daemonset(image: str) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "spillway-fake-gpu-plugin", "namespace": DEVICE_PLUGIN_NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": "spillway-fake-gpu-plugin"}},
            "template": {
                "metadata": {"labels": {"app": "spillway-fake-gpu-plugin"}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "priorityClassName": "system-node-critical",
                    "containers": [{
                        "name": "plugin", "image": image, "imagePullPolicy": "IfNotPresent",
                        # the kubelet's plugin socket directory is root's
                        "securityContext": {"runAsUser": 0},
                        "command": ["/usr/local/bin/gpuplugin", f"--count={GPUS_PER_NODE}",
                                    "--id-prefix=GPU-$(NODE_NAME)"],
                        "env": [{"name": "NODE_NAME", "valueFrom": {
                            "fieldRef": {"fieldPath": "spec.nodeName"}}}],
                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                        "volumeMounts": [{"name": "device-plugins",
                                          "mountPath": "/var/lib/kubelet/device-plugins"}],
                    }],
                    "volumes": [{"name": "device-plugins", "hostPath": {
                        "path": "/var/lib/kubelet/device-plugins", "type": "Directory"}}],
                },
            },
        },
    }


def lws_config_dir(version: str) -> Path:
    """LeaderWorkerSet's config/default in the Go module cache (tools/build.sh's lws
    family downloaded the module; ``go mod download`` answers from the cache)."""
    done = subprocess.run(["go", "mod", "download", "-json", f"sigs.k8s.io/lws@v{version}"],
                          cwd=REPO_ROOT / "tools" / "lws", capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise ClusterError(f"LeaderWorkerSet v{version}'s module: {done.stderr.strip()[-500:]}")
    return Path(json.loads(done.stdout)["Dir"]) / "config" / "default"


def lws_release_manifests(rendered: str, image: str) -> list[dict]:
    """The release's objects with the controller image built here: one replica, a
    small CPU request (a 2-core machine), pulled never (kind loaded it)."""
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "lws-controller-manager":
            doc["spec"]["replicas"] = 1
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["name"] == "manager":
                    c["image"], c["imagePullPolicy"] = image, "Never"
                    c["resources"] = {"requests": {"cpu": "50m", "memory": "128Mi"}}
    return docs
