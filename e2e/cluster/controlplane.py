"""Start, check and stop a real Kubernetes control plane on loopback.

Processes: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the
KWOK controller and (``ClusterConfig.lws``, on by default) LeaderWorkerSet's controller
manager, each in its own process group with its log in ``<workdir>/logs``.
State (pids, ports) lives in ``<workdir>/state.json`` so that ``up`` is idempotent
and ``down`` works from another process. Every wait has a deadline and fails with
the tail of the component's log instead of hanging.

With ``ClusterConfig.real_nodes`` > 0 the cluster also gets real nodes (a kubelet,
containerd and runc each, pod networking, kube-proxy, fake GPUs through a device
plugin: ``e2e/nodes``); the API server then listens on the address pods reach it at
(``e2e.nodes.realnodes.API_IP``) instead of 127.0.0.1, and the endpoint controllers run.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from e2e.cluster.errors import ClusterError
from e2e.cluster.gfd import node_gpu_labels
from e2e.cluster.pki import ensure_client_cert, ensure_serving_cert, make_pki
from e2e.processes import alive

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSIONS_FILE = REPO_ROOT / "tools" / "versions.env"
STAGES_FILE = Path(__file__).with_name("kwok-stages.yaml")

# Service network: with KWOK nodes never routed (no kube-proxy), only the apiserver
# needs one to allocate ClusterIPs, pod IPs are loopback (ClusterConfig.pod_net); with
# real nodes kube-proxy routes it and 10.0.0.1 is the API server (the `kubernetes`
# Service).
SERVICE_CIDR = "10.0.0.0/16"  # room for the 1000-object benches (two Services each)

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
#: LeaderWorkerSet's controller manager (controllers and webhooks), started after the
#: others when ``ClusterConfig.lws`` is on; its binary has the same name.
LWS_COMPONENT = "lws-controller"
#: The CRD LeaderWorkerSet's controller serves (leaderworkerset.x-k8s.io/v1).
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    versions = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            versions[key] = value
    return versions


def default_bin_cache() -> Path:
    return Path(os.environ.get("SPILLWAY_BIN_CACHE", Path.home() / ".cache/spillway/bin"))


def locate_binaries(cache: Path | None = None, real_nodes: bool = False,
                    lws: bool = True) -> dict[str, Path]:
    """Map each binary name to its path in the version-keyed cache that
    ``tools/build.sh`` fills; a missing one is a ClusterError naming the fix.
    ``real_nodes``: also the real nodes' kubelet, kube-proxy, GPU device plugin and
    CoreDNS.
    ``lws``: LeaderWorkerSet's controller manager, whose folder also holds its CRD and
    webhook manifests (``lws_manifests``)."""
    cache = cache or default_bin_cache()
    v = read_versions()
    families = {
        "etcd": f"etcd-v{v['ETCD_VERSION']}",
        "kube-apiserver": f"k8s-v{v['K8S_VERSION']}",
        "kube-controller-manager": f"k8s-v{v['K8S_VERSION']}",
        "kube-scheduler": f"k8s-v{v['K8S_VERSION']}",
        "kubectl": f"k8s-v{v['K8S_VERSION']}",
        "kwok": f"kwok-v{v['KWOK_BUILD']}",
        "helm": f"helm-v{v['HELM_VERSION']}",
    }
    if lws:
        families[LWS_COMPONENT] = f"lws-v{v['LWS_VERSION']}"
    if real_nodes:
        families |= {
            "kubelet": f"node-v{v['K8S_VERSION']}",
            "kube-proxy": f"node-v{v['K8S_VERSION']}",
            "gpuplugin": f"gpuplugin-v{v['GPUPLUGIN_BUILD']}",
            "coredns": f"coredns-v{v['COREDNS_VERSION']}",
        }
    found, missing = {}, []
    for name, family in families.items():
        path = cache / family / name
        if path.is_file() and os.access(path, os.X_OK):
            found[name] = path
        else:
            missing.append(str(path))
    if missing:
        raise ClusterError(
            "missing binaries: " + ", ".join(missing) + " -- build them with tools/build.sh "
            "(or point SPILLWAY_BIN_CACHE at a folder that holds them)"
        )
    return found


#: The InferencePool CRD of the Gateway API Inference Extension (inference.networking.k8s.io/v1).
GIE_INFERENCE_POOL_CRD = "inference.networking.k8s.io_inferencepools.yaml"


def locate_gie_crds(cache: Path | None = None) -> Path:
    """The folder of the Gateway API Inference Extension's CRDs that ``tools/build.sh``
    fetches from its Go module (pinned GIE_VERSION); missing is a ClusterError naming
    the fix, as for the binaries."""
    cache = cache or default_bin_cache()
    folder = cache / f"gie-v{read_versions()['GIE_VERSION']}" / "crds"
    if not (folder / GIE_INFERENCE_POOL_CRD).is_file():
        raise ClusterError(
            f"missing {folder / GIE_INFERENCE_POOL_CRD} -- fetch it with tools/build.sh "
            "(or point SPILLWAY_BIN_CACHE at a folder that holds it)")
    return folder


def lws_manifests(binary: Path) -> tuple[Path, Path]:
    """LeaderWorkerSet's CRD folder and webhook manifests folder, which
    ``tools/build.sh`` copies from its Go module next to its controller's ``binary``."""
    crds, webhook = binary.parent / "crds", binary.parent / "webhook"
    for need in (crds / "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
                 *(webhook / f"{f}.yaml" for f in ("manifests", "mutating-patch",
                                                   "validating-patch"))):
        if not need.is_file():
            raise ClusterError(f"missing {need} -- fetch it with tools/build.sh")
    return crds, webhook


def lws_webhook_configurations(webhook_dir: Path, port: int, ca_bundle: bytes) -> list[dict]:
    """LeaderWorkerSet's Mutating- and ValidatingWebhookConfiguration as its release
    installs them (``config/webhook/manifests.yaml`` with the kustomize patches that
    limit the pod webhooks to LWS's pods), named as its release names them
    (``lws-`` prefix), each webhook pointed at ``https://127.0.0.1:<port><path>``
    with ``ca_bundle`` instead of the in-cluster Service it names."""
    docs = [d for d in yaml.safe_load_all((webhook_dir / "manifests.yaml").read_text()) if d]
    patches = {"MutatingWebhookConfiguration": "mutating-patch.yaml",
               "ValidatingWebhookConfiguration": "validating-patch.yaml"}
    for doc in docs:
        patch = webhook_dir / patches[doc["kind"]]
        for op in yaml.safe_load(patch.read_text()):
            parts = op["path"].strip("/").split("/")
            if op["op"] != "replace" or len(parts) != 2 or parts[0] != "webhooks":
                raise ClusterError(f"{patch}: unexpected patch {op['op']} {op['path']}")
            doc["webhooks"][int(parts[1])] = op["value"]
        doc["metadata"]["name"] = "lws-" + doc["metadata"]["name"]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
    return docs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pod_nets_in_use() -> set[str]:
    """The ``127.N`` pod networks other local clusters on this machine use: those of
    running KWOK controllers (their ``--cidr``) and of sockets bound to 127.N.x.y
    (engine simulators standing in for pods)."""
    used: set[str] = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            for arg in cmdline.read_bytes().split(b"\0"):
                if arg.startswith(b"--cidr=127."):
                    used.add(".".join(arg[len(b"--cidr="):].decode().split(".")[:2]))
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            local = line.split()[1].split(":")[0]  # little-endian hex IPv4
            octets = [int(local[i:i + 2], 16) for i in (6, 4, 2, 0)]
            if octets[0] == 127:
                used.add(f"127.{octets[1]}")
    return used


def pod_net_share() -> range:
    """The 127.N this process picks from: all of 2-254, or, in one of several test
    processes (pytest-xdist's PYTEST_XDIST_WORKER gwI of PYTEST_XDIST_WORKER_COUNT),
    every count-th from 2 + I, so two processes starting clusters at once never pick the
    same free network before either is in use."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count < 2:
        return range(2, 255)
    return range(2 + int(worker[2:]) % count, 255, count)


def free_pod_net(avoid: set[str] | None = None) -> str:
    """A ``127.N`` pod network no running local cluster uses (127.0 is the host's own
    loopback, 127.1 the default of e2e/cluster/up), from this process's share."""
    taken = pod_nets_in_use() | {"127.0", "127.1"} | (avoid or set())
    for n in pod_net_share():
        if f"127.{n}" not in taken:
            return f"127.{n}"
    raise ClusterError("every 127.N pod network is in use by a local cluster")


@dataclass
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int
    # LeaderWorkerSet's controller: its webhook server (TLS, called by the API server),
    # metrics and health probe. 0 in the state of a cluster started before LWS was.
    lws_webhook: int = 0
    lws_metrics: int = 0
    lws_health: int = 0

    @classmethod
    def from_base(cls, base: int) -> Ports:
        return cls(*range(base, base + 9))

    @classmethod
    def free(cls) -> Ports:
        return cls(*(free_port() for _ in range(9)))


@dataclass
class ClusterConfig:
    workdir: Path
    ports: Ports
    nodes: int = 2
    gpus_per_node: int = 8
    # Each node's GPU: a catalogue name (h100, a100, b200...) or a GFD product label;
    # nodes carry GPU Feature Discovery's labels for it (e2e/cluster/gfd.py), which the
    # operator selects nodes by. KWOK node i gets gpu_products[i], real node i
    # real_node_products[i]; nodes past the end of the list get gpu_product.
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    gpu_products: tuple[str, ...] = ()
    real_node_products: tuple[str, ...] = ()
    # nvidia.com/gpu.memory of the default product (None: the catalogue's figure)
    gpu_memory_mib: int | None = 81559
    node_cpu: str = "224"
    node_memory: str = "2Ti"
    # Node N gets podCIDR <pod_net>.N.0/24. Anything in 127/8 routes to lo on Linux,
    # so a local process bound to a pod IP stands in for that pod's container.
    pod_net: str = "127.1"
    binaries: dict[str, Path] = field(default_factory=dict)
    # Set to use an existing cluster (kind, a real one) instead of starting ours.
    external_kubeconfig: Path | None = None
    # kube-controller-manager's --node-monitor-grace-period (None: its default, 50 s).
    # Past it, a node whose lease was not renewed is unreachable and its pods are marked
    # not Ready; no kubelet marks them Ready again here (KWOK does not), so tests that
    # stop the API server longer than that set it higher.
    node_monitor_grace_seconds: int | None = None
    # Real nodes (e2e/nodes): a kubelet, containerd and runc each, beside the KWOK
    # nodes (``nodes``, which may be 0). One real-node cluster per machine; needs root.
    real_nodes: int = 0
    # LeaderWorkerSet's controller and webhooks, and its CRD (multi-node replicas).
    # Off: no LWS API at all, as on a cluster that never installed it.
    lws: bool = True

    @property
    def kubeconfig(self) -> Path:
        return self.external_kubeconfig or self.workdir / "kubeconfig"

    @property
    def api_address(self) -> str:
        """Where the API server listens: loopback, or with real nodes the address
        their pods reach it at (the ``kubernetes`` Service's endpoint)."""
        if self.real_nodes:
            from e2e.nodes.realnodes import API_IP

            return API_IP
        return "127.0.0.1"

    @property
    def server(self) -> str:
        return f"https://{self.api_address}:{self.ports.apiserver}"


class LocalCluster:
    """One local control plane. ``start()`` is idempotent; ``stop()`` leaves nothing."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.workdir = config.workdir
        self.pki = self.workdir / "pki"
        self.logs = self.workdir / "logs"
        self.state_file = self.workdir / "state.json"
        self.pids: dict[str, int] = {}
        self.timings: dict[str, float] = {}

    # ---------------------------------------------------------------- state

    def _load_state(self) -> dict | None:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None

    def _save_state(self) -> None:
        state = {
            "pids": self.pids,
            "ports": asdict(self.config.ports),
            "kubeconfig": str(self.config.kubeconfig),
            "nodes": self.config.nodes,
            "pod_net": self.config.pod_net,
            "real_nodes": self.config.real_nodes,
            "lws": self.config.lws,
        }
        self.state_file.write_text(json.dumps(state, indent=2))

    _alive = staticmethod(alive)

    def components(self, lws: bool | None = None) -> tuple[str, ...]:
        """The processes of this cluster, in start order."""
        lws = self.config.lws if lws is None else lws
        return (*COMPONENTS, LWS_COMPONENT) if lws else COMPONENTS

    def running(self) -> bool:
        """True when every component of a previous start is alive and the API answers."""
        state = self._load_state()
        lws = bool(state and state.get("lws"))
        if not state or set(state.get("pids", {})) != set(self.components(lws)):
            return False
        if not all(self._alive(pid) for pid in state["pids"].values()):
            return False
        self.config.ports = Ports(**state["ports"])
        self.config.pod_net = state.get("pod_net", self.config.pod_net)
        self.config.real_nodes = state.get("real_nodes", 0)
        self.config.lws = lws
        self.pids = {k: int(v) for k, v in state["pids"].items()}
        if self.config.real_nodes and not self.real_nodes().alive():
            return False
        return self._http_ok(f"{self.config.server}/readyz", self._ssl())

    def real_nodes(self):
        """The handle on this cluster's real nodes (``e2e.nodes.RealNodes``): their
        names, containerd sockets (``runtimes()``) for the image loader."""
        from e2e.nodes.realnodes import RealNodes

        return RealNodes(self)

    # ---------------------------------------------------------------- helpers

    def _ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki / "ca.crt"))

    @staticmethod
    def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
        try:
            with urllib.request.urlopen(url, context=context, timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError, ssl.SSLError):
            return False

    def _log_tail(self, name: str, lines: int = 25) -> str:
        try:
            text = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def _wait(self, what: str, check: Callable[[], bool], component: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.pids.get(component)
            if pid is not None and not self._alive(pid):
                raise ClusterError(
                    f"{component} exited while waiting for {what}; last log lines "
                    f"({self.logs / (component + '.log')}):\n{self._log_tail(component)}"
                )
            if check():
                return
            time.sleep(0.2)
        raise ClusterError(
            f"timed out after {timeout:.0f}s waiting for {what}; last lines of "
            f"{component}.log:\n{self._log_tail(component)}"
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        binary = self.config.binaries[name]
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [str(binary), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() kills the whole tree
        )
        log.close()
        self.pids[name] = proc.pid
        self._save_state()

    def _kubeconfig(self, path: Path, user: str, cert: str) -> None:
        def b64(p: Path) -> str:
            import base64

            return base64.b64encode(p.read_bytes()).decode()

        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "spillway-local",
                    "cluster": {
                        "server": self.config.server,
                        "certificate-authority-data": b64(self.pki / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate-data": b64(self.pki / f"{cert}.crt"),
                        "client-key-data": b64(self.pki / f"{cert}.key"),
                    },
                }
            ],
            "contexts": [
                {"name": "spillway-local", "context": {"cluster": "spillway-local", "user": user}}
            ],
            "current-context": "spillway-local",
        }
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)

    # ---------------------------------------------------------------- lifecycle

    def check_ports(self) -> None:
        taken = [
            f"{port} ({name})"
            for name, port in asdict(self.config.ports).items()
            if (self.config.lws or not name.startswith("lws_")) and not port_is_free(port)
        ]
        if taken:
            raise ClusterError(
                "ports already in use on 127.0.0.1: " + ", ".join(taken) + ". Another cluster "
                "may be running (e2e/cluster/down) or choose other ports (--port-base)."
            )

    def start(self, timeout: float = 120) -> float:
        """Start every component and the fake GPU nodes; return seconds to ready.

        If this workdir's cluster is already up, return 0 without touching it.
        """
        if self.running():
            return 0.0
        self.stop()  # leftovers of a half-started run
        real = self.config.real_nodes
        if not self.config.binaries or (real and "kubelet" not in self.config.binaries) or (
                self.config.lws and LWS_COMPONENT not in self.config.binaries):
            self.config.binaries = locate_binaries(real_nodes=bool(real), lws=self.config.lws)
        self.check_ports()
        t0 = time.monotonic()
        for d in (self.workdir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        nodes = self.real_nodes() if real else None
        make_pki(self.pki, server_ips=(self.config.api_address,) if real else ())
        try:
            if nodes is not None:
                nodes.prepare_host()  # before the API server: it binds the nodes' network
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._start_controllers(timeout)
            if self.config.lws:
                self._start_lws(timeout)
            else:  # a workdir an earlier start with LWS left its objects in
                self.kubectl("delete", "--ignore-not-found", "--timeout=60s",
                             f"crd/{LWS_CRD}",
                             "mutatingwebhookconfiguration/lws-mutating-webhook-configuration",
                             "validatingwebhookconfiguration/lws-validating-webhook-configuration")
            self._create_nodes(timeout)
            if nodes is not None:
                self.timings["real_nodes"] = nodes.start(max(timeout, 240))
        except BaseException:
            self.stop()
            raise
        self.timings["ready"] = time.monotonic() - t0
        return self.timings["ready"]

    def start_api_only(self, timeout: float = 120) -> float:
        """etcd and the API server alone: no controllers, scheduler, KWOK, nodes or LWS,
        so objects stay as they are written (a pod's status is what the caller writes;
        nothing schedules, evicts or collects it). For programs that only read the API,
        such as GIE's endpoint picker (e2e/gateway/gie.py); ``stop()`` stops it."""
        self.stop()
        self.config.binaries = self.config.binaries or locate_binaries(lws=False)
        self.check_ports()
        t0 = time.monotonic()
        for d in (self.workdir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        make_pki(self.pki)
        try:
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
        except BaseException:
            self.stop()
            raise
        self.timings["ready"] = time.monotonic() - t0
        return self.timings["ready"]

    def _start_etcd(self, timeout: float) -> None:
        p = self.config.ports
        client, peer = f"http://127.0.0.1:{p.etcd_client}", f"http://127.0.0.1:{p.etcd_peer}"
        data = self.workdir / "etcd"
        self._spawn(
            "etcd",
            [
                "--name=spillway",
                f"--data-dir={data}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=spillway={peer}",
                "--unsafe-no-fsync",  # test data only; fsync dominates start-up otherwise
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
        )
        self._wait("etcd /health", lambda: self._http_ok(client + "/health"), "etcd", timeout)

    def _start_apiserver(self, timeout: float) -> None:
        p, k = self.config.ports, self.pki
        if self.config.real_nodes:
            # Pods reach the API server through the `kubernetes` Service, whose endpoint
            # is the advertised address; it reaches the kubelets (logs, exec) by their
            # InternalIP with a client certificate they trust.
            ensure_client_cert(k, "apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                               "system:masters")
            address = self.config.api_address
            mode = [
                f"--bind-address={address}",
                f"--advertise-address={address}",
                f"--kubelet-client-certificate={k / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={k / 'apiserver-kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP",
            ]
        else:
            mode = [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # Endpoints validation refuses loopback; nothing reaches the kubernetes
                # Service from outside anyway.
                "--endpoint-reconciler-type=none",
            ]
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{p.etcd_client}",
                *mode,
                f"--secure-port={p.apiserver}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={k / 'apiserver.crt'}",
                f"--tls-private-key-file={k / 'apiserver.key'}",
                f"--client-ca-file={k / 'ca.crt'}",
                f"--service-account-key-file={k / 'sa.pub'}",
                f"--service-account-signing-key-file={k / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--v=1",
            ],
        )
        ctx = self._ssl()
        self._wait(
            "kube-apiserver /readyz",
            lambda: self._http_ok(f"{self.config.server}/readyz", ctx),
            "kube-apiserver",
            timeout,
        )
        self._kubeconfig(self.config.kubeconfig, "spillway-admin", "admin")
        for stem in ("controller-manager", "scheduler", "kwok"):
            self._kubeconfig(self.workdir / f"{stem}.kubeconfig", stem, stem)
        self.timings["apiserver"] = time.monotonic()

    def _start_controllers(self, timeout: float) -> None:
        p, k, w = self.config.ports, self.pki, self.workdir
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={w / 'controller-manager.kubeconfig'}",
                f"--authentication-kubeconfig={w / 'controller-manager.kubeconfig'}",
                f"--authorization-kubeconfig={w / 'controller-manager.kubeconfig'}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.controller_manager}",
                f"--cert-dir={w / 'controller-manager-certs'}",
                f"--root-ca-file={k / 'ca.crt'}",
                f"--service-account-private-key-file={k / 'sa.key'}",
                "--use-service-account-credentials",
                # Pod IPs are loopback, which Endpoints/EndpointSlices refuse; the
                # operator and tests address pods by IP instead. Real nodes' pods have
                # real IPs, and kube-proxy routes Services to them.
                "--controllers=*" if self.config.real_nodes else
                "--controllers=*,-endpoints-controller,-endpointslice-controller,"
                "-endpointslice-mirroring-controller",
                *([f"--node-monitor-grace-period={self.config.node_monitor_grace_seconds}s"]
                  if self.config.node_monitor_grace_seconds else []),
                "--v=1",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={w / 'scheduler.kubeconfig'}",
                f"--authentication-kubeconfig={w / 'scheduler.kubeconfig'}",
                f"--authorization-kubeconfig={w / 'scheduler.kubeconfig'}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.scheduler}",
                f"--cert-dir={w / 'scheduler-certs'}",
                "--v=1",
            ],
        )
        self._spawn(
            "kwok",
            [
                f"--kubeconfig={w / 'kwok.kubeconfig'}",
                f"--config={STAGES_FILE}",
                "--manage-nodes-with-label-selector=type=kwok",
                "--node-ip=127.0.0.1",
                f"--node-port={p.kwok}",
                f"--server-address=127.0.0.1:{p.kwok}",
                f"--cidr={self.config.pod_net}.255.0/24",
                "--node-lease-duration-seconds=40",
            ],
        )
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        for name, port in (
            ("kube-controller-manager", p.controller_manager),
            ("kube-scheduler", p.scheduler),
        ):
            url = f"https://127.0.0.1:{port}/healthz"
            self._wait(f"{name} /healthz", lambda u=url: self._http_ok(u, insecure), name, timeout)
        self._wait(
            "the default ServiceAccount (controller-manager running)",
            lambda: self._kubectl_ok("get", "serviceaccount", "default", "-n", "default"),
            "kube-controller-manager",
            timeout,
        )

    def _start_lws(self, timeout: float) -> None:
        """LeaderWorkerSet's controller manager as a host process: its CRD installed
        first (the controller fails without it), its webhook server on 127.0.0.1 with a
        serving certificate from our CA (its own rotation needs an in-cluster Service
        and Secret, so it is off), and its webhook configurations pointing the API
        server there. Ready when a server-side dry run of a LeaderWorkerSet comes back
        defaulted by its mutating webhook: the API server reached it."""
        p, k, w = self.config.ports, self.pki, self.workdir
        binary = self.config.binaries[LWS_COMPONENT]
        crds, webhook_dir = lws_manifests(binary)
        ensure_client_cert(k, "lws", "lws-controller-manager", "system:masters")
        ensure_serving_cert(k, "lws-webhook", "lws-webhook-service")
        certs = w / "lws-certs"
        certs.mkdir(exist_ok=True)
        for src, dst in (("lws-webhook.crt", "tls.crt"), ("lws-webhook.key", "tls.key")):
            (certs / dst).write_bytes((k / src).read_bytes())
            (certs / dst).chmod(0o600)
        self._kubeconfig(w / "lws.kubeconfig", "lws-controller-manager", "lws")
        self.kubectl("apply", "--server-side", "--force-conflicts",
                     "--field-manager=spillway-harness", "-f", crds)
        self.wait_established(LWS_CRD, timeout=timeout)
        config = w / "lws-config.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},  # one replica
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": p.lws_webhook, "certDir": str(certs)},
            "metrics": {"bindAddress": f"127.0.0.1:{p.lws_metrics}"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{p.lws_health}"},
        }))
        self._spawn(LWS_COMPONENT, [f"--config={config}", f"--kubeconfig={w / 'lws.kubeconfig'}",
                                    "--zap-devel=false", "--zap-log-level=info"])
        self.kubectl("apply", "--server-side", "--force-conflicts",
                     "--field-manager=spillway-harness", "-f", "-",
                     input=yaml.safe_dump_all(lws_webhook_configurations(
                         webhook_dir, p.lws_webhook, (k / "ca.crt").read_bytes())))
        self._wait("LeaderWorkerSet's controller /readyz",
                   lambda: self._http_ok(f"http://127.0.0.1:{p.lws_health}/readyz"),
                   LWS_COMPONENT, timeout)
        probe = yaml.safe_dump({
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": "spillway-webhook-probe", "namespace": "default"},
            "spec": {"leaderWorkerTemplate": {"size": 1, "workerTemplate": {"spec": {
                "containers": [{"name": "c", "image": "example.invalid/probe:0"}]}}}},
        })

        def defaulted_by_the_webhook() -> bool:
            try:
                out = self.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                   input=probe)
            except (ClusterError, subprocess.TimeoutExpired):
                return False
            network = json.loads(out)["spec"].get("networkConfig") or {}
            return network.get("subdomainPolicy") == "Shared"

        self._wait("LeaderWorkerSet's webhooks answering the API server",
                   defaulted_by_the_webhook, LWS_COMPONENT, timeout)
        self.timings["lws"] = time.monotonic()

    def node_manifests(self) -> list[dict]:
        c = self.config
        nodes = []
        for i in range(c.nodes):
            name = f"gpu-node-{i}"
            resources = {
                "cpu": c.node_cpu,
                "memory": c.node_memory,
                "ephemeral-storage": "3Ti",
                "pods": "110",
                "nvidia.com/gpu": str(c.gpus_per_node),
            }
            nodes.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                        "labels": {
                            "type": "kwok",
                            "kubernetes.io/hostname": name,
                            "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                            "node.kubernetes.io/instance-type": "fake-gpu",
                            # GPU Feature Discovery's labels, as on real GPU nodes.
                            **node_gpu_labels(c, c.gpu_products, i),
                        },
                    },
                    "spec": {
                        "podCIDR": f"{c.pod_net}.{i}.0/24",
                        "podCIDRs": [f"{c.pod_net}.{i}.0/24"],
                    },
                    "status": {"capacity": resources, "allocatable": dict(resources)},
                }
            )
        return nodes

    def _create_nodes(self, timeout: float) -> None:
        if self.config.nodes == 0:
            return
        manifest = self.workdir / "nodes.yaml"
        manifest.write_text(yaml.safe_dump_all(self.node_manifests()))
        self.kubectl("apply", "--server-side", "--field-manager=spillway-harness", "-f", manifest)
        names = [n["metadata"]["name"] for n in self.node_manifests()]

        def all_ready() -> bool:
            out = self.kubectl(
                "get", "nodes", "-l", "type=kwok", "-o",
                "jsonpath={range .items[*]}{.metadata.name}={.status.conditions"
                "[?(@.type=='Ready')].status} {end}",
                check=False,
            )
            ready = {kv.split("=")[0] for kv in out.split() if kv.endswith("=True")}
            return ready >= set(names)

        self._wait(f"{len(names)} fake GPU nodes Ready", all_ready, "kwok", timeout)

    # ---------------------------------------------------------------- outages

    def _stop_component(self, name: str, sig: signal.Signals, timeout: float) -> None:
        """Stop one component (``sig``, then KILL after ``timeout``) and forget its pid."""
        pid = self.pids.get(name)
        if pid is None:
            raise ClusterError(f"{name} is not running under this harness")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + timeout
        while self._alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            while self._alive(pid):
                time.sleep(0.05)
        del self.pids[name]
        self._save_state()

    def stop_apiserver(self, timeout: float = 15) -> None:
        """Stop kube-apiserver alone (an outage for the clients); etcd and the
        controllers stay up and reconnect once ``start_apiserver`` brings it back."""
        self._stop_component("kube-apiserver", signal.SIGTERM, timeout)

    def start_apiserver(self, timeout: float = 120) -> float:
        """Start kube-apiserver again on its port, with the same PKI and etcd; returns
        seconds until /readyz answers."""
        t0 = time.monotonic()
        self._start_apiserver(timeout)
        return time.monotonic() - t0

    def restart_apiserver(self, down_seconds: float, timeout: float = 120) -> float:
        """An API server outage of ``down_seconds``; returns seconds it was unreachable."""
        t0 = time.monotonic()
        self.stop_apiserver()
        time.sleep(max(0.0, down_seconds - (time.monotonic() - t0)))
        self.start_apiserver(timeout)
        return time.monotonic() - t0

    def stop_etcd(self, kill: bool = False, timeout: float = 15) -> None:
        """Stop etcd alone (SIGTERM, or SIGKILL as a crash looks); kube-apiserver stays
        up and answers errors for what it cannot serve from its watch cache."""
        self._stop_component("etcd", signal.SIGKILL if kill else signal.SIGTERM, timeout)

    def start_etcd(self, timeout: float = 120) -> float:
        """Start etcd again on its ports with its data dir (every object and revision
        kept); returns seconds until kube-apiserver's /readyz answers again."""
        t0 = time.monotonic()
        self._start_etcd(timeout)
        ctx = self._ssl()
        self._wait(
            "kube-apiserver /readyz after etcd came back",
            lambda: self._http_ok(f"{self.config.server}/readyz", ctx),
            "kube-apiserver",
            timeout,
        )
        return time.monotonic() - t0

    def restart_etcd(self, down_seconds: float = 0.0, kill: bool = False,
                     timeout: float = 120) -> float:
        """An etcd restart (down for ``down_seconds``); returns seconds from the stop
        until kube-apiserver is ready again."""
        t0 = time.monotonic()
        self.stop_etcd(kill=kill)
        time.sleep(max(0.0, down_seconds - (time.monotonic() - t0)))
        self.start_etcd(timeout)
        return time.monotonic() - t0

    # ---------------------------------------------------------------- kubectl

    def kubectl(self, *args: str | Path, check: bool = True, input: str | None = None) -> str:
        binary = self.config.binaries.get("kubectl") or locate_binaries()["kubectl"]
        proc = subprocess.run(
            [str(binary), f"--kubeconfig={self.config.kubeconfig}", *map(str, args)],
            capture_output=True,
            text=True,
            input=input,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(map(str, args))} failed: {proc.stderr.strip()}")
        return proc.stdout

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        """Each CRD (by name, or ``crd/<name>``; none: every CRD) Established. Not
        ``kubectl wait --for=condition=Established``: on a CRD the API server has not yet
        given a status it fails at once (".status.conditions accessor error: <nil>")."""
        names = [c.removeprefix("crd/") for c in crds] or self.kubectl(
            "get", "crd", "-o", "jsonpath={.items[*].metadata.name}").split()
        for name in names:
            self._wait(f"the {name} CRD Established", lambda n=name: self.kubectl(
                "get", "crd", n, "-o",
                "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                check=False) == "True", "kube-apiserver", timeout)

    def _kubectl_ok(self, *args: str) -> bool:
        try:
            self.kubectl(*args)
        except (ClusterError, subprocess.TimeoutExpired):
            return False
        return True

    def stop(self, timeout: float = 15) -> None:
        """Stop every component recorded in state.json (TERM, then KILL) and forget them;
        and this cluster's real nodes, if it owns the machine's (every process, mount,
        link, cgroup and iptables chain they made, after a crash too)."""
        from e2e.nodes.realnodes import RealNodes

        RealNodes(self, 0).stop()
        state = self._load_state() or {}
        pids = {**{k: int(v) for k, v in state.get("pids", {}).items()}, **self.pids}
        # Reverse start order: the controllers first, etcd last.
        order = [c for c in reversed(self.components(lws=True)) if c in pids]
        for name in order:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pids[name], signal.SIGTERM)
        start = time.monotonic()
        # With real nodes the API server's endpoint reconciler tries, for 20 s, to take
        # its address out of the `kubernetes` Service through its own listener, which
        # shutdown has closed; the cluster is going away, so it gets 3 s.
        real = state.get("real_nodes") or self.config.real_nodes
        for name in order:
            grace = min(timeout, 3) if real and name == "kube-apiserver" else timeout
            while self._alive(pids[name]) and time.monotonic() < start + grace:
                time.sleep(0.1)
            if self._alive(pids[name]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pids[name], signal.SIGKILL)
                while self._alive(pids[name]):
                    time.sleep(0.05)
        self.pids = {}
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()
