"""Fault benchmark: what a rollout survives, each fault repeated, one table each.

Two operator replicas stand for election on one Lease (as the chart runs them). Each
trial creates ``--count`` InferenceDeployments in a fresh namespace and then:

  leader-kill  SIGKILLs the leader once a random share of the Deployments exists and
               starts a replacement process (as the kubelet would restart the pod),
               which becomes the next standby;
  apiserver    stops kube-apiserver for 30 s at a random point of the rollout;
  etcd         SIGKILLs etcd at a random point and starts it again 10 s later;
  child-edit   (after the rollout converged) deletes or edits by hand one kind of child
               of 20 objects at once: each of seven changes is one row;
  invalid      times the rollout of the valid objects alone, then beside 50 invalid
               ones created before them (25 whose plan is refused, 25 whose model
               config ConfigMap does not exist and which retry with back-off).

Recorded per trial, where it applies:
  - failover: SIGKILL -> the first write of a surviving replica (the standby, or the
    replacement when it takes the Lease first),
  - recovered: the API answering again -> the operators' first write,
  - converged: the fault (leader-kill: the SIGKILL; outages: the API answering again)
    -> the last write, once every object has its Deployment, Service and plan
    ConfigMap, a status for its current generation with the autoscaler's part, and
    the operators have then been quiet for 20 s,
  - exits: operator processes that ended on their own (a crash loop starts here),
  - orphaned children (a managed child whose owner is gone or unnamed) and duplicate
    children (two of one kind for one owner),
  - writes after convergence: the operators' writes over the next two resync periods
    (every object re-reconciled twice; 0 is the goal: a steady state writes nothing).

Usage: python -m bench.faults [--count 200] [--trials 10] [--repeats 3]
                              [--faults leader-kill,apiserver,etcd,child-edit,invalid]
                              [--logs DIR [--verbose]]
Starts its own control plane (it stops and kills parts of it). Prints tables; asserts
nothing. Run it from a snapshot of the tree (the replacement replicas import the tree
when they start, and a file edited mid-run is what they get), e.g.
  git archive HEAD | tar -x -C /tmp/snap && cd /tmp/snap &&
  PYTHONPATH=$PWD:$PWD/operator:$PWD/engine python -m bench.faults
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
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from kubernetes import client, config, watch

from e2e.cluster.controlplane import REPO_ROOT, ClusterConfig, LocalCluster, Ports, locate_binaries
from e2e.operator_process import OperatorProcess, start_operator
from spillway_engine.planner.model_config import load_local
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION

CONFIG = REPO_ROOT / "tests" / "fixtures" / "models" / "llama-3.2-1b.json"
LEASE_NS = "spillway-bench"
OWNER_LABEL = f"{GROUP}/inference-deployment"
MANAGED_BY = "app.kubernetes.io/managed-by"
RESYNC = 10
# Longer than one autoscaler interval (15 s): a new object's second tick writes its
# status again, and a shorter quiet spell counted it as a write after convergence.
QUIET = 20
CONVERGE_TIMEOUT = 600
FAULTS = ("leader-kill", "apiserver", "etcd", "child-edit", "invalid")
APISERVER_DOWN = 30
ETCD_DOWN = 10
EDITED = 20  # objects whose children one child-edit row changes
INVALID = 50


def body(name: str, host_memory: str = "8Gi", config_map: str = "model") -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
            "metadata": {"name": name},
            "spec": {"model": {"name": "meta-llama/Llama-3.2-1B",
                               "configMapRef": {"name": config_map}},
                     "replicas": 0, "offload": {"hostMemory": host_memory}}}


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


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Trial:
    def __init__(self, api: client.ApiClient, ns: str, count: int):
        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.ns, self.count = ns, count
        self.names = [f"m{i}" for i in range(count)]

    def setup(self) -> None:
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.ns)))
        self.core.create_namespaced_config_map(self.ns, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="model"),
            data={"config.json": json.dumps(load_local(CONFIG))}))

    def create(self, bodies: list[dict] | None = None) -> None:
        for b in bodies if bodies is not None else [body(n) for n in self.names]:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, b)

    def deployments(self) -> int:
        return len(self.apps.list_namespaced_deployment(self.ns).items)

    def kids(self) -> dict[str, list]:
        sel = OWNER_LABEL
        return {
            "Deployment": self.apps.list_namespaced_deployment(self.ns, label_selector=sel).items,
            "Service": self.core.list_namespaced_service(self.ns, label_selector=sel).items,
            "ConfigMap": self.core.list_namespaced_config_map(self.ns, label_selector=sel).items,
        }

    def check(self) -> tuple[bool, int, int]:
        """(converged, orphaned children, duplicate children) over the objects named
        in ``self.names`` (the valid ones)."""
        objs = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]
        objs = [o for o in objs if o["metadata"]["name"] in set(self.names)]
        uids = {o["metadata"]["uid"] for o in objs}
        # Current: status for this generation, and the autoscaler's first tick written.
        fresh = all((o.get("status") or {}).get("observedGeneration") ==
                    o["metadata"]["generation"] and "autoscaling" in o["status"] for o in objs)
        orphans = dups = 0
        complete = True
        for items in self.kids().values():
            owners = Counter()
            for item in items:
                refs = [r.uid for r in item.metadata.owner_references or [] if r.uid in uids]
                if not refs:
                    orphans += 1
                owners.update(refs)
            dups += sum(n - 1 for n in owners.values() if n > 1)
            complete = complete and set(owners) == uids
        return fresh and complete and len(objs) == len(self.names), orphans, dups

    def safe_check(self) -> tuple[bool, int, int]:
        try:
            return self.check()
        except (client.ApiException, OSError):
            return False, -1, -1

    def teardown(self) -> None:
        self.core.delete_namespace(self.ns)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                self.core.read_namespace(self.ns)
            except client.ApiException:
                return
            time.sleep(1)


class Bench:
    """The control plane, the two operator replicas and the trials' common steps."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = tempfile.TemporaryDirectory(prefix="spillway-faults-")
        self.logs = args.logs or Path(self.tmp.name)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.cluster = LocalCluster(ClusterConfig(
            workdir=Path(self.tmp.name), ports=Ports.free(), nodes=2, pod_net="127.5",
            binaries=locate_binaries()))
        print(f"control plane ready in {self.cluster.start():.1f}s", file=sys.stderr)
        kubeconfig = self.cluster.config.kubeconfig
        kubectl = [str(locate_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}"]
        subprocess.run([*kubectl, "apply", "--server-side", "-f", REPO_ROOT / "crds"],
                       check=True, capture_output=True)
        self.cluster.wait_established("inferencedeployments.spillway.dev")
        subprocess.run([*kubectl, "create", "namespace", LEASE_NS], capture_output=True)
        self.api = config.new_client_from_config(config_file=str(kubeconfig))
        self.started = 0
        self.ops = [self.replica(), self.replica()]
        while not any(is_leader(o) for o in self.ops):
            time.sleep(0.5)

    def replica(self) -> OperatorProcess:
        self.started += 1
        name = f"op-{self.started}"
        return start_operator(
            self.cluster.config.kubeconfig, self.logs / f"{name}.log",
            env={"SPILLWAY_RESYNC_SECONDS": str(RESYNC)},
            extra_args=["--leader-elect", "--leader-election-namespace", LEASE_NS,
                        "--leader-election-identity", name, "--log-format", "full",
                        *(["--verbose"] if self.args.verbose else [])])

    def replace_exited(self) -> int:
        """Start a new replica for each that ended (the kubelet's restart); how many."""
        gone = [o for o in self.ops if o.proc.poll() is not None]
        self.ops = [o for o in self.ops if o not in gone] + [self.replica() for _ in gone]
        return len(gone)

    def total_writes(self) -> float:
        return sum(writes(o) for o in self.ops)

    def trial(self, kind: str, n: int, count: int | None = None) -> Trial:
        t = Trial(self.api, f"{kind}-{n}-{int(time.time())}", count or self.args.count)
        t.setup()
        return t

    def converge(self, trial: Trial, since: float,
                 count_writes: Callable[[], float] | None = None) -> float:
        """Seconds from ``since`` to the last write once everything is converged and
        the operators have been quiet for QUIET s (nan: not within CONVERGE_TIMEOUT)."""
        count_writes = count_writes or self.total_writes
        last_count, last_write = count_writes(), time.monotonic()
        while time.monotonic() - since < CONVERGE_TIMEOUT:
            time.sleep(0.5)
            self.replace_exited()
            if (w := count_writes()) != last_count:
                last_count, last_write = w, time.monotonic()
            elif time.monotonic() - last_write >= QUIET and trial.safe_check()[0]:
                return last_write - since
        return float("nan")

    def after(self, trial: Trial, count_writes: Callable[[], float] | None = None
              ) -> tuple[int, int, float]:
        """(orphaned, duplicate, writes over two resync periods after convergence)."""
        count_writes = count_writes or self.total_writes
        quiet0 = count_writes()
        time.sleep(2 * RESYNC + 2)
        _, orphans, dups = trial.check()
        return orphans, dups, count_writes() - quiet0

    def midway(self, trial: Trial, rng: random.Random) -> int:
        share = rng.uniform(0.1, 0.9)
        trial.create()
        while trial.deployments() < share * trial.count:
            time.sleep(0.05)
        return trial.deployments()

    def close(self) -> None:
        for o in self.ops:
            o.stop()
        self.cluster.stop()


# ---------------------------------------------------------------- leader SIGKILL


def leader_kill(b: Bench, rng: random.Random) -> None:
    rows = []
    for n in range(b.args.trials):
        while not any(is_leader(o) for o in b.ops):
            time.sleep(0.5)
        leader = next(o for o in b.ops if is_leader(o))
        standby = next(o for o in b.ops if o is not leader)
        trial = b.trial("kill", n)
        at = b.midway(trial, rng)
        before = writes(standby)
        leader.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        leader.proc.wait(10)
        replacement = b.replica()  # the kubelet's restart: a candidate as well
        b.ops = [standby, replacement]
        # Whoever takes the Lease first: the standby, or the replacement when it saw the
        # old record expire first (each candidate times expiry from its own observation).
        survivors = lambda s=standby, r=replacement: writes(s) + writes(r)  # noqa: E731
        while survivors() == before:
            time.sleep(0.1)
        failover = time.monotonic() - killed
        converged = b.converge(trial, killed, survivors)
        orphans, dups, after = b.after(trial, survivors)
        rows.append((n + 1, at, failover, converged, orphans, dups, after))
        print(f"leader-kill {n + 1}: killed at {at}/{trial.count} Deployments, failover "
              f"{failover:.1f}s, converged {converged:.1f}s", file=sys.stderr)
        trial.teardown()
    print(f"\nleader SIGKILL during a rollout of {b.args.count} InferenceDeployments "
          f"(lease 15 s / renew 10 s / retry 2 s; 2 replicas)")
    print(f"{'trial':>5} {'killed at':>10} {'failover (s)':>13} {'converged (s)':>14} "
          f"{'orphaned':>9} {'duplicate':>10} {'writes after':>13}")
    for t, at, fo, conv, orph, dup, after in rows:
        print(f"{t:>5} {at:>10} {fo:>13.1f} {conv:>14.1f} {orph:>9} {dup:>10} {after:>13.0f}")
    if rows:
        fos = [r[2] for r in rows]
        print(f"failover (SIGKILL -> a survivor's first write): "
              f"median {statistics.median(fos):.1f}s, max {max(fos):.1f}s over {len(rows)} trials")


# ---------------------------------------------------------------- control-plane outages


def outage(b: Bench, rng: random.Random, kind: str) -> None:
    rows = []
    for n in range(b.args.repeats):
        trial = b.trial(kind, n)
        at = b.midway(trial, rng)
        t0 = time.monotonic()
        if kind == "apiserver":
            b.cluster.restart_apiserver(APISERVER_DOWN)
        else:
            b.cluster.restart_etcd(ETCD_DOWN, kill=True)
        back = time.monotonic()
        down = back - t0
        before = b.total_writes()
        recovered = float("nan")
        exits = 0
        while time.monotonic() - back < CONVERGE_TIMEOUT:
            exits += b.replace_exited()
            if b.total_writes() != before:
                recovered = time.monotonic() - back
                break
            time.sleep(0.1)
        converged = b.converge(trial, back)
        exits += b.replace_exited()
        orphans, dups, after = b.after(trial)
        exits += b.replace_exited()
        rows.append((n + 1, at, down, recovered, converged, exits, orphans, dups, after))
        print(f"{kind} {n + 1}: at {at}/{trial.count} Deployments, down {down:.1f}s, "
              f"converged {converged:.1f}s after, exits {exits}", file=sys.stderr)
        trial.teardown()
    what = (f"kube-apiserver stopped for {APISERVER_DOWN} s" if kind == "apiserver" else
            f"etcd SIGKILLed and started {ETCD_DOWN} s later")
    print(f"\n{what} during a rollout of {b.args.count} InferenceDeployments (2 replicas; "
          "times from the API answering again)")
    print(f"{'trial':>5} {'fault at':>9} {'API down (s)':>13} {'first write (s)':>16} "
          f"{'converged (s)':>14} {'exits':>6} {'orphaned':>9} {'duplicate':>10} "
          f"{'writes after':>13}")
    for t, at, down, rec, conv, ex, orph, dup, after in rows:
        print(f"{t:>5} {at:>9} {down:>13.1f} {rec:>16.1f} {conv:>14.1f} {ex:>6} {orph:>9} "
              f"{dup:>10} {after:>13.0f}")


# ---------------------------------------------------------------- hand edits of children


def _golden(trial: Trial, names: list[str]) -> dict:
    g = {}
    for n in names:
        d = trial.apps.read_namespaced_deployment(n, trial.ns)
        s = trial.core.read_namespaced_service(n, trial.ns)
        c = trial.core.read_namespaced_config_map(f"{n}-plan", trial.ns)
        g[n] = {"deployment": (d.metadata.uid, d.spec.template.spec.containers[0].image,
                               dict(d.metadata.labels)),
                "service": (s.metadata.uid, dict(s.spec.selector)),
                "configmap": (c.metadata.uid, dict(c.data))}
    return g


def _edits(trial: Trial) -> list[tuple[str, Callable[[str], None], Callable[[str, dict], bool]]]:
    """(what, change one object's child, restored?) for each hand change."""
    apps, core, ns = trial.apps, trial.core, trial.ns

    def read(fn, *a):
        try:
            return fn(*a)
        except client.ApiException:
            return None

    def dep_ok(n, g, new_uid=False):
        d = read(apps.read_namespaced_deployment, n, ns)
        uid, image, labels = g["deployment"]
        return bool(d and d.spec.template.spec.containers[0].image == image
                    and all((d.metadata.labels or {}).get(k) == v for k, v in labels.items())
                    and (d.metadata.uid != uid) == new_uid)

    def svc_ok(n, g, new_uid=False):
        s = read(core.read_namespaced_service, n, ns)
        uid, selector = g["service"]
        return bool(s and s.spec.selector == selector and (s.metadata.uid != uid) == new_uid)

    def cm_ok(n, g, new_uid=False):
        c = read(core.read_namespaced_config_map, f"{n}-plan", ns)
        uid, data = g["configmap"]
        return bool(c and c.data == data and (c.metadata.uid != uid) == new_uid)

    return [
        ("Deployment deleted", lambda n: apps.delete_namespaced_deployment(n, ns),
         lambda n, g: dep_ok(n, g, True)),
        ("Service deleted", lambda n: core.delete_namespaced_service(n, ns),
         lambda n, g: svc_ok(n, g, True)),
        ("plan ConfigMap deleted", lambda n: core.delete_namespaced_config_map(f"{n}-plan", ns),
         lambda n, g: cm_ok(n, g, True)),
        ("Deployment image edited", lambda n: apps.patch_namespaced_deployment(
            n, ns, {"spec": {"template": {"spec": {"containers": [
                {"name": "engine", "image": "busybox:hand"}]}}}}), dep_ok),
        ("Deployment labels removed", lambda n: apps.patch_namespaced_deployment(
            n, ns, {"metadata": {"labels": {OWNER_LABEL: None, MANAGED_BY: None}}}), dep_ok),
        ("Service selector edited", lambda n: core.patch_namespaced_service(
            n, ns, {"spec": {"selector": {"app": "elsewhere"}}}), svc_ok),
        ("plan ConfigMap data edited", lambda n: core.patch_namespaced_config_map(
            f"{n}-plan", ns, {"data": {"plan.json": "{}"}}), cm_ok),
    ]


def child_edit(b: Bench, rng: random.Random) -> None:
    rows: dict[str, list[tuple[float, int]]] = {}
    for n in range(b.args.repeats):
        trial = b.trial("edit", n)
        trial.create()
        b.converge(trial, time.monotonic())
        golden = _golden(trial, trial.names)
        for what, change, ok in _edits(trial):
            names = rng.sample(trial.names, min(EDITED, len(trial.names)))
            t0 = time.monotonic()
            for name in names:
                change(name)
            pending = set(names)
            while pending and time.monotonic() - t0 < 120:
                pending = {x for x in pending if not ok(x, golden[x])}
                time.sleep(0.2)
            repaired = time.monotonic() - t0 if not pending else float("nan")
            rows.setdefault(what, []).append((repaired, len(names) - len(pending)))
            # The repaired objects' new uids are the golden ones from now on.
            golden.update(_golden(trial, names))
            print(f"child-edit {n + 1}: {what}: {len(names) - len(pending)}/{len(names)} "
                  f"repaired in {repaired:.1f}s", file=sys.stderr)
        b.converge(trial, time.monotonic())
        orphans, dups, _ = b.after(trial)
        rows.setdefault("(after all, orphaned + duplicate)", []).append((orphans + dups, 0))
        trial.teardown()
    print(f"\nchildren deleted or edited by hand, {EDITED} objects at once of "
          f"{b.args.count} (2 replicas; resync {RESYNC} s)")
    print(f"{'change':<28} {'repaired':>9} {'all repaired after (s), each trial':>36}")
    for what, results in rows.items():
        if what.startswith("(after"):
            print(f"{'orphaned + duplicate after':<28} {'':>9} "
                  f"{' '.join(str(int(r[0])) for r in results):>36}")
            continue
        got = f"{sum(r[1] for r in results)}/{EDITED * len(results)}"
        print(f"{what:<28} {got:>9} {' '.join(f'{r[0]:.1f}' for r in results):>36}")


# ---------------------------------------------------------------- invalid among valid


def _rollout(trial: Trial, bodies: list[dict], valid: list[str]) -> list[float]:
    """Create ``bodies`` in order; return create -> Deployment seconds of ``valid``."""
    created: dict[str, float] = {}
    seen: dict[str, float] = {}
    done = threading.Event()

    def watcher():
        w = watch.Watch()
        for ev in w.stream(trial.apps.list_namespaced_deployment, trial.ns,
                           timeout_seconds=CONVERGE_TIMEOUT):
            name = ev["object"].metadata.name
            if ev["type"] == "ADDED" and name not in seen:
                seen[name] = time.monotonic()
                if set(valid) <= set(seen):
                    w.stop()
        done.set()

    threading.Thread(target=watcher, daemon=True).start()
    time.sleep(0.5)
    for bd in bodies:
        created[bd["metadata"]["name"]] = time.monotonic()
        trial.custom.create_namespaced_custom_object(GROUP, VERSION, trial.ns, PLURAL, bd)
    done.wait(CONVERGE_TIMEOUT)
    return [seen[n] - created[n] for n in valid if n in seen]


def _has_condition(obj: dict) -> bool:
    return any(c.get("type") == "PlanReady"
               for c in (obj.get("status") or {}).get("conditions", []))


def invalid(b: Bench, rng: random.Random) -> None:
    rows = []
    for n in range(b.args.repeats):
        for with_invalid in (False, True):
            trial = b.trial("invalid" if with_invalid else "valid", n)
            bad = []
            if with_invalid:
                bad = [body(f"refused{i}", host_memory="1Ki") for i in range(INVALID // 2)]
                bad += [body(f"missing{i}", config_map=f"absent-{i}")
                        for i in range(INVALID - INVALID // 2)]
            # The invalid ones first, until each has its condition: from then on they
            # only retry (the missing configs) or wait for a spec change (the refused).
            trial.create(bad)
            while bad and not all(map(_has_condition, trial.custom.list_namespaced_custom_object(
                    GROUP, VERSION, trial.ns, PLURAL)["items"])):
                time.sleep(0.5)
            retries0 = sum(o.metric("spillway_operator_reconciles_total", outcome="retry")
                           for o in b.ops)
            t0 = time.monotonic()
            lat = _rollout(trial, [body(x) for x in trial.names], trial.names)
            converged = b.converge(trial, t0)
            retries = sum(o.metric("spillway_operator_reconciles_total", outcome="retry")
                          for o in b.ops) - retries0
            rows.append((n + 1, len(bad), len(lat), pct(lat, 0.5), pct(lat, 0.99), converged,
                         retries))
            print(f"invalid {n + 1}: {len(bad)} invalid, p99 {pct(lat, 0.99):.1f}s, converged "
                  f"{converged:.1f}s", file=sys.stderr)
            trial.teardown()
    print(f"\n{b.args.count} valid InferenceDeployments, alone and beside {INVALID} invalid ones "
          f"({INVALID // 2} plans refused, {INVALID - INVALID // 2} model configs missing and "
          "retried with back-off; created first, each with its condition before the valid "
          "ones come)")
    print(f"{'trial':>5} {'invalid':>8} {'valid done':>11} {'p50 (s)':>8} {'p99 (s)':>8} "
          f"{'converged (s)':>14} {'retries':>8}")
    for t, bad, done, p50, p99, conv, retries in rows:
        print(f"{t:>5} {bad:>8} {done:>11} {p50:>8.1f} {p99:>8.1f} {conv:>14.1f} "
              f"{retries:>8.0f}")
    print("p50/p99: create -> Deployment of the valid objects; converged: the first valid "
          "create -> all valid objects complete and current, the operators quiet; retries: "
          "reconciles of the missing configs meanwhile")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=200,
                    help="objects per rollout (the local Service range holds ~250)")
    ap.add_argument("--trials", type=int, default=10, help="leader-kill trials")
    ap.add_argument("--repeats", type=int, default=3, help="trials of every other fault")
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--logs", type=Path, help="keep the operators' logs in this folder")
    ap.add_argument("--verbose", action="store_true",
                    help="the operators log every API request (to count writes, with --logs)")
    args = ap.parse_args()
    chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := set(chosen) - set(FAULTS):
        ap.error(f"unknown faults: {', '.join(sorted(unknown))}")
    rng = random.Random(args.seed)
    b = Bench(args)
    try:
        for fault in chosen:
            if fault == "leader-kill":
                leader_kill(b, rng)
            elif fault in ("apiserver", "etcd"):
                outage(b, rng, fault)
            elif fault == "child-edit":
                child_edit(b, rng)
            else:
                invalid(b, rng)
            sys.stdout.flush()
    finally:
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
