"""Operator benchmark on the local control plane, with the floor beside it.

For each count (default 1, 200 and 1000) of InferenceDeployments created at once
(16 client threads), on one API server:
  - floor: the same children (plan ConfigMap, Deployment, Service, PDB, rendered by the
    operator's own code) created directly by 16 client threads: what the API server
    and etcd alone need; and floor-apply: the same, server-side applied (the operator
    creates with POSTs, then applies every change; an apply costs the API server
    more than a POST);
  - the operator (and, with --baseline-src, an older checkout's operator beside it):
    create -> Deployment exists (seen by a watch) p50/p99, time until every object's
    status reports its generation, API requests per object by verb, operator CPU
    seconds and RSS;
  - API writes per no-op reconcile (every object poked once more, after it is quiet).

Each operator watches only its batch's namespace (``-n``), so batches do not mix, and
each batch's namespace is deleted (and waited for) before the next row.
Usage: python -m bench.operator_reconcile [--counts 1,200,1000] [--kubeconfig PATH]
       [--baseline-src DIR]   (DIR: a checkout, e.g. from `git archive`)
       [--workers 4,8] [--repeat N] [--keep]
Without --kubeconfig it starts its own control plane (binaries from tools/build.sh).
Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client, config, watch

from e2e.cluster.controlplane import (
    REPO_ROOT,
    ClusterConfig,
    LocalCluster,
    Ports,
    locate_binaries,
)
from e2e.operator_process import OperatorProcess, start_operator
from spillway_engine.planner.model_config import load_local
from spillway_engine.planner.plan import make_plan
from spillway_operator.flow import render
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION, InferenceDeploymentSpec
from spillway_operator.plumbing.kube import Kube, resource_path

CONFIG = REPO_ROOT / "tests" / "fixtures" / "models" / "llama-3.2-1b.json"
THREADS = 16
SPEC = {
    "model": {"name": "meta-llama/Llama-3.2-1B", "configMapRef": {"name": "model"}},
    "replicas": 0,
    "offload": {"hostMemory": "8Gi"},
}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def api_client(kubeconfig: Path) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = 2 * THREADS
    return client.ApiClient(cfg)


def make_namespace(api: client.ApiClient, prefix: str) -> str:
    core = client.CoreV1Api(api)
    ns = f"{prefix}-{time.monotonic_ns() % 10**9}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="model"),
        data={"config.json": json.dumps(load_local(CONFIG))}))
    return ns


def retire(api: client.ApiClient, ns: str, timeout: float = 600) -> None:
    """Delete a batch's namespace and wait until it is gone: each row starts from the
    same cluster, not one whose controllers still work through the last batch (the
    row measured after another was otherwise the slower by design)."""
    core = client.CoreV1Api(api)
    core.delete_namespace(ns)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(ns)
        except client.ApiException as exc:
            if exc.status == 404:
                time.sleep(3)  # the controllers' own last events
                return
            raise
        time.sleep(1)
    raise RuntimeError(f"namespace {ns} still there after {timeout:.0f}s")


@dataclass
class Row:
    who: str
    count: int
    deployed: int
    p50: float
    p99: float
    converged: float | None = None
    per_object: dict[str, float] | None = None
    reconciles: float | None = None
    cpu: float | None = None
    rss: float | None = None
    noop_reconciles: float | None = None
    noop_writes: float | None = None
    floor: float | None = None  # the p99 of the floor of the same round


def floor(api: client.ApiClient, count: int, apply: bool = False) -> Row:
    """The children of ``count`` objects created directly by 16 threads: POSTed, or
    (``apply``) server-side applied, as the operator writes every change after the
    create, which costs the API server more than a POST."""
    ns = make_namespace(api, "floor")
    spec = InferenceDeploymentSpec.model_validate(SPEC)
    plan = make_plan(load_local(CONFIG), spec.plan_request())
    kube = Kube(api)

    def children(i: int) -> list[dict]:
        owner = render.Owner(f"bench-{i}", ns, "0")
        # The operator's order (it creates the Deployment second).
        out = [render.plan_configmap(owner, spec, plan), render.deployment(owner, spec, plan),
               render.service(owner), render.pod_disruption_budget(owner, spec)]
        for child in out:  # no owner: the garbage collector would remove them
            child["metadata"].pop("ownerReferences", None)
        return out

    bodies = [children(i) for i in range(count)]
    done: list[float] = []
    start = time.monotonic()

    def create(objs: list[dict]) -> None:
        for obj in objs:
            if apply:  # the operator's own server-side apply
                kube.apply(obj)
            else:
                kube.request("post", resource_path(obj["apiVersion"], obj["kind"], ns),
                             body=obj)
            if obj["kind"] == "Deployment":
                done.append(time.monotonic() - start)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(create, bodies))
    total = time.monotonic() - start
    retire(api, ns)
    return Row("floor-apply" if apply else "floor", count, len(done), statistics.median(done),
               pct(done, 0.99), total)


class Watcher:
    """Deployments' ADDED and InferenceDeployments' observedGeneration in one namespace."""

    def __init__(self, api: client.ApiClient, ns: str, count: int):
        self.seen: dict[str, float] = {}
        self.converged: dict[str, float] = {}
        self.count = count
        apps, custom = client.AppsV1Api(api), client.CustomObjectsApi(api)
        self._threads = [
            threading.Thread(target=self._deployments, args=(apps, ns), daemon=True),
            threading.Thread(target=self._statuses, args=(custom, ns), daemon=True)]
        for t in self._threads:
            t.start()
        time.sleep(0.5)

    def _deployments(self, apps: client.AppsV1Api, ns: str) -> None:
        # Plain dicts: typed V1Deployments cost the bench's CPU, which the operator
        # shares on a small machine (the floor has no watcher).
        w = watch.Watch(return_type="object")
        for ev in w.stream(apps.list_namespaced_deployment, ns, timeout_seconds=900):
            name = ev["object"]["metadata"]["name"]
            if ev["type"] == "ADDED" and name not in self.seen:
                self.seen[name] = time.monotonic()
                if len(self.seen) >= self.count:
                    w.stop()

    def _statuses(self, custom: client.CustomObjectsApi, ns: str) -> None:
        w = watch.Watch()
        for ev in w.stream(custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
                           timeout_seconds=900):
            obj = ev["object"]
            name = obj["metadata"]["name"]
            observed = (obj.get("status") or {}).get("observedGeneration")
            if observed == obj["metadata"].get("generation") and name not in self.converged:
                self.converged[name] = time.monotonic()
                if len(self.converged) >= self.count:
                    w.stop()

    def wait(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)


def counters(op: OperatorProcess) -> dict[str, float]:
    snap = {v: op.metric("spillway_operator_api_requests_total", verb=v)
            for v in ("get", "patch", "post")}
    snap["reconciles"] = op.metric("spillway_operator_reconciles_total")
    return snap


def wait_quiet(op: OperatorProcess, settle: float = 3.0, timeout: float = 300) -> dict:
    """The counters once they stopped moving for ``settle`` seconds."""
    prev, deadline = None, time.monotonic() + timeout
    while (cur := counters(op)) != prev and time.monotonic() < deadline:
        prev = cur
        time.sleep(settle)
    return cur


def operator_run(api: client.ApiClient, kubeconfig: Path, who: str, count: int,
                 workdir: Path, env: dict[str, str]) -> Row:
    ns = make_namespace(api, who)
    op = start_operator(kubeconfig, workdir / f"operator-{who}-{count}.log", env=env,
                        scope=["-n", ns])
    custom = client.CustomObjectsApi(api)
    try:
        time.sleep(2)  # its watches are up
        before, cpu0 = counters(op), cpu_seconds(op.proc.pid)
        watcher = Watcher(api, ns, count)
        created: dict[str, float] = {}
        start = time.monotonic()

        def create(i: int) -> None:
            name = f"bench-{i}"
            created[name] = time.monotonic()
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
                "metadata": {"name": name}, "spec": SPEC})

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(create, range(count)))
        watcher.wait(900)
        # Quiet for longer than an autoscaler interval (15 s): its first ticks write each
        # new object's status.autoscaling, which would else land among the no-op pokes.
        after = wait_quiet(op, settle=16)
        cpu, rss = cpu_seconds(op.proc.pid) - cpu0, rss_mib(op.proc.pid)
        lat = [watcher.seen[n] - created[n] for n in created if n in watcher.seen]
        converged = (max(watcher.converged.values()) - start
                     if len(watcher.converged) == count else None)
        per_object = {k: (after[k] - before[k]) / count for k in ("get", "patch", "post")}
        # No-op reconciles: poke every object; nothing about them changed.
        writes0 = after["patch"] + after["post"]
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(lambda i: custom.patch_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, f"bench-{i}",
                {"metadata": {"annotations": {"poke": "1"}}}), range(count)))
        deadline = time.monotonic() + 300
        while counters(op)["reconciles"] < after["reconciles"] + count and \
                time.monotonic() < deadline:
            time.sleep(1)
        quiet = wait_quiet(op)
        return Row(who, count, len(lat), statistics.median(lat), pct(lat, 0.99), converged,
                   per_object, (after["reconciles"] - before["reconciles"]) / count, cpu, rss,
                   quiet["reconciles"] - after["reconciles"],
                   quiet["patch"] + quiet["post"] - writes0)
    finally:
        op.stop()
        retire(api, ns)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="1,200,1000")
    ap.add_argument("--kubeconfig", type=Path)
    ap.add_argument("--workers", default="",
                    help="SPILLWAY_WORKERS of the operator, comma-separated for one row "
                         "each (default: its own)")
    ap.add_argument("--baseline-src", type=Path,
                    help="a checkout whose operator runs beside this one's (PYTHONPATH)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds per count, the operators' order alternating (runs on a "
                         "shared machine differ by a third); medians printed after")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (operator logs) and print where it is")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]

    workdir = Path(tempfile.mkdtemp(prefix="spillway-bench-"))
    if args.keep:
        print(f"work directory (kept): {workdir}", file=sys.stderr)
    cluster = None
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
    else:
        cluster = LocalCluster(ClusterConfig(workdir=workdir, ports=Ports.free(), nodes=2,
                                             pod_net="127.4", binaries=locate_binaries()))
        print(f"control plane ready in {cluster.start():.1f}s", file=sys.stderr)
        kubeconfig = cluster.config.kubeconfig
    kubectl = [str(locate_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}"]
    subprocess.run([*kubectl, "apply", "--server-side", "-f", REPO_ROOT / "crds"],
                   check=True, capture_output=True)
    if cluster is not None:  # a CRD just made may have no status yet: kubectl wait fails
        cluster.wait_established("inferencedeployments.spillway.dev")
    else:
        subprocess.run([*kubectl, "wait", "--for=condition=Established",
                        "crd/inferencedeployments.spillway.dev"], check=True,
                       capture_output=True)
    api = api_client(Path(kubeconfig))
    workers = [w for w in args.workers.split(",") if w]
    variants = ([(f"spillway-{w}w", {"SPILLWAY_WORKERS": w}) for w in workers]
                or [("spillway", {})])
    if args.baseline_src:
        src = args.baseline_src.resolve()
        variants.insert(0, ("baseline", {**variants[-1][1], "PYTHONPATH":
                                         f"{src / 'operator'}:{src / 'engine'}:{src}"}))
    rows: list[Row] = []
    try:
        for count in counts:
            for round_ in range(args.repeat):
                for apply in (False, True):
                    rows.append(floor(api, count, apply))
                    print(f"{rows[-1].who} {count}: p99 {rows[-1].p99:.2f} s",
                          file=sys.stderr)
                floor_p99 = rows[-2].p99
                for who, variant_env in (variants if round_ % 2 == 0 else variants[::-1]):
                    rows.append(operator_run(api, Path(kubeconfig), who, count, workdir,
                                             variant_env))
                    print(f"{who} {count}: p99 {rows[-1].p99:.2f} s", file=sys.stderr)
                for r in rows[-len(variants) - 2:]:
                    r.floor = floor_p99
    finally:
        if cluster:
            cluster.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    print(f"{'who':>12} {'objects':>8} {'deployed':>9} {'p50 (s)':>8} {'p99 (s)':>8} "
          f"{'p99/floor':>10} {'converged (s)':>14} {'GET/obj':>8} {'PATCH/obj':>10} "
          f"{'POST/obj':>9} {'reconciles/obj':>15} {'CPU (s)':>8} {'RSS (MiB)':>10} "
          f"{'no-op writes':>13}")
    for r in rows:
        conv = "-" if r.converged is None else f"{r.converged:.2f}"
        po = r.per_object or {}
        ratio = "-" if r.who == "floor" or r.floor is None else f"{r.p99 / r.floor:.1f}x"
        noop = "-" if r.noop_writes is None else f"{r.noop_writes:.0f}/{r.noop_reconciles:.0f}"
        print(f"{r.who:>12} {r.count:>8} {r.deployed:>9} {r.p50:>8.2f} {r.p99:>8.2f} "
              f"{ratio:>10} {conv:>14} {po.get('get', 0):>8.1f} {po.get('patch', 0):>10.1f} "
              f"{po.get('post', 0):>9.1f} "
              f"{'-' if r.reconciles is None else f'{r.reconciles:.2f}':>15} "
              f"{'-' if r.cpu is None else f'{r.cpu:.1f}':>8} "
              f"{'-' if r.rss is None else f'{r.rss:.0f}':>10} {noop:>13}")
    if args.repeat > 1:
        print(f"\nmedians of {args.repeat} rounds:")
        print(f"{'who':>12} {'objects':>8} {'p50 (s)':>8} {'p99 (s)':>8} {'p99/floor':>10} "
              f"{'converged (s)':>14}")
        for count in counts:
            for who in dict.fromkeys(r.who for r in rows if r.count == count):
                mine = [r for r in rows if r.count == count and r.who == who]
                conv = [r.converged for r in mine if r.converged is not None]
                ratio = ("-" if who == "floor" else
                         f"{statistics.median(r.p99 / r.floor for r in mine):.1f}x")
                print(f"{who:>12} {count:>8} {statistics.median(r.p50 for r in mine):>8.2f} "
                      f"{statistics.median(r.p99 for r in mine):>8.2f} {ratio:>10} "
                      f"{statistics.median(conv) if conv else float('nan'):>14.2f}")
    print("floor: the children POSTed by 16 threads; floor-apply: server-side applied "
          "instead; converged = time until its last child was "
          "created; no-op writes: writes / reconciles after poking every object once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
