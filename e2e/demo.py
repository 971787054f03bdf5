"""The local demo: a hybrid model planned, running on fake GPU nodes, scaling under load.

    make demo            (or: python -m e2e.demo [--burst-seconds 60] [--keep])

Starts the local control plane with fake H100 nodes, installs the CRD, runs the
operator, applies the Qwen3-Next (Gated DeltaNet + attention hybrid) sample with
its config.json in a ConfigMap, stands engine simulators on the pods' IPs (each
"loads its model" for a few seconds before turning Ready), drives a shared-prefix
burst with `spillway loadgen`, and prints the plan, the pods, the offload pressure
and the replicas as they change. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from kubernetes import client, config

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
from e2e.simfleet import SimulatorFleet
from spillway_engine.planner.model_config import load_local
from spillway_operator.spec import GROUP, PLURAL, VERSION

SAMPLE = REPO_ROOT / "config" / "samples" / "qwen3-next-hybrid.yaml"
MODEL_CONFIG = REPO_ROOT / "tests" / "fixtures" / "models" / "qwen3-next-80b-a3b-instruct.json"
NAMESPACE = "gated-demo"  # gated: pods turn Ready only once their simulator has "loaded"
WORKDIR = Path(os.environ.get("SPILLWAY_DEMO_DIR", "/tmp/spillway-demo"))


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--burst-seconds", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=24.0, help="requests per second in the burst")
    ap.add_argument("--total-seconds", type=float, default=180.0, help="then stop (0: run on)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    args = ap.parse_args()

    # A pod network no other local cluster uses (a test session or e2e/cluster/up may
    # run beside the demo); a demo cluster still running keeps the one it started with.
    cluster = LocalCluster(ClusterConfig(workdir=WORKDIR, ports=Ports.from_base(17380), nodes=2,
                                         pod_net=free_pod_net()))
    procs: list[subprocess.Popen] = []
    fleet = None
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.config.binaries = locate_binaries()
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
        custom = client.CustomObjectsApi(api)
        cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        cm = {"config.json": json.dumps(load_local(MODEL_CONFIG))}
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "qwen3-next-config"}, "data": cm}))
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", SAMPLE)
        name = yaml.safe_load(SAMPLE.read_text())["metadata"]["name"]
        say(f"applied InferenceDeployment {NAMESPACE}/{name} (Qwen3-Next: GDN + attention hybrid)")

        def obj() -> dict:
            return custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)

        while not stopping and not obj().get("status", {}).get("plan"):
            time.sleep(0.5)
        if stopping:
            return 0
        print_plan(obj())

        fleet = SimulatorFleet(api, NAMESPACE, name, ["--max-num-seqs", "8",
                                                      "--gpu-kv-tokens", "65536"],
                               load_seconds=5).__enter__()
        say("engine simulators stand in for the GPU containers on the pods' IPs "
            "(5 s model load each)")
        start, load, burst_start = time.monotonic(), None, None
        last, load_done = None, False
        while not stopping:
            now = time.monotonic() - start
            o = obj()
            st, a = o.get("status", {}), o.get("status", {}).get("autoscaling", {})
            urls = fleet.urls()
            if burst_start is None and st.get("readyReplicas", 0) >= 1 and urls:
                burst_start = time.monotonic()
                say(f"load: {args.rate:g} req/s shared-prefix burst for {args.burst_seconds:g}s, "
                    "spread over the ready pods (as their Service would)")
            in_burst = burst_start is not None and (
                time.monotonic() - burst_start < args.burst_seconds)
            # Short loadgen segments, so pods that became ready since get their share.
            if in_burst and (load is None or load.poll() is not None):
                url_args = [arg for u in urls for arg in ("--url", u)]
                load = subprocess.Popen(
                    [sys.executable, "-m", "spillway_cli.main", "loadgen", *url_args,
                     "--trace", "mixed", "--rate", str(args.rate), "--duration", "10",
                     "--seed", str(int(now))],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                procs.append(load)
            if burst_start is not None and not in_burst and not load_done:
                say("load finished; replicas come down after the scale-down window")
                load_done = True
            line = (o["spec"]["replicas"], st.get("readyReplicas", 0), a.get("pressure", "-"),
                    a.get("lastDecision"))
            if line != last:
                comps = ", ".join(f"{k} {v}" for k, v in (a.get("components") or {}).items())
                say(f"replicas desired {line[0]} ready {line[1]} | pressure {line[2]} "
                    f"({comps}) | {a.get('lastDecision')}: {a.get('lastDecisionReason', '')}")
                last = line
            if args.total_seconds and now > args.total_seconds:
                break
            time.sleep(1)
        say("done")
        return 0
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
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
