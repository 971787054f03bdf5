"""Real nodes: what KWOK cannot show. Real kubelets admit GPU pods through a device
plugin, containers run under runc with real cgroup limits and tmpfs volumes, pods talk
to pods on the other node and to Services through kube-proxy, the API server is
reachable from a pod the way in-cluster config reaches it, and images move from a
docker daemon into every node's containerd."""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from e2e.cluster import ClusterConfig, ClusterError, LocalCluster
from e2e.cluster.controlplane import Ports
from e2e.nodes import API_IP, RealNodes, load_image
from e2e.nodes.images import config_digest, normalize
from e2e.nodes.ociimage import busybox_layer
from tests.helpers import wait_for
from tests.nodes.conftest import create, describe, finished, pod, wait_phase

NODES = ["spillway-node-a", "spillway-node-b"]
CIDRS = {"spillway-node-a": "10.244.1.", "spillway-node-b": "10.244.2."}


def test_both_nodes_are_ready_with_eight_gpus_and_gfd_labels(core: client.CoreV1Api):
    nodes = {n.metadata.name: n for n in core.list_node().items}
    assert sorted(nodes) == NODES
    for name, node in nodes.items():
        ready = {c.type: c.status for c in node.status.conditions}["Ready"]
        assert ready == "True", name
        assert node.status.capacity["nvidia.com/gpu"] == "8"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        labels = node.metadata.labels
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels["nvidia.com/gpu.present"] == "true"
        assert labels["nvidia.com/gpu.count"] == "8"
        assert "type" not in labels  # not a KWOK node
        info = node.status.node_info
        assert info.kubelet_version == "v1.35.4"
        assert info.container_runtime_version.startswith("containerd://1.6")
        addresses = {a.type: a.address for a in node.status.addresses}
        assert addresses["InternalIP"] == f"10.213.0.{11 + NODES.index(name)}"
        assert node.spec.pod_cidr == CIDRS[name] + "0/24"


def test_gpu_pods_get_their_devices_and_nine_gpus_stay_pending(core, namespace):
    pods = [pod(f"gpu-{n[-1]}", 'echo "GPUS=$NVIDIA_VISIBLE_DEVICES"', node=n,
                limits={"nvidia.com/gpu": "2"}) for n in NODES]
    greedy = pod("greedy", "true", limits={"nvidia.com/gpu": "9"})
    create(core, namespace, *pods, greedy)
    for p, node in zip(pods, NODES, strict=True):
        out = finished(core, namespace, p["metadata"]["name"])
        ids = re.search(r"GPUS=(\S+)", out).group(1).split(",")
        assert len(ids) == len(set(ids)) == 2, out
        assert all(re.fullmatch(rf"GPU-{node}-[0-7]", i) for i in ids), out

    def unschedulable():
        p = core.read_namespaced_pod("greedy", namespace)
        cond = {c.type: c for c in p.status.conditions or []}.get("PodScheduled")
        return cond if cond and cond.reason == "Unschedulable" else None

    cond = wait_for(unschedulable, 60, "the 9-GPU pod to be found unschedulable",
                    on_timeout=lambda: describe(core, namespace, "greedy"))
    assert "Insufficient nvidia.com/gpu" in cond.message, cond.message
    p = core.read_namespaced_pod("greedy", namespace)
    assert p.status.phase == "Pending" and p.spec.node_name is None


def test_a_pod_reaches_a_pod_and_its_service_on_the_other_node(core, namespace):
    token = uuid.uuid4().hex
    server = pod("server", f"mkdir -p /www && echo {token} > /www/index.html && "
                           "exec httpd -f -p 8080 -h /www", node=NODES[1])
    create(core, namespace, server)
    core.create_namespaced_service(namespace, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8080}]},
    })
    server_ip = wait_phase(core, namespace, "server", {"Running"}).status.pod_ip
    service_ip = core.read_namespaced_service("web", namespace).spec.cluster_ip
    # busybox wget -T segfaults (Debian's 1.35), so a bounded retry loop instead.
    fetch = ('for i in $(seq 1 40); do out=$(wget -qO- "$0") && break; sleep 0.5; done; '
             'echo "$1 $out"')
    client_pod = pod("client", f"sh -c '{fetch}' http://{server_ip}:8080/ pod && "
                               f"sh -c '{fetch}' http://{service_ip}/ service",
                     node=NODES[0])
    create(core, namespace, client_pod)
    out = finished(core, namespace, "client")
    assert f"pod {token}" in out and f"service {token}" in out, out
    client_ip = core.read_namespaced_pod("client", namespace).status.pod_ip
    assert client_ip.startswith(CIDRS[NODES[0]]) and server_ip.startswith(CIDRS[NODES[1]])
    assert service_ip.startswith("10.0.")


def test_pods_resolve_services_and_a_subdomain_pods_hostname_by_cluster_dns(core, namespace):
    """CoreDNS (e2e/nodes/dns.py) as a cluster's kube-dns: a Service by its short name
    and its FQDN, and a pod with a hostname and a subdomain (how a LeaderWorkerSet names
    its leader) through its headless Service, resolved from a pod on the other node."""
    server = pod("server", "mkdir -p /www && echo hostname-ok > /www/index.html && "
                           "exec httpd -f -p 8080 -h /www", node=NODES[1])
    server["spec"] |= {"hostname": "leader-0", "subdomain": "group"}
    create(core, namespace, server)
    for name, headless in (("web", False), ("group", True)):
        core.create_namespaced_service(namespace, {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": {"app": "server"}, "publishNotReadyAddresses": headless,
                     "ports": [{"port": 8080, "targetPort": 8080}],
                     **({"clusterIP": "None"} if headless else {})}})
    server_ip = wait_phase(core, namespace, "server", {"Running"}).status.pod_ip
    service_ip = core.read_namespaced_service("web", namespace).spec.cluster_ip
    fetch = ('for i in $(seq 1 40); do out=$(wget -qO- "$0") && break; sleep 0.5; done; '
             'echo "$1 $out"')
    names = {"short": "web", "fqdn": f"web.{namespace}.svc.cluster.local",
             "leader": f"leader-0.group.{namespace}"}
    script = " && ".join([f"sh -c '{fetch}' http://{host}:8080/ {key}"
                          for key, host in names.items()]
                         # busybox's nslookup stops at the first search domain that
                         # answers NXDOMAIN (the first one does for the leader's name), so
                         # the leader's is absolute; wget above walks the search list.
                         + [f"nslookup {name} | tail -n +3 | grep Address | "
                            f"sed 's/^/{key} /'" for key, name in (
                                ("short", "web"),
                                ("fqdn", f"web.{namespace}.svc.cluster.local"),
                                ("leader", f"leader-0.group.{namespace}.svc.cluster.local"))]
                         + ["cat /etc/resolv.conf"])
    create(core, namespace, pod("client", script, node=NODES[0]))
    out = finished(core, namespace, "client")
    for key in names:
        assert f"{key} hostname-ok" in out, out
    assert f"short Address: {service_ip}" in out and f"fqdn Address: {service_ip}" in out, out
    assert f"leader Address: {server_ip}" in out, out
    assert f"nameserver {API_IP}" in out and f"search {namespace}.svc.cluster.local" in out


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(core, namespace):
    review = '{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}'
    base = "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"
    script = (
        'echo "host=$KUBERNETES_SERVICE_HOST port=$KUBERNETES_SERVICE_PORT"; '
        f'wget --no-check-certificate -qO- {base}/version; echo; '
        'TOKEN=$(cat /var/run/secrets/kubernetes.io/serviceaccount/token); '
        'echo "review=$(wget --no-check-certificate -qO- '
        '--header "Authorization: Bearer $TOKEN" --header "Content-Type: application/json" '
        f"--post-data '{review}' {base}/apis/authentication.k8s.io/v1/selfsubjectreviews"
        ' | tr -d "\\n")"'
    )
    create(core, namespace, pod("incluster", script, node=NODES[1]))
    out = finished(core, namespace, "incluster")
    assert "host=10.0.0.1 port=443" in out, out
    version = json.loads(out[out.index("{"):out.index("}") + 1])
    assert version["gitVersion"] == "v1.35.4"
    who = json.loads(out.split("review=", 1)[1].strip())
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:default"
    # The Service's endpoint is the API server's advertised address (not loopback).
    slice_ = client.DiscoveryV1Api(core.api_client).read_namespaced_endpoint_slice(
        "kubernetes", "default")
    assert slice_.endpoints[0].addresses == [API_IP]


def test_a_memory_limit_is_a_real_cgroup_limit(core, namespace):
    limits = {"memory": "64Mi"}
    reader = pod("limit", "cat /sys/fs/cgroup/memory/memory.limit_in_bytes", limits=limits)
    # dd's 128 MiB buffer is more than the limit: the kernel kills it.
    hog = pod("hog", "dd if=/dev/zero of=/dev/null bs=128M count=1 && echo survived",
              limits=limits)
    create(core, namespace, reader, hog)
    assert finished(core, namespace, "limit").strip() == str(64 * 1024 * 1024)
    p = wait_phase(core, namespace, "hog", {"Succeeded", "Failed"})
    state = p.status.container_statuses[0].state.terminated
    assert p.status.phase == "Failed" and state.reason == "OOMKilled", describe(
        core, namespace, "hog")


def test_a_memory_emptydir_is_a_sized_tmpfs(core, namespace):
    volumes = [{"name": "cache", "emptyDir": {"medium": "Memory", "sizeLimit": "32Mi"}}]
    p = pod("tmpfs", "df -k /cache | tail -1; grep ' /cache ' /proc/mounts",
            volumes=volumes, mounts=[{"name": "cache", "mountPath": "/cache"}])
    create(core, namespace, p)
    out = finished(core, namespace, "tmpfs")
    df, mount = out.strip().splitlines()
    assert df.split()[0] == "tmpfs" and df.split()[1] == "32768", out
    assert mount.split()[2] == "tmpfs" and "size=32768k" in mount, out


# ------------------------------------------------------------------- the image loader


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _docker_archive(path: Path, ref: str, token: str) -> tuple[str, str]:
    """What ``docker save`` writes (manifest.json, config, one folder per layer) for a
    two-layer image: busybox, and a layer holding /token. Returns the image ID and the
    digest of the /token layer."""
    base = busybox_layer()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("token")
        data = f"{token}\n".encode()
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    layers = [base, buf.getvalue()]
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin:/usr/bin"], "Cmd": ["cat", "/token"]},
        "rootfs": {"type": "layers", "diff_ids": [_sha(layer) for layer in layers]},
    }).encode()
    image_id = _sha(config)
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add(f"{image_id[7:]}.json", config)
        names = []
        for layer in layers:
            folder = _sha(layer)[7:]
            add(f"{folder}/VERSION", b"1.0")
            add(f"{folder}/layer.tar", layer)
            names.append(f"{folder}/layer.tar")
        add("manifest.json", json.dumps([{"Config": f"{image_id[7:]}.json",
                                          "RepoTags": [ref], "Layers": names}]).encode())
    return image_id, _sha(layers[-1])


def _fake_docker(path: Path, archive: Path, ref: str, image_id: str) -> Path:
    """A ``docker`` that knows one image: ``image inspect --format {{.Id}}`` and
    ``{{.Size}}``, and ``save``; each save appends a line to ``<path>.saves``."""
    path.write_text(f"""#!{sys.executable}
import os, shutil, sys
args = sys.argv[1:]
if args[:2] == ["image", "inspect"] and args[-1] == {ref!r}:
    print(os.path.getsize({str(archive)!r}) if "{{{{.Size}}}}" in args else {image_id!r})
elif args == ["save", {ref!r}]:
    with open({str(path) + ".saves"!r}, "a") as log:
        log.write("save\\n")
    with open({str(archive)!r}, "rb") as f:
        shutil.copyfileobj(f, sys.stdout.buffer)
else:
    sys.exit("fake docker: no such image or command: " + " ".join(args))
""")
    path.chmod(0o755)
    return path


def _saves(docker: Path) -> int:
    saves = docker.with_name(docker.name + ".saves")
    return len(saves.read_text().splitlines()) if saves.exists() else 0


def _ctr(socket: Path, *args: str) -> str:
    return subprocess.run(["ctr", "--address", str(socket), "--namespace", "k8s.io", *args],
                          capture_output=True, text=True, check=True).stdout


def test_a_docker_image_loads_into_every_node_once_and_runs(
        core, namespace, real_cluster: LocalCluster, tmp_path):
    token = uuid.uuid4().hex[:12]
    ref = f"spillway-test/loader:{token}"
    archive = tmp_path / "image.tar"
    image_id, token_layer = _docker_archive(archive, ref, token)
    docker = _fake_docker(tmp_path / "docker", archive, ref, image_id)
    runtimes = real_cluster.real_nodes().runtimes()
    assert [n for n, _ in runtimes] == NODES
    try:
        assert load_image(ref, runtimes, docker=str(docker)) == dict.fromkeys(NODES, "imported")
        assert _saves(docker) == 1, "one docker save streamed into both nodes"
        for _, socket in runtimes:
            assert config_digest(socket, normalize(ref)) == image_id
            # Unpacked, and the node's copy of the layer blobs freed.
            assert token_layer not in _ctr(socket, "content", "ls", "-q").split()
        pods = [pod(f"loaded-{n[-1]}", "cat /token", node=n, image=ref) for n in NODES]
        for p in pods:
            p["spec"]["containers"][0].pop("command")  # the image's own CMD
        create(core, namespace, *pods)
        for p in pods:
            assert finished(core, namespace, p["metadata"]["name"]).strip() == token
        assert load_image(ref, runtimes, docker=str(docker)) == dict.fromkeys(NODES, "present")
        assert _saves(docker) == 1, "a present image is not saved again"
    finally:
        _remove(runtimes, ref, image_id)


def _remove(runtimes, ref: str, image_id: str) -> None:
    for _, socket in runtimes:
        subprocess.run(["ctr", "--address", str(socket), "--namespace", "k8s.io", "images",
                        "rm", normalize(ref), image_id], capture_output=True)


def test_one_node_at_a_time_saves_once_per_node(real_cluster: LocalCluster, tmp_path):
    """``parallel=False`` (``python -m e2e.nodes load --one-at-a-time``, for a disk that
    cannot hold the image twice per node at once): one save per node, each node's layer
    blobs freed before the next."""
    token = uuid.uuid4().hex[:12]
    ref = f"spillway-test/loader:{token}"
    archive = tmp_path / "image.tar"
    image_id, token_layer = _docker_archive(archive, ref, token)
    docker = _fake_docker(tmp_path / "docker", archive, ref, image_id)
    runtimes = real_cluster.real_nodes().runtimes()
    try:
        assert load_image(ref, runtimes, docker=str(docker), parallel=False) == \
            dict.fromkeys(NODES, "imported")
        assert _saves(docker) == len(NODES)
        for _, socket in runtimes:
            assert config_digest(socket, normalize(ref)) == image_id
            assert token_layer not in _ctr(socket, "content", "ls", "-q").split()
    finally:
        _remove(runtimes, ref, image_id)


def test_a_second_real_node_cluster_is_refused_and_the_first_keeps_running(
        core, real_cluster: LocalCluster, tmp_path):
    other = LocalCluster(ClusterConfig(workdir=tmp_path / "other", ports=Ports.free(), nodes=0,
                                       real_nodes=2, binaries=real_cluster.config.binaries))
    with pytest.raises(ClusterError) as refused:
        other.start()
    owner = str(real_cluster.workdir.resolve())
    assert f"real nodes are in use by the cluster in {owner}" in str(refused.value)
    assert not (tmp_path / "other" / "state.json").exists()
    record = RealNodes.read_record()
    assert record["owner"] == owner and real_cluster.real_nodes().alive()
    nodes = core.list_node().items
    assert all({c.type: c.status for c in n.status.conditions}["Ready"] == "True"
               for n in nodes)


def test_a_preload_on_the_nodes_kept_roots_is_there_for_their_containerd(tmp_path,
                                                                         monkeypatch):
    """``python -m e2e.nodes preload`` before the nodes run: a temporary containerd on
    each node's kept root imports and unpacks the image (and frees its layer blobs); a
    containerd started on that root later finds it present, so the demo's load is a
    no-op. Nodes of their own (roots under tmp_path), beside the session's cluster."""
    from e2e.nodes import images as loader
    from e2e.nodes import realnodes

    monkeypatch.setattr(realnodes, "CACHE_ROOT", tmp_path / "nodes")
    monkeypatch.setattr(loader, "CACHE_ROOT", tmp_path / "nodes")
    monkeypatch.setattr(loader, "PRELOAD_RUN", tmp_path / "run")
    token = uuid.uuid4().hex[:12]
    ref = f"spillway-test/preload:{token}"
    archive = tmp_path / "image.tar"
    image_id, token_layer = _docker_archive(archive, ref, token)
    docker = _fake_docker(tmp_path / "docker", archive, ref, image_id)
    names = ["spillway-node-y", "spillway-node-z"]
    with loader.offline_runtimes(names) as runtimes:
        assert load_image(ref, runtimes, docker=str(docker)) == dict.fromkeys(names, "imported")
    assert _saves(docker) == 1
    with loader.offline_runtimes(names) as runtimes:  # a containerd started again on each root
        assert load_image(ref, runtimes, docker=str(docker)) == dict.fromkeys(names, "present")
        for _, socket in runtimes:
            found = loader._manifest(socket, normalize(ref))
            assert found and found[1]["config"]["digest"] == image_id
            assert loader._unpacked(socket, found[1]), "not unpacked on the kept root"
            assert token_layer not in _ctr(socket, "content", "ls", "-q").split()
    assert _saves(docker) == 1
    for name in names:
        assert (tmp_path / "nodes" / name / "containerd").is_dir()
