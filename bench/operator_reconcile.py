"""Operator benchmark on the local control plane.

Measures, for 1 and for N InferenceDeployments created at once:
  - reconcile latency: create -> the engine Deployment exists (seen by a watch),
  - where that time goes: reconciles run per object, API requests per object by verb,
    mean wall time of one reconcile, and the bound they imply
    (reconciles x mean time / workers: the time the worker pool alone needs),
  - API writes per no-op reconcile (the operator's own request counter),
  - operator memory (RSS).

Usage: python -m bench.operator_reconcile [--count 200] [--kubeconfig PATH]
Without --kubeconfig it starts its own control plane (binaries from tools/build.sh).
Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kubernetes import client, config, watch

from e2e.cluster.controlplane import (
    REPO_ROOT,
    ClusterConfig,
    LocalCluster,
    Ports,
    locate_binaries,
)
from e2e.operator_process import start_operator
from spillway_engine.planner.model_config import load_local
from spillway_operator.spec import GROUP, PLURAL, VERSION

CONFIG = REPO_ROOT / "tests" / "fixtures" / "models" / "llama-3.2-1b.json"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def body(name: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.2-1B", "configMapRef": {"name": "model"}},
            "replicas": 0,
            "offload": {"hostMemory": "8Gi"},
        },
    }


def run_batch(api: client.ApiClient, ns: str, count: int) -> list[float]:
    """Create ``count`` objects; return create->Deployment latencies in seconds."""
    apps, custom = client.AppsV1Api(api), client.CustomObjectsApi(api)
    created: dict[str, float] = {}
    seen: dict[str, float] = {}
    done = threading.Event()

    def watcher():
        w = watch.Watch()
        for ev in w.stream(apps.list_namespaced_deployment, ns, timeout_seconds=600):
            name = ev["object"].metadata.name
            if ev["type"] == "ADDED" and name not in seen:
                seen[name] = time.monotonic()
                if len(seen) >= count:
                    w.stop()
        done.set()

    t = threading.Thread(target=watcher, daemon=True)
    t.start()
    time.sleep(0.5)
    for i in range(count):
        name = f"bench-{i}"
        created[name] = time.monotonic()
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body(name))
    done.wait(600)
    return [seen[n] - created[n] for n in created if n in seen]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--kubeconfig", type=Path)
    ap.add_argument("--workers", type=int, default=4, help="SPILLWAY_WORKERS of the operator")
    args = ap.parse_args()

    cluster = None
    tmp = tempfile.TemporaryDirectory(prefix="spillway-bench-")
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
    else:
        cluster = LocalCluster(
            ClusterConfig(
                workdir=Path(tmp.name),
                ports=Ports.free(),
                nodes=2,
                pod_net="127.4",
                binaries=locate_binaries(),
            )
        )
        print(f"control plane ready in {cluster.start():.1f}s", file=sys.stderr)
        kubeconfig = cluster.config.kubeconfig
    kubectl = [str(locate_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}"]
    subprocess.run(
        [*kubectl, "apply", "--server-side", "-f", REPO_ROOT / "crds"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [*kubectl, "wait", "--for=condition=Established", "crd/inferencedeployments.spillway.dev"],
        check=True,
        capture_output=True,
    )
    api = config.new_client_from_config(config_file=str(kubeconfig))
    core = client.CoreV1Api(api)

    op = start_operator(Path(kubeconfig), Path(tmp.name) / "operator.log",
                        env={"SPILLWAY_WORKERS": str(args.workers)})
    rows = []
    profile = []

    def snapshot() -> dict[str, float]:
        snap = {v: op.metric("spillway_operator_api_requests_total", verb=v)
                for v in ("get", "patch", "post")}
        snap["reconciles"] = op.metric("spillway_operator_reconciles_total")
        snap["seconds"] = op.metric("spillway_operator_reconcile_duration_seconds_sum")
        snap["timed"] = op.metric("spillway_operator_reconcile_duration_seconds_count")
        return snap
    try:
        rss_idle = rss_mib(op.proc.pid)
        for count in (1, args.count):
            ns = f"bench-{count}-{int(time.time())}"
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
            core.create_namespaced_config_map(
                ns,
                client.V1ConfigMap(
                    metadata=client.V1ObjectMeta(name="model"),
                    data={"config.json": json.dumps(load_local(CONFIG))},
                ),
            )
            before = snapshot()
            lat = run_batch(api, ns, count)
            time.sleep(2)  # the status writes that follow the Deployments
            after = snapshot()
            profile.append((count, {k: after[k] - before[k] for k in after}))
            rss = rss_mib(op.proc.pid)
            rows.append((count, len(lat), statistics.median(lat), pct(lat, 0.99), rss))

        # No-op reconciles: wait until quiet, then poke every object of the last batch.
        def counters():
            return (
                op.metric("spillway_operator_api_requests_total", verb="patch")
                + op.metric("spillway_operator_api_requests_total", verb="post"),
                op.metric("spillway_operator_reconciles_total"),
            )

        prev = None
        while prev != (cur := counters()):
            prev = cur
            time.sleep(3)
        writes0, rec0 = prev
        custom = client.CustomObjectsApi(api)
        for i in range(args.count):
            custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                ns,
                PLURAL,
                f"bench-{i}",
                {"metadata": {"annotations": {"poke": "1"}}},
            )
        deadline = time.monotonic() + 120
        while counters()[1] < rec0 + args.count and time.monotonic() < deadline:
            time.sleep(1)
        writes1, rec1 = counters()
    finally:
        op.stop()
        if cluster:
            cluster.stop()

    print(
        f"{'objects':>8} {'deployed':>9} {'p50 (s)':>9} {'p99 (s)':>9} {'operator RSS (MiB)':>19}"
    )
    for count, n, p50, p99, rss in rows:
        print(f"{count:>8} {n:>9} {p50:>9.3f} {p99:>9.3f} {rss:>19.0f}")
    print(f"operator RSS at start: {rss_idle:.0f} MiB")
    print(f"\nwhere the time goes ({args.workers} workers; counted from the batch's creation "
          f"until 2 s after its last Deployment):")
    print(f"{'objects':>8} {'reconciles/obj':>15} {'GET/obj':>8} {'PATCH/obj':>10} "
          f"{'POST/obj':>9} {'mean reconcile (s)':>19} {'pool-bound (s)':>15}")
    for count, d in profile:
        mean = d["seconds"] / max(d["timed"], 1)
        print(f"{count:>8} {d['reconciles'] / count:>15.2f} {d['get'] / count:>8.1f} "
              f"{d['patch'] / count:>10.1f} {d['post'] / count:>9.1f} {mean:>19.3f} "
              f"{d['timed'] * mean / args.workers:>15.1f}")
    noop = rec1 - rec0
    print(
        f"no-op reconciles: {noop:.0f}, API writes during them: {writes1 - writes0:.0f} "
        f"({(writes1 - writes0) / max(noop, 1):.3f} per reconcile)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
