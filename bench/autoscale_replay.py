"""One autoscaling trace on the emulated fleet and in the simulator, side by side.

The autoscaling sweep (``bench.autoscale``) runs in the simulator's virtual time; this
bench checks that what it measures is what a real fleet does. It replays one seeded
trace, in real time, against

* **the emulated fleet**: the local control plane (etcd, kube-apiserver, scheduler,
  controller-manager, KWOK nodes), the operator as a process with its real autoscaler
  loop (the CRD's default policy: target 1.0, 15 s interval, 300 s scale-down window),
  and on each pod's IP vLLM 0.33's real server with Spillway's offloader on an emulated
  GPU (``e2e.simfleet``, ``engine="emulated"``); a pod turns Ready when its engine
  answers ``/health``; and
* **the simulator**: ``bench.autoscale.run_policy`` with the operator's policy code,
  the plan the operator put in the pods' ConfigMap, the same GPU KV blocks, scheduler
  limits and model load time (the fleet's median pod creation -> Ready), and a latency
  model of the emulated GPU (``LatencyModel.emulating``: the emulator's roofline at
  the spec's speed, plus the engine's own CPU time per step, measured on the first pod
  before the trace starts);

and prints replica-minutes, the share of requests within the TTFT target, TTFT
percentiles and the host tier's share of prompt tokens for both, and their
differences. Exit status 1 if replica-minutes or attainment differ by more than 10 %.

Two traces, both at a small CPU's scale on the demo's tiny Qwen3-Next-style hybrid
(four KV-cache groups, a 4 MiB host pool), steps timed as a 70B model on an H100:
``bursty`` (``fleet_trace``): shared-prefix questions and multi-turn chats, 1.25 ->
6.25 req/s and back over 15 minutes (1 -> 3 replicas); ``agentic``
(``agentic_fleet_trace``): agent sessions of 3-5 turns on four shared contexts, each
turn after a 1-20 s tool call, 0.25 -> 2.5 sessions/s and back (1 -> 3 replicas).
Both sides route a request by crc32(session) over the Ready replicas in creation
order, and count a replica from the moment it is asked for until it is gone.

With ``--real-nodes`` the fleet is the two real nodes instead (kubelet, containerd,
runc): Spillway installed from its images and Helm chart, the operator in-cluster, the
engine pods real containers of the engine image (``e2e.install``, as ``make demo``).

    python -m bench.autoscale_replay [--trace bursty|agentic] [--seed 1] [--out replay.json]
    python -m bench.autoscale_replay --real-nodes --trace agentic --seed 1
    python -m bench.autoscale_replay --simulate-only       # the simulator side alone

About 25 minutes, most of it the trace in real time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "engine"))
sys.path.insert(0, str(ROOT / "operator"))

from bench.autoscale import SpillwayPolicy, run_policy, summarize  # noqa: E402
from bench.autoscale_traces import Agents, Scenario, Shape, agentic_items, make_trace  # noqa: E402
from spillway_cli.loadgen import percentile  # noqa: E402
from spillway_engine.emulator.latency import ModelCost, gpu_profile  # noqa: E402
from spillway_engine.emulator.tiny import qwen3_next_config  # noqa: E402
from spillway_engine.planner.plan import make_plan  # noqa: E402
from spillway_engine.simulator.core import LatencyModel, ReplayItem, SchedulerConfig  # noqa: E402
from spillway_operator.flow.spec import InferenceDeploymentSpec  # noqa: E402

NAME = "replay"
NAMESPACE = "gated-replay"  # gated: a pod turns Ready once its engine answers /health
MODEL = "tiny/qwen3-next"
TTFT_TARGET = 2.0
MAX_REPLICAS = 3
VOCAB = (3, 500)  # the tiny tokenizer's ids past its special tokens
#: The fleet's engines: the demo's tiny hybrid, steps timed as a 70B model on an H100
#: (a 52 ms weight read per step, 314 us per token of compute) so the engine's own CPU
#: time is a small part of each step and a replica serves about 2 req/s of the trace.
SPEED, MODEL_PARAMS = 1.0, 7e10
KV_BYTES = 1 << 20  # 128 blocks of 8 KiB: about eight 800-token requests
SPEC: dict[str, Any] = {
    "model": {"name": MODEL, "configMapRef": {"name": "replay-model"}},
    "replicas": 1,
    "engine": {"maxModelLen": 1024,
               "emulateGPU": {"speed": SPEED, "kvBytes": KV_BYTES, "modelParams": MODEL_PARAMS}},
    "offload": {"hostMemory": "4Mi"},
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": MAX_REPLICAS},
}


def _in_vocab(items: list[ReplayItem]) -> list[ReplayItem]:
    """Prompt ids into the tiny tokenizer's range (the mapping keeps shared prefixes
    shared)."""
    lo, hi = VOCAB
    return [replace(it, prompt=[lo + t % (hi - lo) for t in it.prompt]) for it in items]


def fleet_trace(seed: int, duration: float = 900.0) -> list[ReplayItem]:
    """The bursty trace's shape at a small CPU's scale."""
    shape = Shape(duration=duration, base_rate=1.25, burst_factor=5.0, prefixes=12,
                  prefix_tokens=512, question_tokens=64, base_users=4, turns=4,
                  system_tokens=256, user_tokens=64, reply_tokens=32, max_tokens=32)
    return _in_vocab(make_trace(shape, seed))


def agentic_fleet_trace(seed: int, duration: float = 900.0) -> list[ReplayItem]:
    """The agentic trace's shape at a small CPU's scale: sessions of 3-5 turns on one
    of 4 agents' 320-token contexts, each turn after a 1-20 s tool call appending its
    output, 0.25 -> 2.5 sessions per second and back; a session ends before its prompt
    outgrows the engine's 1,024-token context."""
    spec = Agents(duration=duration, low=0.25, high=2.5, start=0.17 * duration,
                  rise=0.2 * duration, hold=0.3 * duration, agents=4, system_tokens=320,
                  task_tokens=32, min_turns=3, max_turns=5, reply_tokens=24,
                  min_tool_tokens=16, max_tool_tokens=96, min_pause=1.0, max_pause=20.0,
                  reply_seconds=1.0)
    fits = [it for it in agentic_items(spec, seed) if len(it.prompt) + it.max_tokens <= 1024]
    return _in_vocab(fits)


#: The fleet traces: bursty's and agentic's shapes, scaled to two cores
FLEET_TRACES = {"bursty": fleet_trace, "agentic": agentic_fleet_trace}


def scenario_of(items: list[ReplayItem], plan_file: Path, load_delay: float,
                duration: float) -> Scenario:
    return Scenario("fleet", items, duration, plan_file, 0, load_delay,
                    (("all", 0.0, duration),))


def planned() -> tuple[dict[str, Any], Any]:
    """The tiny model's config and the plan the operator makes of SPEC."""
    config = qwen3_next_config(num_layers=4)
    plan = make_plan(config, InferenceDeploymentSpec.model_validate(SPEC).plan_request())
    return config, plan


def latency(overhead_s: float, weight_bytes: float | None = None) -> LatencyModel:
    """The emulated engines' steps: the roofline of MODEL_PARAMS whose weights weigh
    what the emulator counted (``weight_bytes``, from its log; bfloat16 when unknown)."""
    cost = ModelCost.of(MODEL_PARAMS)
    if weight_bytes:
        cost = ModelCost(MODEL_PARAMS, weight_bytes)
    return LatencyModel.emulating(gpu_profile("h100"), cost, SPEED, overhead_s)


def _weight_bytes(log: str) -> float | None:
    """The weight bytes the emulated worker times its steps by, as it logged them (the
    model's own bytes per parameter: a hybrid's float32 state parameters weigh in)."""
    m = re.search(r"weight_bytes=([0-9.e+]+)", log)
    return float(m.group(1)) if m else None


@dataclass
class Side:
    """What one side measured."""

    name: str
    replica_minutes: float
    ttfts: list[float | None]  # None: rejected or failed
    host_share: float
    max_replicas: int
    actions: int
    load_delay: float = 0.0
    gpu_share: float = 0.0  # prompt tokens from the GPU prefix cache
    preemptions: int = 0

    @property
    def met(self) -> float:
        ok = sum(1 for t in self.ttfts if t is not None and t <= TTFT_TARGET)
        return ok / max(1, len(self.ttfts))

    def row(self) -> str:
        got = [t for t in self.ttfts if t is not None]
        return (f"{self.name:16} {self.replica_minutes:>9.1f} {self.met:>9.2%} "
                f"{percentile(got, 50) or 0:>7.2f} {percentile(got, 95) or 0:>7.2f} "
                f"{self.gpu_share:>8.1%} {self.host_share:>9.1%} {self.preemptions:>7} "
                f"{self.max_replicas:>5} {self.actions:>7} {self.load_delay:>7.0f}")


HEADER = (f"{'':16} {'rep-min':>9} {'<= 2 s':>9} {'p50 s':>7} {'p95 s':>7} "
          f"{'gpu hit':>8} {'host hit':>9} {'preempt':>7} {'max':>5} {'actions':>7} "
          f"{'load s':>7}")


# ----------------------------------------------------------------------------- simulator


def simulate(items: list[ReplayItem], plan_json: str, *, duration: float, load_delay: float,
             overhead_s: float, scheduler: SchedulerConfig, seed: int,
             weight_bytes: float | None = None) -> Side:
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "spillway-replay"
    folder.mkdir(exist_ok=True)
    plan_file = folder / "plan.json"
    plan_file.write_text(plan_json)
    scenario = scenario_of(items, plan_file, load_delay, duration)
    policy = SpillwayPolicy(None, max_replicas=MAX_REPLICAS)
    # vLLM's shared block pool: the emulated budget over the largest group's block, less
    # block 0 (its null block)
    blocks = KV_BYTES // max(g["bytes_per_block"] for g in json.loads(plan_json)["kv_groups"])
    res = run_policy(policy, scenario, seed, gpu_blocks=blocks - 1,
                     latency=latency(overhead_s, weight_bytes), scheduler=scheduler)
    ttfts: list[float | None] = [r.ttft for r in res.requests]
    ttfts += [None] * (res.offered - len(res.requests))
    s = summarize(res, TTFT_TARGET)
    return Side("simulator", s["rm"], ttfts, res.host_hit_share, res.max_replicas,
                res.actions, load_delay, res.device_hit_share, res.preemptions)


# ----------------------------------------------------------------------------- the fleet


class PodClock:
    """The deployment's pods seen through the API once a second: which are Ready (in
    creation order, for routing), how many exist (replica-seconds), and each pod's
    creation -> first Ready (the model load time)."""

    def __init__(self, core: Any, namespace: str = NAMESPACE) -> None:
        self.core, self.namespace = core, namespace
        self.ready: list[str] = []  # pod IPs
        self.count = 0
        self.seconds = 0.0
        self.created: dict[str, float] = {}
        self.first_ready: dict[str, float] = {}
        self.timeline: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._counting = False
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PodClock:
        self._thread.start()
        return self

    def count_from(self, t0: float) -> None:
        self._last, self._counting, self.t0 = t0, True, t0

    def stop_counting(self) -> None:
        self._tick()
        self._counting = False

    def _tick(self) -> None:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"spillway.dev/inference-deployment={NAME}").items
        now, wall = time.monotonic(), time.time()
        if self._counting:
            self.seconds += self.count * (now - self._last)
        self._last = now
        ready = []
        for p in sorted(pods, key=lambda p: p.metadata.creation_timestamp):
            name = p.metadata.name
            # monotonic time of the pod's creation (the API's clock is this machine's)
            self.created.setdefault(
                name, now - (wall - p.metadata.creation_timestamp.timestamp()))
            ok = any(c.type == "Ready" and c.status == "True"
                     for c in (p.status.conditions or []))
            if ok and not p.metadata.deletion_timestamp and p.status.pod_ip:
                ready.append(p.status.pod_ip)
                self.first_ready.setdefault(name, now)
        self.ready, self.count = ready, len(pods)
        if self._counting:
            self.timeline.append((now - self.t0, len(ready), len(pods)))

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self._tick()
            self._stop.wait(1.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def load_times(self) -> list[float]:
        return [self.first_ready[p] - self.created[p] for p in self.first_ready]


async def _one(session: Any, url: str, item: ReplayItem, sent: float) -> float | None:
    body = {"model": MODEL, "prompt": list(item.prompt), "max_tokens": item.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            first = None
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic() - sent
            return first
    except Exception:  # a pod that went away mid-request: the request missed
        return None


async def play(items: list[ReplayItem], pods: PodClock, t0: float) -> list[float | None]:
    import aiohttp

    out: list[float | None] = [None] * len(items)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def send(i: int, item: ReplayItem) -> None:
            delay = t0 + item.arrival - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            ready = pods.ready
            if not ready:
                return
            ip = ready[zlib.crc32((item.session or "").encode()) % len(ready)]
            out[i] = await _one(session, f"http://{ip}:8000", item, t0 + item.arrival)

        await asyncio.gather(*(send(i, it) for i, it in enumerate(items)))
    return out


def calibrate(url: str, weight_bytes: float | None, n: int = 6, tokens: int = 48) -> float:
    """The engine's own CPU time per step: one request at a time, the mean time between
    its streamed tokens less the emulator's modelled decode step."""
    import urllib.request

    gaps: list[float] = []
    for i in range(n):
        body = json.dumps({"model": MODEL, "prompt": [VOCAB[0] + (7 * i + j) % 400
                                                      for j in range(64)],
                           "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                           "stream": True}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        stamps = []
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    stamps.append(time.monotonic())
        gaps += [b - a for a, b in itertools.pairwise(stamps[1:])]
    step = statistics.median(gaps)
    return max(0.0, step - latency(0.0, weight_bytes).memory_floor_s)


def _scheduler(log: str, max_model_len: int) -> SchedulerConfig:
    """The engine's scheduler limits, as vLLM logged them."""
    tokens = re.search(r"max_num_batched_tokens=(\d+)", log)
    seqs = re.search(r"max_num_seqs=(\d+)", log)
    return SchedulerConfig(max_num_seqs=int(seqs.group(1)) if seqs else 256,
                           max_num_batched_tokens=int(tokens.group(1)) if tokens else 8192,
                           max_model_len=max_model_len)


@dataclass
class FleetHandle:
    """What the measurement reads of a running fleet, wherever its engines run."""

    name: str  # the side's name in the table
    core: Any
    custom: Any
    engine_log: Any  # pod name -> the engine's log
    urls: Any  # () -> the serving engines' base URLs
    decisions: Any  # () -> the operator's scaling decisions


@contextlib.contextmanager
def kwok_fleet(workdir: Path) -> Iterator[FleetHandle]:
    """The local control plane with KWOK nodes, the operator as a process and on each
    pod's IP the pod's own engine command as a host process (``e2e.simfleet``)."""
    from kubernetes import client, config

    from e2e.cluster.controlplane import (
        REPO_ROOT,
        ClusterConfig,
        LocalCluster,
        Ports,
        free_pod_net,
        locate_binaries,
    )
    from e2e.operator_process import start_operator
    from e2e.simfleet import SimulatorFleet

    cluster = LocalCluster(ClusterConfig(workdir=workdir, ports=Ports.from_base(17480),
                                         nodes=2, pod_net=free_pod_net()))
    cluster.config.binaries = locate_binaries()
    shutil.rmtree(workdir / "etcd", ignore_errors=True)
    operator = fleet = None
    try:
        say("starting the local control plane with KWOK nodes ...")
        cluster.start()
        cluster.kubectl("apply", "--server-side", "-f", REPO_ROOT / "crds")
        cluster.wait_established("inferencedeployments.spillway.dev")
        operator = start_operator(cluster.config.kubeconfig, workdir / "operator.log")
        api = config.new_client_from_config(config_file=str(cluster.config.kubeconfig))
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        model_dir = _apply(core, custom, workdir, SPEC)
        fleet = SimulatorFleet(api, NAMESPACE, NAME, engine="emulated",
                               model_dirs={MODEL: model_dir}).__enter__()
        yield FleetHandle("emulated fleet", core, custom, fleet.log_text, fleet.urls,
                          lambda: _decisions((workdir / "operator.log").read_text()))
    finally:
        if fleet is not None:
            fleet.__exit__(None, None, None)
        if operator is not None:
            operator.stop()
        cluster.stop()


@contextlib.contextmanager
def real_fleet(workdir: Path) -> Iterator[FleetHandle]:
    """Two real nodes (kubelet, containerd, runc, a fake-GPU device plugin), Spillway
    installed from its images and Helm chart (the operator in-cluster, with leader
    election), and the engine pods as real containers of the engine image."""
    from kubernetes import client, config

    from e2e import install
    from e2e.cluster.controlplane import ClusterConfig, LocalCluster, Ports, locate_binaries
    from e2e.demo import RealPods
    from e2e.nodes.tier import tier_session

    with tier_session():
        cluster = LocalCluster(ClusterConfig(workdir=workdir, ports=Ports.free(), nodes=0,
                                             real_nodes=2,
                                             binaries=locate_binaries(real_nodes=True)))
        try:
            cluster.stop()
            shutil.rmtree(workdir, ignore_errors=True)  # etcd's folder would bring back pods
            say(f"control plane + 2 real nodes up in {cluster.start():.1f}s")
            refs = install.image_refs()
            t0 = time.monotonic()
            say(f"images into the nodes: {install.load_images(refs)} "
                f"({time.monotonic() - t0:.0f}s)")
            cluster.kubectl("create", "namespace", NAMESPACE, check=False)
            install.helm_install(cluster, refs["operator"], NAMESPACE)
            api = config.new_client_from_config(config_file=str(cluster.config.kubeconfig))
            core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
            spec = install.on_real_nodes({"spec": SPEC}, refs["engine"], "models")["spec"]
            model_dir = _apply(core, custom, workdir, spec, create_namespace=False)
            install.model_volume(cluster, NAMESPACE, "models", model_dir)
            pods = RealPods(core, NAME, NAMESPACE)
            yield FleetHandle("real nodes", core, custom, pods.log_text, pods.urls,
                              lambda: _operator_pod_decisions(core))
        finally:
            cluster.stop()


def _operator_pod_decisions(core: Any) -> list[str]:
    """The scaling decisions in the chart's operator pods' logs (the leader's)."""
    from kubernetes import client

    from e2e.install import RELEASE_NAMESPACE

    out = []
    for p in core.list_namespaced_pod(
            RELEASE_NAMESPACE, label_selector="app.kubernetes.io/component=operator").items:
        with contextlib.suppress(client.ApiException):
            out += _decisions(core.read_namespaced_pod_log(p.metadata.name, RELEASE_NAMESPACE))
    return out


def _apply(core: Any, custom: Any, workdir: Path, spec: dict[str, Any],
           create_namespace: bool = True) -> Path:
    """The tiny model (on disk and as the spec's ConfigMap) and the InferenceDeployment."""
    from kubernetes import client

    from spillway_engine.emulator.tiny import write_model
    from spillway_operator.flow.spec import GROUP, PLURAL, VERSION

    if create_namespace:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    model_config, _ = planned()
    model_dir = write_model(workdir / "models" / "tiny-qwen3-next", model_config)
    core.create_namespaced_config_map(NAMESPACE, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="replay-model"),
        data={"config.json": json.dumps(model_config)}))
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
        "metadata": {"name": NAME}, "spec": spec})
    return model_dir


def measure(fleet: FleetHandle, items: list[ReplayItem], duration: float
            ) -> tuple[Side, dict]:  # fmt: skip
    """Wait for the first engine, time its CPU per step, replay the trace in real time
    and read back what the fleet did."""
    from spillway_operator.flow.spec import GROUP, PLURAL, VERSION

    core, custom = fleet.core, fleet.custom
    pods = PodClock(core).start()
    try:
        deadline = time.monotonic() + 900
        while not pods.ready:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine served in 900 s: "
                                   f"{[fleet.engine_log(p)[-2000:] for p in pods.created]}")
            time.sleep(1)
        plan_json = core.read_namespaced_config_map(f"{NAME}-plan", NAMESPACE).data["plan.json"]
        first = next(iter(pods.first_ready))
        log = fleet.engine_log(first)
        weights = _weight_bytes(log)
        overhead = calibrate(f"http://{pods.ready[0]}:8000", weights)
        say(f"first engine ready; its CPU time per step {overhead * 1e3:.1f} ms beyond the "
            f"modelled {latency(0.0, weights).memory_floor_s * 1e3:.1f} ms decode step "
            f"({weights or 0:.3g} weight bytes)")
        t0 = time.monotonic() + 2.0
        pods.count_from(t0)
        say(f"replaying {len(items)} requests over {duration:.0f} s ...")
        reporter = threading.Thread(target=_report, args=(custom, pods, t0, duration),
                                    daemon=True)
        reporter.start()
        ttfts = asyncio.run(play(items, pods, t0))
        rest = t0 + duration - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        pods.stop_counting()
        tokens = _pod_counters(fleet.urls())
        prompt = max(1.0, tokens["vllm:prompt_tokens_total"])
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        loads = pods.load_times()
        decisions = fleet.decisions()
        side = Side(fleet.name, pods.seconds / 60.0, ttfts,
                    tokens["spillway_host_hit_tokens_total"] / prompt,
                    max(c for _, _, c in pods.timeline), len(decisions),
                    statistics.median(loads), tokens["vllm:prefix_cache_hits_total"] / prompt,
                    int(tokens["vllm:num_preemptions_total"]))
        extra = {"plan": plan_json, "overhead_s": overhead, "weight_bytes": weights,
                 "load_times": loads, "scheduler": _scheduler(log, 1024),
                 "timeline": pods.timeline, "decisions": decisions,
                 "status": obj.get("status", {}).get("autoscaling")}
        return side, extra
    finally:
        pods.close()


def _report(custom: Any, pods: PodClock, t0: float, duration: float) -> None:
    from spillway_operator.flow.spec import GROUP, PLURAL, VERSION

    while time.monotonic() < t0 + duration:
        with contextlib.suppress(Exception):
            a = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL,
                                                    NAME).get("status", {}).get("autoscaling", {})
            say(f"t={time.monotonic() - t0:5.0f}s ready {len(pods.ready)} pods {pods.count} | "
                f"pressure {a.get('pressure', '-')} {a.get('components', {})} | "
                f"{a.get('lastDecision')}: {a.get('lastDecisionReason', '')}")
        time.sleep(30)


#: What the fleet's side reads of its pods: prompt tokens, those from the host pool and
#: from the GPU prefix cache, and preemptions
POD_COUNTERS = ("vllm:prompt_tokens_total", "spillway_host_hit_tokens_total",
                "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total")


def _pod_counters(urls: list[str]) -> dict[str, float]:
    """POD_COUNTERS summed over the pods still serving (their /metrics)."""
    import urllib.request

    out = dict.fromkeys(POD_COUNTERS, 0.0)
    for url in urls:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            for k, v in _counters(r.read().decode()).items():
                out[k] += v
    return out


def _counters(text: str) -> dict[str, float]:
    """POD_COUNTERS in one exposition (summed over their labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(POD_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def _decisions(log: str) -> list[str]:
    """The operator's scaling decisions, from its log (text lines as a process writes
    them, or JSON lines with a ``message`` as its pod does)."""
    out = []
    for line in log.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError, AttributeError):
                line = str(json.loads(line).get("message", ""))
        if re.search(r"replay: replicas \d+ -> \d+", line):
            out.append(line.split("replay: ", 1)[-1])
    return out


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trace", choices=sorted(FLEET_TRACES), default="bursty")
    ap.add_argument("--real-nodes", action="store_true",
                    help="the fleet on two real nodes: Spillway's images and chart, the "
                    "engine pods as real containers (default: KWOK nodes, host processes)")
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--simulate-only", action="store_true",
                    help="the simulator side alone, with --load-delay and --overhead-ms")
    ap.add_argument("--load-delay", type=float, default=45.0)
    ap.add_argument("--overhead-ms", type=float, default=5.0)
    ap.add_argument("--out", type=Path, help="write both sides' figures here (JSON)")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    items = FLEET_TRACES[args.trace](args.seed, args.duration)
    _, plan = planned()
    if args.simulate_only:
        sim = simulate(items, plan.model_dump_json(), duration=args.duration,
                       load_delay=args.load_delay, overhead_s=args.overhead_ms / 1e3,
                       scheduler=SchedulerConfig(max_model_len=1024), seed=args.seed)
        print(HEADER)
        print(sim.row())
        return 0
    workdir = args.workdir or Path("/tmp/spillway-replay" + ("-real" if args.real_nodes else ""))
    # SIGTERM (a kill, a timeout) unwinds like ^C: the fleets' finally blocks stop the
    # cluster, the operator and the engines instead of leaving them running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with (real_fleet if args.real_nodes else kwok_fleet)(workdir) as handle:
        fleet, extra = measure(handle, items, args.duration)
    sim = simulate(items, extra["plan"], duration=args.duration, load_delay=fleet.load_delay,
                   overhead_s=extra["overhead_s"], scheduler=extra["scheduler"],
                   seed=args.seed, weight_bytes=extra["weight_bytes"])
    print(f"\n{args.trace} trace, seed {args.seed}: {len(items)} requests, "
          f"{args.duration:.0f} s, TTFT target {TTFT_TARGET:g} s; "
          f"engine CPU per step {extra['overhead_s'] * 1e3:.1f} ms; scheduler "
          f"{extra['scheduler']}; pod load times {[round(x) for x in extra['load_times']]}")
    print(HEADER)
    print(fleet.row())
    print(sim.row())
    d_rm = sim.replica_minutes / fleet.replica_minutes - 1.0
    d_met = sim.met / max(1e-9, fleet.met) - 1.0
    print(f"{'difference':16} {d_rm:>+9.1%} {d_met:>+9.1%}")
    print("operator decisions:", *extra["decisions"], sep="\n  ")
    if args.out:
        args.out.write_text(json.dumps({
            "fleet": fleet.__dict__, "simulator": sim.__dict__,
            **{k: v for k, v in extra.items() if k not in ("plan", "scheduler")},
            "scheduler": extra["scheduler"].__dict__}, default=str, indent=1))
    return 0 if abs(d_rm) <= 0.10 and abs(d_met) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
