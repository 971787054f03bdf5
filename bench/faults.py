"""Fault benchmark: the leader operator SIGKILLed at a random point of a rollout.

Two operator replicas stand for election on one Lease (as the chart runs them). Each
trial creates ``--count`` InferenceDeployments in a fresh namespace, waits until a
random share of their Deployments exists, SIGKILLs the leader, and starts a
replacement process (as the kubelet would restart the pod) that becomes the next
standby. It then records, per trial:

  - failover: SIGKILL -> the standby's first write (its own request counter),
  - converged: SIGKILL -> the new leader's last write, once every object has its
    Deployment, Service and plan ConfigMap and a status for its current generation and
    the leader has then been quiet for 5 s,
  - orphaned children (a managed child whose owner is gone or unnamed) and duplicate
    children (two of one kind for one owner),
  - writes after convergence: the new leader's writes over the next two resync periods
    (every object re-reconciled twice; 0 is the goal: a steady state writes nothing).

Usage: python -m bench.faults [--count 100] [--trials 10] [--kubeconfig PATH]
Without --kubeconfig it starts its own control plane. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from kubernetes import client, config

from e2e.cluster.controlplane import REPO_ROOT, ClusterConfig, LocalCluster, Ports, locate_binaries
from e2e.operator_process import OperatorProcess, start_operator
from spillway_engine.planner.model_config import load_local
from spillway_operator.spec import GROUP, PLURAL, VERSION

CONFIG = REPO_ROOT / "tests" / "fixtures" / "models" / "llama-3.2-1b.json"
LEASE_NS = "spillway-bench"
OWNER_LABEL = f"{GROUP}/inference-deployment"
RESYNC = 10
QUIET = 5
CONVERGE_TIMEOUT = 600


def body(name: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
            "metadata": {"name": name},
            "spec": {"model": {"name": "meta-llama/Llama-3.2-1B",
                               "configMapRef": {"name": "model"}},
                     "replicas": 0, "offload": {"hostMemory": "8Gi"}}}


def writes(op: OperatorProcess) -> float:
    try:
        return sum(op.metric("spillway_operator_api_requests_total", verb=v)
                   for v in ("patch", "post", "delete"))
    except OSError:
        return float("nan")


def is_leader(op: OperatorProcess) -> bool:
    try:
        return op.leader()
    except OSError:
        return False


class Trial:
    def __init__(self, api: client.ApiClient, ns: str, count: int):
        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.ns, self.count = ns, count

    def setup(self) -> None:
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.ns)))
        self.core.create_namespaced_config_map(self.ns, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="model"),
            data={"config.json": json.dumps(load_local(CONFIG))}))

    def create(self) -> None:
        for i in range(self.count):
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL,
                                                        body(f"m{i}"))

    def deployments(self) -> int:
        return len(self.apps.list_namespaced_deployment(self.ns).items)

    def check(self) -> tuple[bool, int, int]:
        """(converged, orphaned children, duplicate children)."""
        objs = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]
        uids = {o["metadata"]["uid"] for o in objs}
        fresh = all((o.get("status") or {}).get("observedGeneration") ==
                    o["metadata"]["generation"] for o in objs)
        sel = f"{OWNER_LABEL}"
        kids = {
            "Deployment": self.apps.list_namespaced_deployment(self.ns, label_selector=sel).items,
            "Service": self.core.list_namespaced_service(self.ns, label_selector=sel).items,
            "ConfigMap": self.core.list_namespaced_config_map(self.ns, label_selector=sel).items,
        }
        orphans = dups = 0
        complete = True
        for items in kids.values():
            owners = Counter()
            for item in items:
                refs = [r.uid for r in item.metadata.owner_references or [] if r.uid in uids]
                if not refs:
                    orphans += 1
                owners.update(refs)
            dups += sum(n - 1 for n in owners.values() if n > 1)
            complete = complete and set(owners) == uids
        return fresh and complete and len(objs) == self.count, orphans, dups

    def teardown(self) -> None:
        self.core.delete_namespace(self.ns)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                self.core.read_namespace(self.ns)
            except client.ApiException:
                return
            time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=100,
                    help="objects per rollout (the local Service range holds ~250)")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kubeconfig", type=Path)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    tmp = tempfile.TemporaryDirectory(prefix="spillway-faults-")
    cluster = None
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
    else:
        cluster = LocalCluster(ClusterConfig(workdir=Path(tmp.name), ports=Ports.free(), nodes=2,
                                             pod_net="127.5", binaries=locate_binaries()))
        print(f"control plane ready in {cluster.start():.1f}s", file=sys.stderr)
        kubeconfig = cluster.config.kubeconfig
    kubectl = [str(locate_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}"]
    subprocess.run([*kubectl, "apply", "--server-side", "-f", REPO_ROOT / "crds"], check=True,
                   capture_output=True)
    subprocess.run([*kubectl, "wait", "--for=condition=Established",
                    "crd/inferencedeployments.spillway.dev"], check=True, capture_output=True)
    subprocess.run([*kubectl, "create", "namespace", LEASE_NS], capture_output=True)
    api = config.new_client_from_config(config_file=str(kubeconfig))

    started = 0

    def replica() -> OperatorProcess:
        nonlocal started
        started += 1
        name = f"op-{started}"
        return start_operator(
            Path(kubeconfig), Path(tmp.name) / f"{name}.log",
            env={"SPILLWAY_RESYNC_SECONDS": str(RESYNC)},
            extra_args=["--leader-elect", "--leader-election-namespace", LEASE_NS,
                        "--leader-election-identity", name])

    ops = [replica(), replica()]
    rows = []
    try:
        while not any(is_leader(o) for o in ops):
            time.sleep(0.5)
        for n in range(args.trials):
            leader = next(o for o in ops if is_leader(o))
            standby = next(o for o in ops if o is not leader)
            trial = Trial(api, f"faults-{n}-{int(time.time())}", args.count)
            trial.setup()
            share = rng.uniform(0.1, 0.9)
            trial.create()
            while trial.deployments() < share * args.count:
                time.sleep(0.05)
            at = trial.deployments()
            before = writes(standby)
            leader.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            leader.proc.wait(10)
            ops = [standby, replica()]  # the kubelet's restart: the next standby
            while writes(standby) == before:
                time.sleep(0.1)
            failover = time.monotonic() - killed
            # Converged: every object complete and current, and the new leader has
            # written nothing for QUIET seconds (status follows the Deployments' own
            # status for a while); the time is that of its last write.
            last_count, last_write = writes(standby), time.monotonic()
            converged = float("nan")  # nan: not converged within CONVERGE_TIMEOUT
            while time.monotonic() - killed < CONVERGE_TIMEOUT:
                time.sleep(0.5)
                if (w := writes(standby)) != last_count:
                    last_count, last_write = w, time.monotonic()
                elif time.monotonic() - last_write >= QUIET and trial.check()[0]:
                    converged = last_write - killed
                    break
            quiet0 = writes(standby)
            time.sleep(2 * RESYNC + 2)
            _, orphans, dups = trial.check()
            rows.append((n + 1, at, failover, converged, orphans, dups,
                         writes(standby) - quiet0))
            print(f"trial {n + 1}: killed at {at}/{args.count} Deployments, failover "
                  f"{failover:.1f}s, converged {converged:.1f}s", file=sys.stderr)
            trial.teardown()
    finally:
        for o in ops:
            o.stop()
        if cluster:
            cluster.stop()

    print(f"leader SIGKILL during a rollout of {args.count} InferenceDeployments "
          f"(lease 15 s / renew 10 s / retry 2 s; 2 replicas)")
    print(f"{'trial':>5} {'killed at':>10} {'failover (s)':>13} {'converged (s)':>14} "
          f"{'orphaned':>9} {'duplicate':>10} {'writes after':>13}")
    for t, at, fo, conv, orph, dup, after in rows:
        print(f"{t:>5} {at:>10} {fo:>13.1f} {conv:>14.1f} {orph:>9} {dup:>10} {after:>13.0f}")
    if rows:
        fos = [r[2] for r in rows]
        print(f"failover (SIGKILL -> standby's first write): median {statistics.median(fos):.1f}s,"
              f" max {max(fos):.1f}s over {len(rows)} trials")
    return 0


if __name__ == "__main__":
    sys.exit(main())
