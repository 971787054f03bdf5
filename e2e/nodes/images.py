"""Move images from the project's docker daemon into the real nodes' containerd.

``load_image(ref)`` streams ``docker save REF`` once into ``ctr images import -`` of
every node that does not hold that image already (same image ID: docker's ID is the
digest of the image's config, which containerd keeps as the manifest's config), then
checks each node has it and frees the node's copy of the layer blobs.

Freeing the layers: after the import, containerd holds the image twice, the layer
tarballs (content store) and the unpacked overlayfs snapshots. What a container runs
from is the snapshot (CRI prepares a container's root filesystem from the image's chain
ID, reading only the manifest and config); the layer blobs are only needed to unpack
again, export or push. Once the image's top snapshot is there, the loader removes the
layer blobs, as containerd's own ``discard_unpacked_layers`` does for pulled images; for
the ~10 GB engine image that halves each node's disk. Importing the image again
(a new build) brings the blobs back for as long as it unpacks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from e2e.nodes.realnodes import CACHE_ROOT, PATH, NodeError, NodeSpec, RealNodes

DOCKER = os.environ.get("SPILLWAY_DOCKER", "/usr/bin/docker")
#: tools/images.sh's daemon: its socket in $SPILLWAY_RUN_DIR, as that script puts it
DOCKER_HOST = os.environ.get("SPILLWAY_DOCKER_HOST") or (
    f"unix://{os.environ.get('SPILLWAY_RUN_DIR') or '/run/spillway'}/docker.sock")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")


def normalize(ref: str) -> str:
    """Docker's short reference as containerd (and the kubelet) name it:
    ``engine:dev`` -> ``docker.io/library/engine:dev``."""
    name, _, digest = ref.partition("@")
    first, _, rest = name.partition("/")
    if not rest:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    if not digest and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return f"{name}@{digest}" if digest else name


#: A node's containerd: its socket here (a real node), or a command that runs ``ctr``
#: where that containerd is (a kind node: ``docker exec -i NODE ctr``).
Runtime = Path | tuple[str, ...]


def ctr_command(socket: Runtime) -> list[str]:
    if isinstance(socket, Path):
        return ["ctr", "--address", str(socket), "--namespace", "k8s.io"]
    return [*socket, "--namespace", "k8s.io"]


def _ctr(socket: Runtime, *args: str, step: str, check: bool = True,
         timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([*ctr_command(socket), *args],
                          capture_output=True, timeout=timeout, env={**os.environ, "PATH": PATH})
    if check and proc.returncode != 0:
        raise NodeError(f"{step}: ctr {' '.join(args)} failed: "
                        f"{proc.stderr.decode(errors='replace').strip()}")
    return proc


def _content(socket: Runtime, digest: str) -> dict:
    return json.loads(_ctr(socket, "content", "get", digest, step="read content").stdout)


def _manifest(socket: Runtime, name: str) -> tuple[str, dict] | None:
    """(manifest digest, manifest) of image ``name`` on a node, or None."""
    listed = _ctr(socket, "images", "ls", f"name=={name}", step="list images").stdout.decode()
    for line in listed.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == name:
            digest = fields[2]
            doc = _content(socket, digest)
            if doc.get("mediaType") in INDEX_TYPES or "manifests" in doc:
                for m in doc["manifests"]:
                    p = m.get("platform", {})
                    if p.get("os") == "linux" and p.get("architecture") == "amd64":
                        digest = m["digest"]
                        break
                else:
                    return None
                doc = _content(socket, digest)
            return digest, doc
    return None


def config_digest(socket: Runtime, name: str) -> str | None:
    """The image ID (config digest) of image ``name`` on a node, or None."""
    found = _manifest(socket, name)
    return found[1]["config"]["digest"] if found else None


def _chain_id(diff_ids: list[str]) -> str:
    chain = diff_ids[0]
    for diff in diff_ids[1:]:
        chain = "sha256:" + hashlib.sha256(f"{chain} {diff}".encode()).hexdigest()
    return chain


def _unpacked(socket: Runtime, manifest: dict) -> bool:
    """Whether the image's top snapshot (its layers' chain ID) exists."""
    try:
        config = _content(socket, manifest["config"]["digest"])
    except (NodeError, ValueError, KeyError):
        return False
    diff_ids = config.get("rootfs", {}).get("diff_ids", [])
    return bool(diff_ids) and _ctr(
        socket, "snapshots", "--snapshotter", "overlayfs", "info", _chain_id(diff_ids),
        step="find an image's snapshot", check=False).returncode == 0


def free_layer_blobs(socket: Runtime, name: str) -> int:
    """Remove the layer blobs of image ``name`` once it is unpacked; returns the bytes
    freed. A blob another image still needs (one not unpacked, or one whose manifest
    cannot be read) is kept; nothing is touched when ``name`` is not unpacked."""
    found = _manifest(socket, name)
    if not found or not _unpacked(socket, found[1]):
        return 0
    keep: set[str] = set()
    names = _ctr(socket, "images", "ls", "-q", step="list images").stdout.decode().split()
    for other in names:
        if other == name:
            continue
        try:
            theirs = _manifest(socket, other)
        except (NodeError, ValueError):
            theirs = None
        if theirs is None:
            return 0  # cannot tell what it needs: free nothing
        if not _unpacked(socket, theirs[1]):
            keep |= {layer["digest"] for layer in theirs[1].get("layers", [])}
    present = set(_ctr(socket, "content", "ls", "-q", step="list content").stdout.decode().split())
    layers = [(layer["digest"], layer.get("size", 0)) for layer in found[1].get("layers", [])
              if layer["digest"] in present and layer["digest"] not in keep]
    if layers:
        _ctr(socket, "content", "rm", *(d for d, _ in layers), step="free layer blobs")
    return sum(size for _, size in layers)


def docker_image_id(ref: str, docker_host: str = DOCKER_HOST, docker: str = DOCKER) -> str:
    proc = subprocess.run([docker, "image", "inspect", "--format", "{{.Id}}", ref],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DOCKER_HOST": docker_host})
    if proc.returncode != 0:
        raise NodeError(f"docker image inspect {ref} (DOCKER_HOST={docker_host}) failed: "
                        f"{proc.stderr.strip()}")
    return proc.stdout.strip()


def current_runtimes() -> list[tuple[str, Path]]:
    """(name, containerd socket) of the machine's running real nodes."""
    record = RealNodes.read_record()
    if not record or not record.get("nodes"):
        raise NodeError("no real nodes on this machine: start them with "
                        "e2e/cluster/up --real-nodes N")
    return [(n, NodeSpec(n, i).socket) for i, n in enumerate(record["nodes"])]


def _fan_out(ref: str, targets: list[tuple[str, Runtime]], docker_host: str, docker: str) -> None:
    """``docker save ref`` once, into ``ctr images import -`` of every target (all at
    once: one save; the peak disk use is each node's blobs plus its snapshots)."""
    save = subprocess.Popen([docker, "save", ref], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "DOCKER_HOST": docker_host})
    imports = []
    for name, socket in targets:
        err = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, after the wait
        proc = subprocess.Popen(
            [*ctr_command(socket), "images", "import", "--snapshotter", "overlayfs", "-"],
            stdin=subprocess.PIPE, stdout=err, stderr=err, env={**os.environ, "PATH": PATH})
        imports.append((name, proc, err))
    save_err: list[bytes] = []
    reader = threading.Thread(target=lambda: save_err.append(save.stderr.read()), daemon=True)
    reader.start()
    broken: set[str] = set()
    while chunk := save.stdout.read(1 << 20):
        for name, proc, _ in imports:
            if name in broken:
                continue
            try:
                proc.stdin.write(chunk)
            except BrokenPipeError:
                broken.add(name)
    for _, proc, _ in imports:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
    save.wait()
    reader.join(10)
    failures = []
    if save.returncode != 0:
        failures.append(f"docker save {ref}: {b''.join(save_err).decode(errors='replace')}")
    for name, proc, err in imports:
        if proc.wait() != 0:
            err.seek(0)
            failures.append(f"{name}: ctr images import: "
                            f"{err.read().decode(errors='replace').strip()[-2000:]}")
        err.close()
    if failures:
        raise NodeError("loading " + ref + " failed: " + "; ".join(failures))


def docker_image_size(ref: str, docker_host: str = DOCKER_HOST, docker: str = DOCKER) -> int:
    """The image's size in bytes as docker reports it (its layers, uncompressed)."""
    proc = subprocess.run([docker, "image", "inspect", "--format", "{{.Size}}", ref],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DOCKER_HOST": docker_host})
    if proc.returncode != 0:
        raise NodeError(f"docker image inspect {ref} (DOCKER_HOST={docker_host}) failed: "
                        f"{proc.stderr.strip()}")
    return int(proc.stdout.strip())


#: Free disk to keep beyond a load's peak (the kubelets evict below 1Gi; logs, pods).
DISK_MARGIN = 4 << 30


def all_at_once(image_bytes: int, nodes: int, free_bytes: int) -> bool:
    """Whether one save into every node at once fits the disk: each node holds the image
    twice while it imports (blobs and snapshots), so all at once peaks at 2 x image x
    nodes; one node at a time at 2 x image (the earlier nodes' blobs freed)."""
    return 2 * image_bytes * nodes + DISK_MARGIN <= free_bytes


def load_image(ref: str, runtimes: list[tuple[str, Runtime]] | None = None,
               docker_host: str = DOCKER_HOST, free_layers: bool = True,
               docker: str = DOCKER, parallel: bool | None = None) -> dict[str, str]:
    """Make image ``ref`` of the docker daemon present in every real node's containerd
    (``runtimes``: (node, socket or ctr command; ``Runtime``), default the machine's
    running real nodes). Returns
    {node: "present" | "imported"}; pods then run it with imagePullPolicy IfNotPresent
    (a ``:latest`` tag means Always, which needs a registry: tag it otherwise).

    Disk: a node holds an image twice while it imports (blobs and snapshots), once
    after. ``parallel`` (one ``docker save`` streamed into every node at once) peaks at
    twice the image per node at once; ``parallel=False`` saves once per node and frees
    each node's blobs before the next, peaking at one extra copy (for a 4 GB image on two
    nodes: 16 GB against 12 GB beyond docker's own copy; 8 GB after either). ``None``
    (the default) loads all at once when that peak leaves ``DISK_MARGIN`` free on the
    nodes' disk, else one at a time: one save instead of one per node, and the nodes'
    imports (disk writes, unpacking) overlap."""
    runtimes = runtimes if runtimes is not None else current_runtimes()
    image_id = docker_image_id(ref, docker_host, docker)
    name = normalize(ref)
    result = {node: "present" for node, socket in runtimes
              if config_digest(socket, name) == image_id}
    targets = [(node, socket) for node, socket in runtimes if node not in result]
    if parallel is None and targets:
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        parallel = all_at_once(docker_image_size(ref, docker_host, docker), len(targets),
                               shutil.disk_usage(CACHE_ROOT).free)
    for batch in [targets] if parallel else [[t] for t in targets]:
        if not batch:
            continue
        _fan_out(ref, batch, docker_host, docker)
        for node, socket in batch:
            got = config_digest(socket, name)
            if got != image_id:
                raise NodeError(f"{node}: after the import {name} has image ID {got}, "
                                f"docker has {image_id}")
            result[node] = "imported"
            if free_layers:
                free_layer_blobs(socket, name)
    return result


# ------------------------------------------------------------------ before the nodes run

#: Where preload's temporary containerds keep their state and sockets.
PRELOAD_RUN = Path(os.environ.get("SPILLWAY_PRELOAD_RUN", "/run/spillway/preload"))


def _offline_config(root: Path, state: Path) -> str:
    """A containerd on a node's kept root (the folder the node's own containerd mounts on
    /var/lib/containerd), without the CRI plug-in and on sockets of its own: images go
    into namespace k8s.io, unpacked by the overlayfs snapshotter, as the node's CRI
    plug-in reads them when the node starts."""
    return f"""\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{state}/containerd.sock"
[ttrpc]
  address = "{state}/containerd.sock.ttrpc"
"""


@contextlib.contextmanager
def offline_runtimes(names: list[str], timeout: float = 60):
    """(node, socket) of a temporary containerd on each named node's kept root, stopped
    on the way out. Only while the nodes do not run (the caller holds their lock)."""
    procs: list[subprocess.Popen] = []
    runtimes = []
    try:
        for i, name in enumerate(names):
            spec = NodeSpec(name, i)
            state = PRELOAD_RUN / name
            shutil.rmtree(state, ignore_errors=True)
            state.mkdir(parents=True)
            spec.containerd_root.mkdir(parents=True, exist_ok=True)
            config = state / "containerd.toml"
            config.write_text(_offline_config(spec.containerd_root, state))
            log = open(state / "containerd.log", "wb")  # noqa: SIM115 - the process's
            procs.append(subprocess.Popen(["/usr/bin/containerd", "--config", str(config)],
                                          stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()
            runtimes.append((name, state / "containerd.sock"))
        deadline = time.monotonic() + timeout
        for (name, socket), proc in zip(runtimes, procs, strict=True):
            while _ctr(socket, "version", step="containerd version", check=False,
                       timeout=10).returncode != 0:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (PRELOAD_RUN / name / "containerd.log").read_text()[-1500:]
                    raise NodeError(f"{name}: a containerd on its root did not answer on "
                                    f"{socket}:\n{tail}")
                time.sleep(0.2)
        yield runtimes
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def preload(refs: list[str], names: list[str], docker_host: str = DOCKER_HOST,
            docker: str = DOCKER) -> dict[str, dict[str, str]]:
    """Images into the real nodes' kept containerd roots before the nodes start (``make
    demo`` runs it while the Go builds still run), so that loading them when the nodes
    are up finds them present. When real nodes run, through their own containerds; when
    none run, through a temporary containerd on each node's root, holding the real
    nodes' lock (a cluster starting meanwhile waits for it). {ref: {node: state}}."""
    with RealNodes._locked(timeout=600):
        record = RealNodes.read_record()
        if record and RealNodes.record_alive(record):
            return {ref: load_image(ref, docker_host=docker_host, docker=docker) for ref in refs}
        with offline_runtimes(names) as runtimes:
            return {ref: load_image(ref, runtimes, docker_host=docker_host, docker=docker)
                    for ref in refs}
