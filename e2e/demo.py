"""The local demo: real vLLM servers on emulated GPUs, a hybrid model, scaling under load.

    make demo            (or: python -m e2e.demo [--burst-seconds 180] [--clients 16] [--keep])

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

from e2e.cluster.controlplane import (
    REPO_ROOT,
    ClusterConfig,
    ClusterError,
    LocalCluster,
    Ports,
    free_pod_net,
    locate_binaries,
)
from e2e.operator_process import start_operator
from e2e.simfleet import ENGINE_PORT, SimulatorFleet
from spillway_engine.emulator.tiny import qwen3_next_config, write_model
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION

SAMPLE = REPO_ROOT / "config" / "samples" / "qwen3-next-tiny-emulated.yaml"
NAMESPACE = "gated-demo"  # gated: a pod turns Ready only once its engine answers /health
WORKDIR = Path(os.environ.get("SPILLWAY_DEMO_DIR", "/tmp/spillway-demo"))

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
    args = ap.parse_args()

    # A pod network no other local cluster uses (a test session or e2e/cluster/up may
    # run beside the demo); a demo cluster still running keeps the one it started with.
    cluster = LocalCluster(ClusterConfig(workdir=WORKDIR, ports=Ports.from_base(17380), nodes=2,
                                         pod_net=free_pod_net()))
    procs: list[subprocess.Popen] = []
    router_url = ""
    fleet: SimulatorFleet | None = None
    load: Load | None = None
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.config.binaries = locate_binaries()
        if not cluster.running():
            # etcd's folder outlives a stopped cluster: its nodes would keep the pod
            # network of an earlier run, which this run's KWOK may not be given.
            shutil.rmtree(WORKDIR / "etcd", ignore_errors=True)
        say("starting the local control plane (etcd, kube-apiserver, controller-manager, "
            "scheduler, KWOK) ...")
        seconds = cluster.start()
        say(f"control plane ready ({seconds:.1f}s); KUBECONFIG={cluster.config.kubeconfig}; "
            f"pod network {cluster.config.pod_net}.0.0/16")
        print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product",
                              "-o", "wide").rstrip(), flush=True)
        cluster.kubectl("apply", "--server-side", "-f", REPO_ROOT / "crds")
        cluster.kubectl("wait", "--for=condition=Established",
                        "crd/inferencedeployments.spillway.dev")

        operator = start_operator(cluster.config.kubeconfig, WORKDIR / "operator.log")
        procs.append(operator.proc)
        say(f"operator running (log: {operator.log}, metrics: {operator.metrics_url})")

        api = config.new_client_from_config(config_file=str(cluster.config.kubeconfig))
        custom, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
        sample = yaml.safe_load(SAMPLE.read_text())
        name, model = sample["metadata"]["name"], sample["spec"]["model"]["name"]
        # The model folder an engine image would hold: config.json and a tokenizer
        # trained here (no hub, no weights: the emulated GPU reads none).
        model_config = qwen3_next_config(num_layers=4)
        model_dir = write_model(WORKDIR / "models" / "tiny-qwen3-next", model_config)
        cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        # The control plane keeps its etcd folder: an earlier run (--keep, or killed)
        # left its deployments and pods there. Start from none.
        cluster.kubectl("delete", "inferencedeployments.spillway.dev", "--all", "-n", NAMESPACE,
                        "--wait=true", "--timeout=60s", check=False)
        core = client.CoreV1Api(api)
        deadline = time.monotonic() + 60
        while core.list_namespaced_pod(NAMESPACE).items and time.monotonic() < deadline:
            time.sleep(1)
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": sample["spec"]["model"]["configMapRef"]["name"]},
            "data": {"config.json": json.dumps(model_config)}}))
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", SAMPLE)
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

        fleet = SimulatorFleet(api, NAMESPACE, name, engine="emulated",
                               model_dirs={model: model_dir}).__enter__()
        # The router as the chart runs it: it watches the namespace's engine pods,
        # reads their plans, and follows their KV events.
        router_port = free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        router_log = open(WORKDIR / "router.log", "wb")  # noqa: SIM115 (the process holds it)
        procs.append(subprocess.Popen(
            [str(Path(sys.executable).with_name("spillway-router")), "--host", "127.0.0.1",
             "--port", str(router_port), "--kube-namespace", NAMESPACE, "--probe-interval", "1"],
            stdout=router_log, stderr=subprocess.STDOUT,
            env={**os.environ, "KUBECONFIG": str(cluster.config.kubeconfig)}))
        say(f"spillway-router on {router_url} (log: {WORKDIR / 'router.log'}), watching "
            f"{NAMESPACE}'s engine pods and their KV events")
        say(f"each pod runs its container's command on its IP: {' '.join(command)}  (vLLM's "
            "real server; an engine takes a minute or more to start on a shared CPU)")
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
                if urls and router_ready(router_url):
                    burst_start = now
                    load.urls = [router_url]
                    load.start()
                    say(f"load: {args.clients} clients for {args.burst_seconds:g}s or more, each "
                        f"sending one of {PREFIXES} shared {PREFIX_TOKENS}-token prefixes + a "
                        f"{QUESTION_TOKENS}-token question ({MAX_TOKENS} tokens out), "
                        "through spillway-router")
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
