"""Real nodes beside the local control plane: a real kubelet, containerd and runc per
node, pod networking through CNI bridges, one kube-proxy, and a fake GPU device plugin.

Layout (why, in short):

* **One mount namespace per node.** Two kubelets cannot share one containerd (each
  kills the runtime's pods it does not know), and some kubelet paths are constants, not
  derived from ``--root-dir``: the device-plugin directory
  (``/var/lib/kubelet/device-plugins/``, ``pluginapi.DevicePluginPath``) and
  ``/var/log/containers``. So each node is a mount namespace, persisted on
  ``/run/spillway/nodes/<node>/mnt`` (no holder process), propagation slave (host
  mounts reach it, its own mounts never leak out), holding that node's containerd,
  kubelet and device plugin. The node's own folders are bind-mounted on the default
  paths (/var/lib/kubelet, /var/lib/containerd, /run/containerd, /etc/cni/net.d,
  /var/lib/cni, /var/log/pods, /var/log/containers, /run/netns), so kubelet and
  containerd see the same paths and run with near-default configs. When the last
  process of a node is gone and its namespace file is unmounted, every mount the node
  made (overlay root filesystems, emptyDir tmpfs, pod network namespaces) goes with it.
* **The host's network namespace.** Each node's CNI bridge (``spwbr-<x>``, pod CIDR
  10.244.N.0/24, bridge + host-local + portmap) and its pods' veths live in the host's
  netns, so pod-to-pod traffic across nodes is plain host routing. The API server and
  the nodes have their own addresses on a link of their own (``spillway0``, a dummy, or
  an empty bridge where the kernel lacks the dummy driver: 10.213.0.1 for the API
  server, .11, .12, ... for the nodes), which pods reach through their bridge's
  gateway. ONE kube-proxy (iptables mode) serves every node: two would fight over the
  same chains. There is no CoreDNS (no image registry to pull it from): pods reach
  Services by ClusterIP (or the ``<SVC>_SERVICE_HOST`` env), and the API server through
  the ``kubernetes`` Service, 10.0.0.1:443, as in-cluster config does.
* **Cgroups.** Each kubelet gets its own ``cgroupRoot`` (``/spillway-node-<x>``, cgroupfs
  driver, cgroup v1): a kubelet removes pod cgroups it does not know, so two kubelets
  cannot share ``/kubepods``.
* **Disk.** containerd's root lives under ``~/.cache/spillway/nodes/<node>/containerd``
  and survives ``down``, so images imported once (the ~10 GB engine image) are there
  next time. Eviction thresholds are small absolute numbers (1Gi) and image GC is off
  (high threshold 100%), so a big disk that is 70% full evicts nothing.
* **Cleanup.** Every host change is recorded in ``/run/spillway/nodes/cluster.json``
  before it is made, with the workdir of the cluster that owns it; ``stop()`` undoes
  them from that record (processes found by pid, mount namespace and cgroup; the dummy
  link, bridges, the iptables chains kube-proxy, the kubelets, CNI and we made) even
  after a crash. Only one real-node cluster can exist per machine (fixed addresses,
  bridge names and paths): the record is the lock.

The control plane (``e2e.cluster.LocalCluster`` with ``real_nodes=N``) drives this
class; see ``e2e/nodes/__init__.py`` for the API tests and the demo call.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from e2e.cluster.errors import ClusterError
from e2e.cluster.gfd import node_gpu_labels
from e2e.cluster.pki import ensure_client_cert
from e2e.nodes import dns, ociimage
from e2e.processes import alive as _alive

if TYPE_CHECKING:
    from e2e.cluster.controlplane import LocalCluster

RUN_ROOT = Path(os.environ.get("SPILLWAY_NODES_RUN", "/run/spillway/nodes"))
RECORD = RUN_ROOT / "cluster.json"
LOCK = RUN_ROOT / ".lock"

LINK = "spillway0"
NET_PREFIX = "10.213.0"
API_IP = f"{NET_PREFIX}.1"
CLUSTER_CIDR = "10.244.0.0/16"
KUBELET_PORT = 10250
PROXY_HEALTHZ = f"{API_IP}:10256"
MAX_NODES = 8
REAL_NODE_LABEL = "spillway.dev/real-node"

# The host paths a node's mount namespace covers with its own folders.
NODE_MOUNTS = (
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/run/containerd",
    "/etc/cni/net.d",
    "/var/lib/cni",
    "/var/log/pods",
    "/var/log/containers",
    "/run/netns",
)
# Chains of kube-proxy, the kubelets (canaries), CNI (portmap, bridge ipMasq) and ours.
CHAIN_PREFIXES = ("KUBE-", "CNI-", "SPILLWAY-")
FORWARD_CHAIN = "SPILLWAY-FORWARD"
SYSCTLS = {
    "net/ipv4/ip_forward": "1",
    # Bridged pod traffic through iptables: Service traffic between two pods on one
    # node's bridge is DNAT-ed by kube-proxy's rules and must be un-DNAT-ed on the way
    # back.
    "net/bridge/bridge-nf-call-iptables": "1",
}
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Host programs -> what installs them. A missing one stops ``up`` with one line.
HOST_PROGRAMS = {
    "containerd": "/usr/bin/containerd",
    "containerd-shim-runc-v2": "/usr/bin/containerd-shim-runc-v2",
    "ctr": "/usr/bin/ctr",
    "runc": "/usr/sbin/runc",
    "CNI bridge plugin": "/usr/lib/cni/bridge",
    "CNI host-local plugin": "/usr/lib/cni/host-local",
    "CNI loopback plugin": "/usr/lib/cni/loopback",
    "CNI portmap plugin": "/usr/lib/cni/portmap",
    "iptables": "/usr/sbin/iptables",
    "iptables-save": "/usr/sbin/iptables-save",
    "iptables-restore": "/usr/sbin/iptables-restore",
    "conntrack": "/usr/sbin/conntrack",
    "busybox": "/usr/bin/busybox",
    "ip": "/usr/sbin/ip",
    "unshare": "/usr/bin/unshare",
    "nsenter": "/usr/bin/nsenter",
}
CACHE_ROOT = Path(os.environ.get("SPILLWAY_NODES_CACHE",
                                 Path.home() / ".cache/spillway/nodes"))


class NodeError(ClusterError):
    """Real nodes cannot be started or stopped; the message says what to do."""


def node_names(count: int) -> list[str]:
    return [f"spillway-node-{chr(ord('a') + i)}" for i in range(count)]


@dataclass(frozen=True)
class NodeSpec:
    """One real node: its name, address, pod network and folders."""

    name: str
    index: int

    @property
    def letter(self) -> str:
        return self.name.rsplit("-", 1)[1]

    @property
    def ip(self) -> str:
        return f"{NET_PREFIX}.{11 + self.index}"

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.index + 1}.0/24"

    @property
    def gateway(self) -> str:
        return f"10.244.{self.index + 1}.1"

    @property
    def bridge(self) -> str:
        return f"spwbr-{self.letter}"

    @property
    def cgroup_root(self) -> str:
        return f"/{self.name}"

    @property
    def run_dir(self) -> Path:  # configs, sockets, the namespace file: per run
        return RUN_ROOT / self.name

    @property
    def ns_file(self) -> Path:
        return self.run_dir / "mnt"

    @property
    def socket(self) -> Path:
        """containerd's socket as the host sees it (``ctr --address``)."""
        return self.run_dir / "containerd" / "containerd.sock"

    @property
    def cache_dir(self) -> Path:
        return CACHE_ROOT / self.name

    @property
    def containerd_root(self) -> Path:  # kept across runs: imported images
        return self.cache_dir / "containerd"

    @property
    def scratch(self) -> Path:  # kubelet root, pod logs, CNI state: per run, on disk
        return self.cache_dir / "run"

    def mounts(self) -> list[tuple[Path, str]]:
        """(folder on the host, the path the node sees it at)."""
        return [
            (self.scratch / "kubelet", "/var/lib/kubelet"),
            (self.containerd_root, "/var/lib/containerd"),
            (self.run_dir / "containerd", "/run/containerd"),
            (self.run_dir / "cni-conf", "/etc/cni/net.d"),
            (self.scratch / "cni", "/var/lib/cni"),
            (self.scratch / "pod-logs", "/var/log/pods"),
            (self.scratch / "container-logs", "/var/log/containers"),
            (self.run_dir / "netns", "/run/netns"),
        ]


# ---------------------------------------------------------------------- helpers


def _run(cmd: list[str], step: str, *, check: bool = True, input: str | bytes | None = None,
         timeout: float = 60) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, input=input, timeout=timeout,
                              text=not isinstance(input, bytes),
                              env={**os.environ, "PATH": PATH + ":" + os.environ.get("PATH", "")})
    except FileNotFoundError as exc:
        raise NodeError(f"{step}: {cmd[0]} not found: run tools/host.sh") from exc
    except subprocess.TimeoutExpired as exc:
        raise NodeError(f"{step}: {shlex.join(cmd)} did not finish in {timeout:.0f}s") from exc
    out = proc.stdout if isinstance(proc.stdout, str) else proc.stdout.decode(errors="replace")
    err = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors="replace")
    if check and proc.returncode != 0:
        raise NodeError(f"{step}: {shlex.join(cmd)} failed ({proc.returncode}): {err.strip()}")
    return out


def _exe_name(pid: int) -> str:
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name
    except (OSError, IndexError):
        return ""


def _kill_all(pids: list[int], timeout: float, group: bool = False) -> None:
    """TERM the processes (their groups with ``group``), then KILL what is left after
    ``timeout``; returns when all are gone."""
    def send(sig: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig) if group else os.kill(pid, sig)

    send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    if any(_alive(p) for p in pids):
        send(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def _ns_inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in_mount_ns(ns_file: Path) -> list[int]:
    """Processes whose mount namespace is the one persisted on ``ns_file``."""
    target = _ns_inode(ns_file)
    if target is None or not _is_mount_point(ns_file):
        return []
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        if _ns_inode(proc / "ns" / "mnt") == target and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def _mountinfo() -> list[list[str]]:
    return [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def _is_mount_point(path: Path) -> bool:
    return any(fields[4] == str(path) for fields in _mountinfo())


def _shared_mount_of(path: Path) -> bool:
    """Whether the mount ``path`` lies on propagates shared (``unshare --mount=FILE``
    refuses to persist a namespace on a shared mount)."""
    best, shared = "", False
    for fields in _mountinfo():
        point = fields[4]
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) \
                and len(point) >= len(best):
            sep = fields.index("-")
            best, shared = point, any(f.startswith("shared:") for f in fields[6:sep])
    return shared


def _cgroup_dirs(root: str) -> list[Path]:
    base = Path("/sys/fs/cgroup")
    dirs = []
    with contextlib.suppress(OSError):
        for hierarchy in sorted(base.iterdir()):
            d = hierarchy / root.lstrip("/")
            if d.is_dir():
                dirs.append(d)
    return dirs


def _cgroup_pids(root: str) -> set[int]:
    pids: set[int] = set()
    for top in _cgroup_dirs(root):
        for dirpath, _, files in os.walk(top):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError, ValueError):
                    text = (Path(dirpath) / "cgroup.procs").read_text()
                    pids.update(int(p) for p in text.split())
    return pids


def _remove_cgroups(root: str) -> list[str]:
    """rmdir every cgroup under ``root`` in every hierarchy, deepest first; returns the
    ones that would not go."""
    stuck = []
    for top in _cgroup_dirs(root):
        for dirpath, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(dirpath)
            except FileNotFoundError:
                pass
            except OSError as exc:
                stuck.append(f"{dirpath} ({exc.strerror})")
    return stuck


def _link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def iptables_cleanup_script(dump: str, prefixes: tuple[str, ...] = CHAIN_PREFIXES) -> str:
    """From an ``iptables-save`` dump, the ``iptables-restore --noflush`` input that
    removes every chain named with one of ``prefixes`` and every rule jumping to one."""
    script: list[str] = []
    tables: list[tuple[str, list[str], list[str]]] = []
    for line in dump.splitlines():
        if line.startswith("*"):
            tables.append((line[1:], [], []))
        elif line.startswith(":") and tables:
            tables[-1][1].append(line[1:].split()[0])
        elif line.startswith("-A ") and tables:
            tables[-1][2].append(line)
    for table, chains, rules in tables:
        ours = [c for c in chains if c.startswith(prefixes)]
        if not ours:
            continue
        script.append(f"*{table}")
        for rule in rules:
            words = shlex.split(rule)
            target = next((words[i + 1] for i, w in enumerate(words[:-1])
                           if w in ("-j", "-g", "--jump", "--goto")), "")
            if words[1] not in ours and target in ours:
                script.append("-D " + rule[3:])
        script.extend(f"-F {c}" for c in ours)
        script.extend(f"-X {c}" for c in ours)
        script.append("COMMIT")
    return "\n".join(script) + "\n" if script else ""


def iptables_cleanup(prefixes: tuple[str, ...] = CHAIN_PREFIXES) -> None:
    """Remove every chain named with one of ``prefixes`` and every rule that jumps to
    one, in every table, for IPv4 and IPv6 (one ``*-restore --noflush`` per family)."""
    for save, restore in (("iptables-save", "iptables-restore"),
                          ("ip6tables-save", "ip6tables-restore")):
        if shutil.which(save, path=PATH) is None:
            continue
        try:
            script = iptables_cleanup_script(_run([save], "iptables cleanup"), prefixes)
        except NodeError:
            continue
        if script:
            _run([restore, "--noflush"], "iptables cleanup", input=script)


# ---------------------------------------------------------------------- the nodes


class RealNodes:
    """The real nodes of one local cluster (``cluster``: the LocalCluster that owns
    them, for its PKI, logs, kubeconfigs and kubectl)."""

    def __init__(self, cluster: LocalCluster, count: int | None = None):
        self.cluster = cluster
        self.count = count if count is not None else cluster.config.real_nodes
        self.owner = str(cluster.workdir.resolve())
        self.nodes = [NodeSpec(n, i) for i, n in enumerate(node_names(self.count))]
        self.logs = cluster.logs
        self.record: dict = {}
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------ the record (lock)

    @staticmethod
    def read_record() -> dict | None:
        try:
            return json.loads(RECORD.read_text())
        except (OSError, ValueError):
            return None

    def _save(self) -> None:
        RUN_ROOT.mkdir(parents=True, exist_ok=True)
        tmp = RECORD.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=2))
        tmp.replace(RECORD)

    @staticmethod
    @contextlib.contextmanager
    def _locked(timeout: float = 120):
        """Serialise ``up``/``down`` of real nodes on this machine."""
        try:
            RUN_ROOT.mkdir(parents=True, exist_ok=True)
            fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except PermissionError as exc:
            raise NodeError(f"cannot write {RUN_ROOT}: real nodes need root") from exc
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise NodeError(f"{LOCK} stayed locked for {timeout:.0f}s: another "
                                        "up/down of real nodes is running") from None
                    time.sleep(0.2)
            yield
        finally:
            os.close(fd)

    @classmethod
    def record_alive(cls, record: dict) -> bool:
        """Whether any process a record names still runs."""
        for entry in record.get("pids", {}).values():
            if _alive(entry["pid"]) and _exe_name(entry["pid"]) == entry["exe"]:
                return True
        return any(_pids_in_mount_ns(RUN_ROOT / n / "mnt") for n in record.get("nodes", []))

    def alive(self) -> bool:
        """True when this cluster owns the real nodes and all their processes run."""
        record = self.read_record()
        if not record or record.get("owner") != self.owner:
            return False
        pids = record.get("pids", {})
        want = {"kube-proxy"} | {f"{c}/{n.name}" for n in self.nodes
                                 for c in ("containerd", "kubelet", "gpuplugin")}
        if not want <= set(pids):
            return False
        return all(_alive(pids[k]["pid"]) and _exe_name(pids[k]["pid"]) == pids[k]["exe"]
                   for k in want)

    # ------------------------------------------------------------ preflight

    def check_host(self) -> None:
        """One line naming what is missing (root, a host package, a Go binary)."""
        if os.geteuid() != 0:
            raise NodeError("real nodes need root (kubelet, containerd, mounts, iptables)")
        if not 1 <= self.count <= MAX_NODES:
            raise NodeError(f"--real-nodes must be between 1 and {MAX_NODES}")
        for what, path in HOST_PROGRAMS.items():
            if not os.access(path, os.X_OK):
                raise NodeError(f"{what} not found ({path}): run tools/host.sh")
        if not Path("/sys/fs/cgroup/memory").is_dir():
            raise NodeError("no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory: the real "
                            "nodes are set up for cgroup v1 (cgroupfs driver)")
        for name in ("kubelet", "kube-proxy", "gpuplugin"):
            if name not in self.cluster.config.binaries:
                raise NodeError(f"{name} not found: build it with tools/build.sh")

    # ------------------------------------------------------------ start

    def prepare_host(self) -> None:
        """Take the machine's real-node record (refusing when another live cluster
        holds it), then the host's network: sysctls, the dummy link and its addresses,
        the forward rules. Runs before the API server starts (it binds API_IP)."""
        self.check_host()
        with self._locked():
            record = self.read_record()
            if record and record.get("owner") != self.owner:
                if self.record_alive(record):
                    other = record.get("owner")
                    raise NodeError(
                        f"real nodes are in use by the cluster in {other} (one real-node "
                        f"cluster per machine): stop it with e2e/cluster/down --dir {other}")
                self._cleanup(record)  # a dead cluster's leftovers
            elif record:
                self._cleanup(record)
            self.record = {"owner": self.owner, "nodes": [n.name for n in self.nodes],
                           "pids": {}, "sysctls": {}, "created_dirs": [],
                           "private_run_root": False, "started": time.time()}
            self._save()
            self._host_network()

    def _host_network(self) -> None:
        for key, value in SYSCTLS.items():
            path = Path("/proc/sys") / key
            if not path.exists():
                if key.startswith("net/bridge"):
                    continue  # no br_netfilter: bridged pod-to-Service traffic may not work
                raise NodeError(f"{path} missing")
            old = path.read_text().strip()
            if old != value:
                self.record["sysctls"][key] = old
                self._save()
                path.write_text(value)
        # A dummy link; an empty bridge where the kernel has no dummy driver (this VM's):
        # either holds local addresses that pods reach through the host.
        if not _link_exists(LINK) and subprocess.run(
                ["ip", "link", "add", LINK, "type", "dummy"], capture_output=True).returncode:
            _run(["ip", "link", "add", LINK, "type", "bridge"], f"create the {LINK} link")
        addrs = _run(["ip", "-o", "-4", "addr", "show", "dev", LINK], "read addresses")
        for ip in [API_IP, *(n.ip for n in self.nodes)]:
            if f" {ip}/" not in addrs:
                _run(["ip", "addr", "add", f"{ip}/32", "dev", LINK], f"add {ip} to {LINK}")
        _run(["ip", "link", "set", LINK, "up"], f"bring {LINK} up")
        # Pod traffic through the host (pod <-> pod across nodes, pod -> Service), even
        # where FORWARD's policy is DROP (docker's default).
        _run(["iptables", "-w", "-N", FORWARD_CHAIN], "iptables", check=False)
        _run(["iptables", "-w", "-F", FORWARD_CHAIN], "iptables")
        for flag in ("-s", "-d"):
            _run(["iptables", "-w", "-A", FORWARD_CHAIN, flag, CLUSTER_CIDR, "-j", "ACCEPT"],
                 "iptables")
        if subprocess.run(["iptables", "-w", "-C", "FORWARD", "-j", FORWARD_CHAIN],
                          capture_output=True).returncode != 0:
            _run(["iptables", "-w", "-I", "FORWARD", "1", "-j", FORWARD_CHAIN], "iptables")

    def start(self, timeout: float = 240) -> float:
        """Start every node and kube-proxy against the running control plane; wait
        until every node is Ready with its GPUs. Returns seconds taken."""
        t0, since = time.monotonic(), time.time()
        with self._locked():
            self.record = self.read_record() or {}
            if self.record.get("owner") != self.owner:
                raise NodeError("prepare_host() first: the real-node record is not this "
                                "cluster's")
            images = ociimage.builtin_images(CACHE_ROOT / "images")
            self._certs()
            self._register_nodes()
            self._private_run_root()
            for node in self.nodes:
                self._start_node(node, images, timeout)
            self._start_kube_proxy(timeout)
            dns.start(self, API_IP, RUN_ROOT / "Corefile", timeout)
        self._wait_nodes_ready(timeout, since)
        self.timings["nodes"] = time.monotonic() - t0
        return self.timings["nodes"]

    def _certs(self) -> None:
        pki = self.cluster.pki
        for node in self.nodes:
            ensure_client_cert(pki, f"node-{node.name}", f"system:node:{node.name}",
                               "system:nodes")
            self.cluster._kubeconfig(self.cluster.workdir / f"kubelet-{node.name}.kubeconfig",
                                     f"system:node:{node.name}", f"node-{node.name}")
        ensure_client_cert(pki, "kube-proxy", "system:kube-proxy")
        self.cluster._kubeconfig(self.cluster.workdir / "kube-proxy.kubeconfig",
                                 "system:kube-proxy", "kube-proxy")

    def node_manifests(self) -> list[dict]:
        """The Node objects, made before their kubelets register: the pod CIDR each
        node's CNI config uses, and GPU Feature Discovery's labels (as on the KWOK
        GPU nodes, so the operator's node affinity selects them)."""
        c = self.cluster.config
        return [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": n.name,
                    "labels": {
                        REAL_NODE_LABEL: "true",
                        "kubernetes.io/hostname": n.name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "node.kubernetes.io/instance-type": "spillway-real-node",
                        **node_gpu_labels(c, c.real_node_products, i),
                    },
                },
                "spec": {"podCIDR": n.pod_cidr, "podCIDRs": [n.pod_cidr]},
            }
            for i, n in enumerate(self.nodes)
        ]

    def _register_nodes(self) -> None:
        manifest = self.cluster.workdir / "real-nodes.yaml"
        manifest.write_text(yaml.safe_dump_all(self.node_manifests()))
        self.cluster.kubectl("apply", "--server-side", "--field-manager=spillway-harness",
                             "-f", manifest)

    def _private_run_root(self) -> None:
        if _shared_mount_of(RUN_ROOT) and not _is_mount_point(RUN_ROOT):
            _run(["mount", "--bind", str(RUN_ROOT), str(RUN_ROOT)], "bind /run/spillway/nodes")
            self.record["private_run_root"] = True
            self._save()
            _run(["mount", "--make-private", str(RUN_ROOT)], "make /run/spillway/nodes private")

    # --------------------------------------------------------------- one node

    def _spawn(self, key: str, argv: list[str], log_name: str,
               ns: Path | None = None) -> subprocess.Popen:
        log = open(self.logs / log_name, "ab")  # noqa: SIM115 - owned by the child
        cmd = (["nsenter", f"--mount={ns}", "--"] if ns else []) + argv
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, "PATH": PATH},
        )
        log.close()
        self.record.setdefault("pids", {})[key] = {"pid": proc.pid,
                                                   "exe": Path(argv[0]).name}
        self._save()
        return proc

    def _log_tail(self, log_name: str, lines: int = 25) -> str:
        try:
            text = (self.logs / log_name).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def _wait(self, what: str, check: Callable[[], bool], proc: subprocess.Popen | None,
              log_name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise NodeError(f"{log_name[:-4]} exited ({proc.returncode}) while waiting for "
                                f"{what}; last lines of {self.logs / log_name}:\n"
                                f"{self._log_tail(log_name)}")
            if check():
                return
            time.sleep(0.2)
        raise NodeError(f"timed out after {timeout:.0f}s waiting for {what}; last lines of "
                        f"{self.logs / log_name}:\n{self._log_tail(log_name)}")

    def _make_namespace(self, node: NodeSpec) -> None:
        for host_dir, target in node.mounts():
            host_dir.mkdir(parents=True, exist_ok=True)
            if not Path(target).exists():  # a mount point on the host, empty there
                Path(target).mkdir(parents=True)
                self.record["created_dirs"].append(target)
                self._save()
        node.run_dir.mkdir(parents=True, exist_ok=True)
        node.ns_file.touch()
        _run(["unshare", f"--mount={node.ns_file}", "--propagation", "slave", "true"],
             f"{node.name}: create its mount namespace")
        script = "set -e\n" + "".join(
            f"mount --bind {shlex.quote(str(src))} {shlex.quote(dst)}\n"
            for src, dst in node.mounts())
        _run(["nsenter", f"--mount={node.ns_file}", "--", "sh", "-c", script],
             f"{node.name}: bind its folders in its mount namespace")

    def _cgroup_root(self, node: NodeSpec) -> None:
        """The kubelet's cgroupRoot must exist in every hierarchy; a cpuset cgroup needs
        its cpus and mems before tasks can join its children."""
        base = Path("/sys/fs/cgroup")
        for hierarchy in sorted(base.iterdir()):
            if not (hierarchy / "cgroup.procs").exists() or hierarchy.name == "unified":
                continue
            d = hierarchy / node.name
            d.mkdir(exist_ok=True)
            if hierarchy.name == "cpuset":
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if not (d / f).read_text().strip():
                        (d / f).write_text((hierarchy / f).read_text())

    def _write_configs(self, node: NodeSpec) -> dict[str, Path]:
        c = self.cluster
        d = node.run_dir
        containerd = d / "containerd.toml"
        containerd.write_text(f"""\
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{ociimage.PAUSE_REF}"
  # This machine refuses negative oom_score_adj; without this every sandbox fails with
  # "runc create failed: can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
""")
        cni = {
            "cniVersion": "1.0.0",
            "name": "spillway",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": node.bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": node.pod_cidr, "gateway": node.gateway}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (d / "cni-conf" / "10-spillway.conflist").write_text(json.dumps(cni, indent=2))
        kubelet = d / "kubelet.yaml"
        kubelet.write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": node.ip,
            "port": KUBELET_PORT,
            "readOnlyPort": 0,
            "healthzBindAddress": node.ip,
            "healthzPort": 10248,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(c.pki / "ca.crt")},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            # This machine: cgroup v1, no systemd, swap allowed.
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": node.cgroup_root,
            "failCgroupV1": False,
            "failSwapOn": False,
            # Nothing is evicted or collected on a big, well-used disk: small absolute
            # thresholds, image GC off (the node's images are imported, not pulled).
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1Gi",
                "imagefs.available": "1Gi",
                "nodefs.inodesFree": "1%",
                "imagefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "maxPods": 110,
            "nodeStatusUpdateFrequency": "5s",
            "syncFrequency": "15s",
            "resolvConf": "/etc/resolv.conf",
            **dns.kubelet_settings(API_IP),  # pods resolve cluster names
            "rotateCertificates": False,
            "containerLogMaxSize": "10Mi",
        }))
        return {"containerd": containerd, "kubelet": kubelet}

    def _ctr(self, node: NodeSpec, *args: str, step: str, check: bool = True,
             timeout: float = 120) -> str:
        return _run(["ctr", "--address", str(node.socket), "--namespace", "k8s.io", *args],
                    f"{node.name}: {step}", check=check, timeout=timeout)

    def _start_containerd(self, node: NodeSpec, config: Path, timeout: float) -> None:
        log = f"containerd-{node.name}.log"
        proc = self._spawn(f"containerd/{node.name}",
                           ["/usr/bin/containerd", "--config", str(config)], log, node.ns_file)

        def answers() -> bool:
            return subprocess.run(["ctr", "--address", str(node.socket), "version"],
                                  capture_output=True, timeout=10).returncode == 0

        self._wait(f"{node.name}'s containerd to answer on {node.socket}", answers, proc, log,
                   timeout)

    def _start_node(self, node: NodeSpec, images: list[ociimage.OCIImage],
                    timeout: float) -> None:
        t0 = time.monotonic()
        shutil.rmtree(node.scratch, ignore_errors=True)
        for sub in ("cni-conf", "netns", "containerd"):
            shutil.rmtree(node.run_dir / sub, ignore_errors=True)
        self._make_namespace(node)
        self._cgroup_root(node)
        configs = self._write_configs(node)
        self._start_containerd(node, configs["containerd"], timeout)
        # Containers a killed run left in containerd's (kept) metadata: remove them and
        # restart containerd, so its CRI plugin starts with no stale sandboxes.
        stale = self._ctr(node, "containers", "ls", "-q", step="list containers").split()
        if stale:
            self._ctr(node, "containers", "rm", *stale, step="remove stale containers",
                      check=False)
            key = f"containerd/{node.name}"
            _kill_all([self.record["pids"][key]["pid"]], 15, group=True)
            self._start_containerd(node, configs["containerd"], timeout)
        for image in images:
            self.import_archive(node, image)
        log = f"kubelet-{node.name}.log"
        proc = self._spawn(f"kubelet/{node.name}", [
            str(self.cluster.config.binaries["kubelet"]),
            f"--config={configs['kubelet']}",
            f"--kubeconfig={self.cluster.workdir / f'kubelet-{node.name}.kubeconfig'}",
            f"--hostname-override={node.name}",
            f"--node-ip={node.ip}",
            "--v=1",
        ], log, node.ns_file)
        socket = node.scratch / "kubelet" / "device-plugins" / "kubelet.sock"
        self._wait(f"{node.name}'s kubelet device-plugin socket", socket.exists, proc, log,
                   timeout)
        self._spawn(f"gpuplugin/{node.name}", [
            str(self.cluster.config.binaries["gpuplugin"]),
            f"--count={self.cluster.config.gpus_per_node}",
            f"--id-prefix=GPU-{node.name}",
        ], f"gpuplugin-{node.name}.log", node.ns_file)
        self.timings[node.name] = time.monotonic() - t0

    def import_archive(self, node: NodeSpec, image: ociimage.OCIImage) -> bool:
        """Import one of our OCI archives unless the node holds that very manifest."""
        listed = self._ctr(node, "images", "ls", f"name=={image.ref}", step="list images")
        if image.manifest_digest in listed:
            return False
        self._ctr(node, "images", "import", str(image.archive), step=f"import {image.ref}")
        return True

    def _start_kube_proxy(self, timeout: float) -> None:
        config = RUN_ROOT / "kube-proxy.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {
                "kubeconfig": str(self.cluster.workdir / "kube-proxy.kubeconfig")},
            "hostnameOverride": self.nodes[0].name,
            "mode": "iptables",
            "clusterCIDR": CLUSTER_CIDR,
            "detectLocalMode": "ClusterCIDR",
            "healthzBindAddress": PROXY_HEALTHZ,
            "metricsBindAddress": f"{API_IP}:10249",
            "nodePortAddresses": [f"{NET_PREFIX}.0/24"],
            "oomScoreAdj": 0,
            "iptables": {"localhostNodePorts": False, "masqueradeAll": False,
                         "syncPeriod": "30s", "minSyncPeriod": "1s"},
            # 0: leave the host's conntrack settings as they are.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }))
        log = "kube-proxy.log"
        proc = self._spawn("kube-proxy", [str(self.cluster.config.binaries["kube-proxy"]),
                                          f"--config={config}", "--v=1"], log)

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://{PROXY_HEALTHZ}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        self._wait("kube-proxy /healthz", healthy, proc, log, timeout)

    def _wait_nodes_ready(self, timeout: float, since: float) -> None:
        """Every node Ready with its GPUs, as its kubelet of this run says: a Node kept
        in etcd from a previous run says Ready until the controller sees it is stale,
        so only a Ready heartbeat after ``since`` (wall clock) counts."""
        want = str(self.cluster.config.gpus_per_node)
        seen: dict[str, str] = {}

        def fresh(cond: dict) -> bool:
            beat = cond.get("lastHeartbeatTime") or ""
            try:
                t = dt.datetime.strptime(beat, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
            except ValueError:
                return False
            return t.timestamp() >= since - 1

        def ready() -> bool:
            out = self.cluster.kubectl("get", "nodes", "-l", f"{REAL_NODE_LABEL}=true",
                                       "-o", "json", check=False)
            try:
                items = json.loads(out)["items"]
            except (ValueError, KeyError):
                return False
            for item in items:
                cond = {c["type"]: c for c in item["status"].get("conditions", [])}
                ready = cond.get("Ready", {})
                status = ready.get("status") if fresh(ready) else "(not since this start)"
                gpus = item["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")
                seen[item["metadata"]["name"]] = f"Ready={status} gpus={gpus}"
            return all(seen.get(n.name) == f"Ready=True gpus={want}" for n in self.nodes)

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes:
                key = f"kubelet/{node.name}"
                pid = self.record["pids"][key]["pid"]
                if not _alive(pid):
                    log = f"kubelet-{node.name}.log"
                    raise NodeError(f"{node.name}'s kubelet exited; last lines of "
                                    f"{self.logs / log}:\n{self._log_tail(log)}")
            if ready():
                return
            time.sleep(0.5)
        tails = "\n".join(
            f"--- {log}:\n{self._log_tail(log, 12)}"
            for n in self.nodes for log in (f"kubelet-{n.name}.log", f"gpuplugin-{n.name}.log"))
        raise NodeError(f"timed out after {timeout:.0f}s waiting for the real nodes to be Ready "
                        f"with {want} nvidia.com/gpu each (seen: {seen}):\n{tails}")

    # ------------------------------------------------------------ images

    def runtimes(self) -> list[tuple[str, Path]]:
        """(node name, containerd socket on the host) of every node: for the loader."""
        return [(n.name, n.socket) for n in self.nodes]

    # ------------------------------------------------------------ stop

    def stop(self, timeout: float = 30) -> None:
        """Undo everything the record of this cluster names; a no-op when the machine's
        real nodes belong to another cluster or to none."""
        record = self.read_record()
        if not record or record.get("owner") != self.owner:
            return
        with self._locked():
            record = self.read_record()
            if record and record.get("owner") == self.owner:
                self._cleanup(record, timeout)

    @classmethod
    def cleanup_any(cls, timeout: float = 30) -> str | None:
        """Undo the machine's real nodes whoever owns them (``python -m e2e.nodes
        down``); returns the owner's workdir, or None when there were none."""
        record = cls.read_record()
        if not record:
            return None
        with cls._locked():
            record = cls.read_record()
            if record:
                cls._cleanup(record, timeout)
        return record.get("owner") if record else None

    @staticmethod
    def _cleanup(record: dict, timeout: float = 30) -> None:
        problems: list[str] = []
        pids = record.get("pids", {})

        def ours(key: str) -> list[int]:
            entry = pids.get(key)
            if entry and _alive(entry["pid"]) and _exe_name(entry["pid"]) == entry["exe"]:
                return [entry["pid"]]
            return []

        _kill_all(ours("kube-proxy") + ours("coredns"), timeout, group=True)
        nodes = [NodeSpec(name, i) for i, name in enumerate(record.get("nodes", []))]
        for node in nodes:
            _kill_all(ours(f"kubelet/{node.name}") + ours(f"gpuplugin/{node.name}"), timeout,
                      group=True)
        for node in nodes:
            deadline = time.monotonic() + timeout
            while (procs := _cgroup_pids(node.cgroup_root)) and time.monotonic() < deadline:
                for pid in procs:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
            _kill_all(ours(f"containerd/{node.name}"), 10, group=True)
            # What is left in the node's namespace: containerd shims, nsenter children.
            _kill_all(_pids_in_mount_ns(node.ns_file), 5)
            if _is_mount_point(node.ns_file):
                _run(["umount", str(node.ns_file)], f"{node.name}: unmount its namespace",
                     check=False)
            problems += _remove_cgroups(node.cgroup_root)
            if _link_exists(node.bridge):
                _run(["ip", "link", "del", node.bridge], f"delete {node.bridge}", check=False)
            shutil.rmtree(node.scratch, ignore_errors=True)
            shutil.rmtree(node.run_dir, ignore_errors=True)
        iptables_cleanup()
        if _link_exists(LINK):
            _run(["ip", "link", "del", LINK], f"delete {LINK}", check=False)
        for key, old in record.get("sysctls", {}).items():
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / key).write_text(old)
        for d in reversed(record.get("created_dirs", [])):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        for config in ("kube-proxy.yaml", "Corefile"):
            with contextlib.suppress(FileNotFoundError):
                (RUN_ROOT / config).unlink()
        if record.get("private_run_root") and _is_mount_point(RUN_ROOT):
            _run(["umount", str(RUN_ROOT)], "unmount /run/spillway/nodes", check=False)
        with contextlib.suppress(FileNotFoundError):
            RECORD.unlink()
        if problems:
            raise NodeError("real nodes stopped, but these cgroups would not go: "
                            + ", ".join(problems[:5]))
