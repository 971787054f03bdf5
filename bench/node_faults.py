"""Faults on the real nodes under streaming load through spillway-router (or a gateway).

Spillway installed from its images with the Helm chart on two real nodes (kubelet,
containerd, runc; the engine image on the emulated GPU), one InferenceDeployment with
two replicas (one per node), clients streaming completions through the chart's router
Service the whole time. Faults, one after the other, each once the object is
Available again:

  kubelet     the kubelet of a serving pod's node stopped (SIGTERM) and started again
              10 s later: its pods should keep running, nothing restarts;
  containerd  that node's containerd SIGKILLed and started again 5 s later;
  network     every packet to and from one engine pod dropped (iptables on the host,
              which is both nodes' network namespace) for 40 s, then let through;
  shm         an engine pod's memory-backed /dev/shm filled to its size limit from
              inside the container (dd) for 30 s, then freed;
  disk        the disk tier's volume (a SharedPVC over a 64 MiB tmpfs, installed only
              with this fault: bench/node_faults_disk.py) filled to ENOSPC from inside
              an engine container for 45 s while every client sends a new prefix (so
              every chunk is a new store), then freed: stores fail and are counted,
              serving goes on, Degraded=True DiskTierWriteFailing comes and goes;
  node        a node lost with open streams: its kubelet, containerd and device plugin
              stopped and every process of its pods SIGKILLed; the node goes NotReady,
              its pods are evicted when their NotReady toleration ends and replaced on
              the other node; then the node comes back;
  node-leader the same, and the operator's leader (the Lease holder) SIGKILLed once
              the node is NotReady: the standby takes over and finishes the recovery.

Per fault: requests started from the fault to convergence, how many ended with an
OpenAI-shaped retryable error (an HTTP 429/5xx with an ``{"error": ...}`` body, or an
SSE ``data: {"error": ...}`` chunk), how many were reset (the connection ended
mid-answer: the client's HTTP library raises, an error it can retry but not in OpenAI's
shape), how many were lost (anything else: a stream ended short without an error, an
unshaped status, no byte for 60 s), the emulator's KV mismatches (every
engine container's ``spillway_emulator_kv_mismatch_total``), the object's condition
changes while it lasted, and the time from the fault to Available again (Available=True,
every replica ready, the router sending to every replica).

With ``--path gateway`` the clients go through Envoy asking spillway-router's endpoint
picker (bench/node_faults_gateway.py) instead of the router's proxy; converged then
also means the gateway lists every replica.

Usage: python -m bench.node_faults [--faults kubelet,containerd,network,shm,disk,node,node-leader]
                                   [--path router|gateway] [--clients 4] [--keep]
Needs root, tools/host.sh, tools/build.sh and tools/images.sh (build the images from
this tree first); holds the real-nodes tier's lock (one real-node cluster per machine).
Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

from bench import node_faults_disk as disk
from bench import node_faults_gateway as gateway_path
from e2e import install
from e2e.cluster.controlplane import REPO_ROOT, ClusterConfig, LocalCluster, Ports, locate_binaries
from e2e.cluster.errors import ClusterError
from e2e.nodes.faults import NodeFaults
from e2e.nodes.tier import tier_session
from spillway_engine.emulator.tiny import qwen3_next_config, write_model
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION

WORKDIR = Path(os.environ.get("SPILLWAY_NODE_FAULTS_DIR", "/tmp/spillway-node-faults"))
SERVING = "spillway-serving"
NAME = "tiny"
SAMPLE = REPO_ROOT / "config/samples/qwen3-next-tiny-emulated.yaml"
ENGINE_PORT = 8000
PREFIXES, PREFIX_TOKENS, QUESTION_TOKENS, MAX_TOKENS = 8, 256, 16, 48
VOCAB = (3, 500)
RETRYABLE = {408, 429, 500, 502, 503, 504}
HUNG_S = 60  # no byte for this long: the stream is counted lost (hung)
FAULTS = ("kubelet", "containerd", "network", "shm", "disk", "node", "node-leader")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------- the clients


def _lines(r: Any) -> Iterator[bytes]:
    """The answer's lines. Not ``for line in r``: http.client's line reading ends quietly
    where a chunked body was cut off (its peek swallows IncompleteRead); ``read1``
    raises, as a client's HTTP library does."""
    rest = b""
    while chunk := r.read1(65536):
        *whole, rest = (rest + chunk).split(b"\n")
        yield from whole
    if rest:
        yield rest


def stream_once(url: str, model: str, prompt: list[int]) -> tuple[str, str]:
    """One streamed completion -> (outcome, detail); outcome ok | retryable | reset |
    lost. ``reset``: the connection ended mid-answer, so the client's HTTP library raised
    (an error it can retry, though not OpenAI-shaped: what a gateway does when the pod
    goes away under a stream whose head is out); ``lost``: anything else that is not a
    complete answer (a hang, an answer cut short without an error, an unshaped status)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    tokens, done, lines, where = 0, False, 0, ""
    try:
        with urllib.request.urlopen(req, timeout=HUNG_S) as r:
            where = r.headers.get("x-spillway-upstream") or ""  # the gateway's pod
            for raw in _lines(r):
                lines += 1
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        code = int(chunk["error"].get("code") or 0)
                        return ("retryable" if code in RETRYABLE else "lost",
                                f"SSE error {code}: {chunk['error'].get('message', '')[:80]}")
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except urllib.error.HTTPError as e:
        try:
            shaped = "error" in json.loads(e.read())
        except (ValueError, OSError):
            shaped = False
        ok = shaped and e.code in RETRYABLE
        return ("retryable" if ok else "lost", f"HTTP {e.code}{'' if shaped else ' unshaped'}")
    except (http.client.IncompleteRead, ConnectionResetError) as e:  # cut mid-answer
        return "reset", f"{type(e).__name__} after {lines} lines: {str(e)[:60]}"
    except (OSError, ValueError) as e:  # a timeout (hung), a refused connection
        return "lost", f"{type(e).__name__}: {str(e)[:80]}"
    if done and tokens == MAX_TOKENS:
        return "ok", ""
    return "lost", (f"stream ended without [DONE] or short ({tokens} tokens, {lines} lines"
                     f"{', from ' + where if where else ''})")


@dataclass
class Load:
    url: str
    model: str
    clients: int
    results: list[tuple[float, float, str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(7)
        self.prefixes = [[rng.randrange(*VOCAB) for _ in range(PREFIX_TOKENS)]
                         for _ in range(PREFIXES)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(self.clients)]
        self._lock = threading.Lock()
        # Set: each request a new prefix (every chunk a new store for the tiers).
        self.fresh = False

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(HUNG_S + 10)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prefix = [rng.randrange(*VOCAB) for _ in range(PREFIX_TOKENS)] if self.fresh \
                else self.prefixes[rng.randrange(PREFIXES)]
            prompt = prefix + [rng.randrange(*VOCAB) for _ in range(QUESTION_TOKENS)]
            t0 = time.monotonic()
            outcome, detail = stream_once(self.url, self.model, prompt)
            with self._lock:
                self.results.append((t0, time.monotonic(), outcome, detail))
            if outcome != "ok":
                self._stop.wait(0.5)  # as a client backing off before its retry

    def window(self, t0: float, t1: float) -> list[tuple[float, float, str, str]]:
        with self._lock:
            # every request the fault could touch: in flight at any moment of it
            return [r for r in self.results if r[0] < t1 and r[1] >= t0]


# ------------------------------------------------------------------- what we watch


class Watcher:
    """Polls, every second, the object's conditions, the engine pods' KV mismatch
    counters (kept per container: a restarted one starts from 0) and the router."""

    def __init__(self, api: client.ApiClient, router_url: str,
                 release_ns: str = install.RELEASE_NAMESPACE) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.router_url = router_url
        self.release_ns = release_ns  # the chart's: the operators, their Lease, the router
        self.gateway: Any = None  # a PoolGateway when the clients go through one
        self.mismatch: dict[str, float] = {}  # container id -> counter
        self.disk: dict[str, dict[str, float]] = {}  # pod -> its disk-tier counters
        self.transitions: list[tuple[float, str]] = []
        self._last: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def obj(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, SERVING, PLURAL, NAME)

    def pods(self) -> list[client.V1Pod]:
        return [p for p in self.core.list_namespaced_pod(
            SERVING, label_selector=f"spillway.dev/inference-deployment={NAME}").items
            if not p.metadata.deletion_timestamp]

    def router_ready(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.router_url}/healthz", timeout=3) as r:
                return sum(json.loads(r.read())["ready_pods"].values())
        except (OSError, ValueError, KeyError):
            return 0

    def routed(self) -> dict[str, float]:
        """pod -> requests the router sent it (its requests counter)."""
        out: dict[str, float] = {}
        try:
            with urllib.request.urlopen(f"{self.router_url}/metrics", timeout=3) as r:
                text = r.read().decode()
        except OSError:
            return out
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "spillway_router_requests_total":
                    out[s.labels["pod"]] = out.get(s.labels["pod"], 0.0) + s.value
        return out

    def _scrape(self) -> None:
        for p in self.pods():
            statuses = p.status.container_statuses or []
            if not p.status.pod_ip or not statuses or not statuses[0].container_id:
                continue
            try:
                url = f"http://{p.status.pod_ip}:{ENGINE_PORT}/metrics"
                with urllib.request.urlopen(url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            tier = dict.fromkeys(disk.COUNTERS.values(), 0.0)
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "spillway_emulator_kv_mismatch_total":
                        self.mismatch[statuses[0].container_id] = s.value
                    elif s.name in disk.COUNTERS:
                        tier[disk.COUNTERS[s.name]] += s.value
            self.disk[p.metadata.name] = tier

    def condition(self, kind: str) -> str:
        """The object's ``kind`` condition as "<status> <reason>"."""
        for c in self.obj().get("status", {}).get("conditions", []):
            if c["type"] == kind:
                return f"{c['status']} {c.get('reason', '')}"
        return ""

    def disk_totals(self) -> dict[str, float]:
        """The disk-tier counters summed over the pods seen."""
        return {k: sum(c.get(k, 0.0) for c in self.disk.values()) for k in disk.COUNTERS.values()}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conds = self.obj().get("status", {}).get("conditions", [])
                for c in conds:
                    now = f"{c['status']} {c.get('reason', '')}".strip()
                    if self._last.get(c["type"]) not in (None, now):
                        self.transitions.append((time.monotonic(), f"{c['type']}={now}"))
                    self._last[c["type"]] = now
                self._scrape()
            except Exception as e:  # the API server may be slow in a fault; keep polling
                say(f"watcher: {type(e).__name__}: {e}")
            self._stop.wait(1.0)

    def converged(self, replicas: int) -> bool:
        o = self.obj()
        avail = next((c for c in o.get("status", {}).get("conditions", [])
                      if c["type"] == "Available"), {})
        ready = [p for p in self.pods() if any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
        return (avail.get("status") == "True" and len(ready) >= replicas
                and o.get("status", {}).get("readyReplicas", 0) >= replicas
                and self.router_ready() >= replicas
                and (self.gateway is None or len(self.gateway.endpoints) >= replicas))


def wait(what: str, check, timeout: float, interval: float = 1.0) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - t0


# ------------------------------------------------------------------- the faults


@dataclass
class Row:
    fault: str
    t0: float
    t_end: float = 0.0
    available_s: float | None = None
    mismatch: float = 0.0  # KV mismatches counted by the fault's end (all so far)
    notes: list[str] = field(default_factory=list)


def _node_of(w: Watcher, avoid: str | None) -> tuple[client.V1Pod, str]:
    """An engine pod, on a node without ``avoid`` (the router's) when there is one."""
    pods = sorted(w.pods(), key=lambda p: (p.spec.node_name == avoid, p.metadata.name))
    return pods[0], pods[0].spec.node_name


def _containers(w: Watcher) -> dict[str, tuple[str, int]]:
    return {p.metadata.name: (p.status.container_statuses[0].container_id,
                              p.status.container_statuses[0].restart_count)
            for p in w.pods() if p.status.container_statuses}


def _converge(w: Watcher, row: Row, replicas: int, timeout: float) -> None:
    try:
        wait("Available with every replica ready and routed", lambda: w.converged(replicas),
             timeout)
        row.available_s = time.monotonic() - row.t0
    except TimeoutError as e:
        row.notes.append(str(e))


def fault_restart(part: str, w: Watcher, nf: NodeFaults, router_node: str | None,
                  replicas: int) -> Row:
    _pod, node = _node_of(w, None)
    before = _containers(w)
    row = Row(f"{part} restarted on {node}", time.monotonic())
    down = 10 if part == "kubelet" else 5
    nf.stop(part, node, signal.SIGTERM if part == "kubelet" else signal.SIGKILL)
    time.sleep(down)
    nf.start(part, node)
    row.notes.append(f"{part} down {time.monotonic() - row.t0:.1f}s")
    time.sleep(5)  # the kubelet's first sync after the restart
    _converge(w, row, replicas, 600)
    after = _containers(w)
    same = sum(1 for k, v in before.items() if after.get(k) == v)
    row.notes.append(f"containers unchanged {same}/{len(before)}")
    return row


def fault_network(w: Watcher, nf: NodeFaults, router_node: str | None, replicas: int,
                  hold_s: float = 40) -> Row:
    pod, _node = _node_of(w, router_node)
    ip, name = pod.status.pod_ip, pod.metadata.name
    row = Row(f"network to {name[-5:]} cut {hold_s:.0f}s", time.monotonic())
    nf.cut(ip)
    last_count, last_change = w.routed().get(name, 0.0), row.t0
    unhealthy_at = None
    while time.monotonic() - row.t0 < hold_s:
        n = w.routed().get(name, last_count)
        if n != last_count:
            last_count, last_change = n, time.monotonic()
        if unhealthy_at is None and w.router_ready() < replicas:
            unhealthy_at = time.monotonic() - row.t0
        time.sleep(0.5)
    nf.heal()
    row.notes.append(f"router's last request to it {last_change - row.t0:.1f}s after the cut"
                     + (f", router dropped it at {unhealthy_at:.1f}s" if unhealthy_at else ""))
    _converge(w, row, replicas, 600)
    return row


def fault_shm(w: Watcher, cluster: LocalCluster, replicas: int, hold_s: float = 30) -> Row:
    """Fill an engine pod's memory-backed /dev/shm (the host pool's home, sized by the
    plan) to its size limit from inside the container, hold, then free it."""
    pod, _node = _node_of(w, None)
    name = pod.metadata.name
    before = _containers(w)
    row = Row(f"/dev/shm of {name[-5:]} full {hold_s:.0f}s", time.monotonic())
    fill = ("dd if=/dev/zero of=/dev/shm/fault-fill bs=1M 2>&1 | tail -1; "
            "df -k /dev/shm | tail -1")
    out = cluster.kubectl("exec", "-n", SERVING, name, "-c", "engine", "--", "sh", "-c",
                          fill, check=False)
    row.notes.append(" / ".join(x.strip() for x in out.strip().splitlines()[-2:]))
    time.sleep(hold_s)
    cluster.kubectl("exec", "-n", SERVING, name, "-c", "engine", "--",
                    "rm", "-f", "/dev/shm/fault-fill", check=False)
    _converge(w, row, replicas, 600)
    after = _containers(w)
    same = sum(1 for k, v in before.items() if after.get(k) == v)
    row.notes.append(f"containers unchanged {same}/{len(before)}; "
                     f"pods now {sorted(p[-5:] for p in after)}")
    return row


def fault_disk(w: Watcher, cluster: LocalCluster, load: Load, replicas: int,
               hold_s: float = 45) -> Row:
    """Fill the disk tier's volume to ENOSPC from inside an engine container while the
    clients send new prefixes, hold, then free it; the condition's coming and going is
    timed from the fill and from the freeing."""
    pod, _node = _node_of(w, None)
    name = pod.metadata.name
    before_c, before = _containers(w), w.disk_totals()
    load.fresh = True
    row = Row(f"disk tier volume full {hold_s:.0f}s", time.monotonic())
    out = cluster.kubectl("exec", "-n", SERVING, name, "-c", "engine", "--", "sh", "-c",
                          disk.fill_command(), check=False)
    row.notes.append(" / ".join(x.strip() for x in out.strip().splitlines()[-2:]))
    try:
        took = wait("Degraded=True DiskTierWriteFailing",
                    lambda: w.condition("Degraded") == "True DiskTierWriteFailing",
                    hold_s + 120)
        said = w.obj().get("status", {}).get("diskTier") or {}
        row.notes.append(f"Degraded=True DiskTierWriteFailing {took:.1f}s after the fill, "
                         f"status.diskTier {json.dumps(said)}")
    except TimeoutError as e:
        row.notes.append(str(e))
    time.sleep(max(0.0, row.t0 + hold_s - time.monotonic()))
    full = w.disk_totals()
    cluster.kubectl("exec", "-n", SERVING, name, "-c", "engine", "--", "rm", "-f",
                    disk.FILL, check=False)
    t_free = time.monotonic()
    try:
        took = wait("Degraded=False", lambda: w.condition("Degraded").startswith("False"), 300)
        row.notes.append(f"Degraded=False {took:.1f}s after freeing; status.diskTier "
                         f"{'gone' if 'diskTier' not in w.obj().get('status', {}) else 'left'}")
    except TimeoutError as e:
        row.notes.append(str(e))
    time.sleep(10)  # stores again after the freeing
    load.fresh = False
    after = w.disk_totals()
    row.notes.append(
        f"while full: {full['failures'] - before['failures']:.0f} failed stores, "
        f"{full['dropped'] - before['dropped']:.0f} dropped, "
        f"{full['stores'] - before['stores']:.0f} written; after freeing "
        f"{after['stores'] - full['stores']:.0f} written in {time.monotonic() - t_free:.0f}s, "
        f"{after['failures'] - full['failures']:.0f} failed")
    _converge(w, row, replicas, 600)
    after_c = _containers(w)
    same = sum(1 for k, v in before_c.items() if after_c.get(k) == v)
    row.notes.append(f"containers unchanged {same}/{len(before_c)}")
    return row


def _leader(w: Watcher) -> tuple[str, str]:
    """(the leader's pod, its Lease's holderIdentity: ``<pod>_<random>``)."""
    lease = client.CoordinationV1Api(w.core.api_client).read_namespaced_lease(
        f"{install.RELEASE}-leader", w.release_ns)
    holder = lease.spec.holder_identity or ""
    return holder.rsplit("_", 1)[0], holder


def kill_pod_processes(p: client.V1Pod) -> int:
    """SIGKILL every process of the pod's first container, from the host through its
    memory cgroup (PID 1 of a container ignores signals sent from inside it)."""
    cid = p.status.container_statuses[0].container_id.split("://", 1)[1]
    root = Path("/sys/fs/cgroup/memory")
    procs = [*root.glob(f"*/kubepods/*/pod{p.metadata.uid}/{cid}/cgroup.procs"),
             *root.glob(f"*/kubepods/pod{p.metadata.uid}/{cid}/cgroup.procs")]
    pids = [int(x) for f in procs for x in f.read_text().split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return len(pids)


def fault_node(w: Watcher, nf: NodeFaults, router_node: str | None, replicas: int,
               kill_leader: bool = False) -> Row:
    _pod, node = _node_of(w, router_node)
    row = Row(f"node {node} lost" + (" + leader killed" if kill_leader else ""),
              time.monotonic())
    for part in ("kubelet", "gpuplugin", "containerd"):
        nf.stop(part, node, signal.SIGKILL)
    killed = nf.kill_containers(node)
    row.notes.append(f"{killed} processes of its pods killed")
    core = w.core

    def not_ready() -> bool:
        n = core.read_node(node)
        return any(c.type == "Ready" and c.status != "True" for c in n.status.conditions)

    row.notes.append(f"node NotReady after {wait('NotReady', not_ready, 300):.0f}s")
    if kill_leader:  # while the node is lost: the new leader must finish the recovery
        leader, holder = _leader(w)
        t_kill = time.monotonic()
        n = kill_pod_processes(w.core.read_namespaced_pod(leader, w.release_ns))
        try:
            took = wait("another operator holding the Lease",
                        lambda: _leader(w)[1] not in ("", holder), 300, 0.5)
            row.notes.append(f"leader {leader} killed ({n} processes) "
                             f"{t_kill - row.t0:.0f}s in; {_leader(w)[0]} took over after "
                             f"{took:.1f}s")
        except TimeoutError as e:  # e.g. no operator replica left off the lost node
            row.notes.append(f"leader {leader} killed: {e}")
    served_again = None
    t_ready = time.monotonic()
    while time.monotonic() - row.t0 < 1200:
        others = [p for p in w.pods() if p.spec.node_name and p.spec.node_name != node
                  and any(c.type == "Ready" and c.status == "True"
                          for c in p.status.conditions or [])]
        if served_again is None and len(others) >= replicas:
            served_again = time.monotonic() - row.t0
            break
        time.sleep(2)
    row.notes.append(f"replicas ready off the node {served_again:.0f}s after the loss"
                     if served_again else "no replacement within 1200s")
    _converge(w, row, replicas, 300)
    for part in ("containerd", "kubelet", "gpuplugin"):
        nf.start(part, node)
    wait("the node Ready again", lambda: not not_ready(), 300)
    row.notes.append(f"node back Ready {time.monotonic() - t_ready:.0f}s after NotReady")
    return row


# ------------------------------------------------------------------- the run


def install_serving(cluster: LocalCluster, replicas: int, disk_tier: bool = False,
                    gateway: bool = False) -> tuple[str, str]:
    """Images, chart, model; the InferenceDeployment applied (``disk_tier``: with the
    disk tier on node_faults_disk's volume; ``gateway``: the chart in the serving
    namespace with the router's endpoint picker). -> (router url, model)."""
    refs = install.image_refs()
    t0 = time.monotonic()
    say(f"images into the nodes: {install.load_images(refs)} "
        f"({time.monotonic() - t0:.0f}s)")
    cluster.kubectl("create", "namespace", SERVING, check=False)
    if gateway:
        gateway_path.install_crd(cluster)
        install.helm_install(cluster, refs["operator"], SERVING, *gateway_path.HELM_ARGS,
                             release_namespace=SERVING)
    else:
        install.helm_install(cluster, refs["operator"], SERVING)
    model_config = qwen3_next_config(num_layers=4)
    model_dir = write_model(WORKDIR / "models" / "tiny-qwen3-next", model_config)
    install.model_volume(cluster, SERVING, "models", model_dir)
    sample = yaml.safe_load(SAMPLE.read_text())
    install.model_config_map(cluster, SERVING, sample["spec"]["model"]["configMapRef"]["name"],
                             model_config)
    obj = install.on_real_nodes(sample, refs["engine"], "models")
    obj["metadata"]["name"] = NAME
    obj["spec"]["replicas"] = replicas
    obj["spec"]["autoscaling"] = {"enabled": False}
    if disk_tier:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(disk.objects(SERVING)))
        obj["spec"]["offload"]["disk"] = disk.offload_disk()
    obj["spec"]["resources"]["affinity"] = {"podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"spillway.dev/inference-deployment": NAME}}}}]}}
    cluster.kubectl("apply", "-n", SERVING, "-f", "-", input=yaml.safe_dump(obj))
    [svc] = client.CoreV1Api(config.new_client_from_config(
        config_file=str(cluster.config.kubeconfig))).list_service_for_all_namespaces(
        label_selector="app.kubernetes.io/name=spillway-router").items
    return (f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}",
            sample["spec"]["model"]["name"])


def table(rows: list[Row], load: Load, w: Watcher) -> None:
    print(f"\n{'fault':<40} {'sent':>5} {'retryable':>9} {'reset':>5} {'lost':>5} "
          f"{'mismatch':>8} "
          f"{'to Available':>12}  conditions while it lasted; notes", flush=True)
    everything = Row("all requests of the run", 0.0, float("inf"),
                     mismatch=sum(w.mismatch.values()))
    for r in [*rows, everything]:
        got = load.window(r.t0, r.t_end)
        n = {k: sum(1 for x in got if x[2] == k) for k in ("ok", "retryable", "reset", "lost")}
        conds = [c for t, c in w.transitions if r.t0 <= t < r.t_end]
        avail = ("" if r is everything else "never" if r.available_s is None
                 else f"{r.available_s:.1f}s")
        print(f"{r.fault:<40} {len(got):>5} {n['retryable']:>9} {n['reset']:>5} {n['lost']:>5} "
              f"{r.mismatch:>8.0f} {avail:>12}  {', '.join(conds) or '-'}; "
              f"{'; '.join(r.notes)}", flush=True)
        details = sorted({x[3] for x in got if x[2] != "ok"})
        for d in details[:6]:
            print(f"{'':<40}   {d}", flush=True)
    print(f"KV mismatches (spillway_emulator_kv_mismatch_total, every engine container "
          f"seen): {sum(w.mismatch.values()):.0f} over {len(w.mismatch)} containers",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--path", choices=("router", "gateway"), default="router",
                    help="what the clients go through: spillway-router's proxy, or Envoy "
                    "asking its endpoint picker")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="leave the cluster running")
    args = ap.parse_args()
    chosen = [f for f in args.faults.split(",") if f]
    if unknown := set(chosen) - set(FAULTS):
        ap.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    lock = contextlib.ExitStack()
    try:
        lock.enter_context(tier_session())
    except ClusterError as exc:
        print(exc, file=sys.stderr)
        return 1
    cluster = LocalCluster(ClusterConfig(workdir=WORKDIR, ports=Ports.free(), nodes=0,
                                         real_nodes=2,
                                         binaries=locate_binaries(real_nodes=True)))
    load: Load | None = None
    w: Watcher | None = None
    rows: list[Row] = []
    replicas = 2
    try:
        cluster.stop()
        # etcd's folder outlives a stopped cluster: its pods, and a `kubernetes` Service
        # pointing at an earlier run's API server port, would come back. Start clean.
        shutil.rmtree(WORKDIR, ignore_errors=True)
        if "disk" in chosen:  # before the nodes start: their mount namespaces copy it
            disk.mount()
        say(f"control plane + 2 real nodes up in {cluster.start():.1f}s")
        via_gateway = args.path == "gateway"
        url, model = install_serving(cluster, replicas, disk_tier="disk" in chosen,
                                     gateway=via_gateway)
        api = config.new_client_from_config(config_file=str(cluster.config.kubeconfig))
        w = Watcher(api, url, SERVING if via_gateway else install.RELEASE_NAMESPACE)
        t0 = time.monotonic()
        if via_gateway:
            w.gateway = gateway_path.start(api, SERVING, NAME, WORKDIR / "gateway")
            say(f"gateway: Envoy {w.gateway.url}, ext_proc to {w.gateway.envoy.cfg.picker}")
        wait("Available with 2 replicas", lambda: w.converged(replicas), 900, 2)
        say(f"2 engine pods serving through the {args.path} {time.monotonic() - t0:.0f}s after "
            f"apply: {[(p.metadata.name, p.spec.node_name) for p in w.pods()]}")
        w.start()
        load = Load(w.gateway.url if via_gateway else url, model, args.clients)
        load.start()
        time.sleep(20)
        [router] = w.core.list_namespaced_pod(
            w.release_ns,
            label_selector="app.kubernetes.io/name=spillway-router").items
        router_node = router.spec.node_name
        nf = NodeFaults(cluster.real_nodes())
        for f in chosen:
            say(f"fault: {f}")
            if f in ("kubelet", "containerd"):
                row = fault_restart(f, w, nf, router_node, replicas)
            elif f == "network":
                row = fault_network(w, nf, router_node, replicas)
            elif f == "shm":
                row = fault_shm(w, cluster, replicas)
            elif f == "disk":
                row = fault_disk(w, cluster, load, replicas)
            else:
                row = fault_node(w, nf, router_node, replicas, kill_leader=f == "node-leader")
            time.sleep(10)  # requests after convergence count to the fault's row
            row.t_end = time.monotonic()
            row.mismatch = sum(w.mismatch.values())
            rows.append(row)
            say(f"{row.fault}: Available after {row.available_s}s; {'; '.join(row.notes)}")
        return 0
    finally:
        if load is not None:
            load.stop()
        if w is not None:
            w.stop()
        if rows and load is not None and w is not None:  # what was measured, even so
            print(f"\nclients through {args.path}", flush=True)
            table(rows, load, w)
        if w is not None and w.gateway is not None:
            w.gateway.stop()
        NodeFaults(cluster.real_nodes()).heal()
        if not args.keep:
            cluster.stop()
            disk.unmount()
        lock.close()


if __name__ == "__main__":
    sys.exit(main())
