"""Routing policies on one shared-prefix + multi-turn chat trace, in virtual time.

Replays the same seeded trace against 1, 2, 4 and 8 simulated vLLM replicas
(``spillway_engine.simulator``: the real scheduler, GPU prefix cache and host tier
model, one virtual clock) under each routing policy, and prints one row per policy
and replica count: prompt tokens served from the GPU cache and from the host tier
(shares of all prompt tokens), TTFT p50/p95 (modelled), load imbalance (max over
replicas of the time-averaged in-flight requests, divided by their mean), and the
router's own decision time (hashing the prompt, index lookup, scoring; p99, one core;
for spillway-events without the index lookup, which the bench stands in for).

    python bench/routing.py [--seed N] [--duration S] [--quick] [--autoscale-duration S]
    python bench/routing.py --overhead
    python bench/routing.py --gateway [--quick] [--gateway-replicas N] [--gateway-speed X]

The workload scales with the replicas (rate, chat users and shared prefixes are per
replica), so every row asks the same of each replica: a router that keeps prefixes
where they are cached keeps the 1-replica hit share as replicas are added.

Policies (the deciding code is spillway_router's, unchanged):

spillway-events
    ``scoring.choose`` over each replica's cached prefix as its KV events describe it:
    read from the simulated replica's GPU prefix cache and host pool at the moment of
    routing (an event stream without lag), split into GPU and host hits; load =
    running + waiting requests; cold prompts by consistent hashing (session key) with
    bounded load 1.25.
spillway-approx
    the same scoring over ``index.ApproxTracker``: where the router itself sent each
    block, as a GPU LRU spilling into a host LRU, each bounded by the replica's
    planned capacity in tokens (GPU KV tokens, the plan's host capacity_tokens).
round-robin
    what a Kubernetes Service does.
session-chwbl
    consistent hashing of the session with bounded load 1.25 (KubeAI's policy).
approx-no-capacity
    the approximate index without capacity knowledge: it never forgets a block, so it
    keeps sending prefixes to replicas that evicted them long ago.

``--overhead`` measures the HTTP proxy instead: ``spillway-router`` pinned to one core
(taskset) in front of one simulator (speed 1000, so the engine's modelled time is
negligible); sequential requests direct and through the router (the added latency
is the difference of the percentiles), then requests per second through the router
with 64 concurrent clients (``max_tokens`` 1, 2,048-token prompts, so each request
is hashed).

``--gateway`` measures the Gateway API Inference Extension's path, Envoy asking
Spillway's endpoint picker (``spillway-router --epp-port``, ext_proc), beside the
proxy and a gateway without a picker. The trace above for 2 replicas
(``--gateway-replicas``; ``--duration``, 300 virtual s; ``--quick``: 60) is replayed in
real time, compressed ``--gateway-speed`` (5) times, as streaming completions (token-id
prompts; the conversation or shared prefix in OpenAI's ``user`` field, which the router
sticks cold prompts by, as the policies above do), against simulator processes (its
HTTP server at the same speed; 8,192 GPU KV and 16,384 host-tier tokens each) through
three paths: ``gateway + Spillway EPP``, a real Envoy (``e2e.gateway``, failing open, so
with a buffered body) that asks the picker and sends to the pod it names;
``spillway-router``, the HTTP proxy; ``gateway, round robin``, the same Envoy without
the picker (``GatewayConfig(picker=None)``). Each path starts on fresh engine processes
(restarted on the same ports: cold caches) and a fresh router, ``--mode approx`` (the
simulator publishes no KV events), given a plan whose ``max_model_len`` is the engines'
GPU KV size (the simulator exports no ``vllm:cache_config_info``, so the router takes a
pod's GPU capacity from there). One row per path: prompt tokens served from the GPU
cache and from the host tier, as shares of all prompt tokens, from the engines' own
/metrics (``vllm:prefix_cache_hits`` and ``spillway_host_hit_tokens`` over
``vllm:prefix_cache_queries``, summed over the engines), each engine's share of them
(split), TTFT p50/p95 as the client sees it (wall clock to the first SSE data chunk),
the engines' own modelled TTFT p50 (model: speed-independent), and the latency the path
adds to a request, p50 and p99, measured as ``--overhead`` does it (sequential requests,
fresh 2,048-token prompts, ``max_tokens`` 1, direct to an engine and through each path,
interleaved, engines at speed 1000; the difference of the percentiles). Then requests
per second through each path with 64 concurrent clients, spillway-router (proxy and
picker are one process) pinned to one core (taskset) and Envoy, the engines and the
client on the other, with each one's CPU (share of one core); ``gateway + EPP, duplex``
is the picker behind Envoy in GIE's own body mode (FULL_DUPLEX_STREAMED, failing
closed). About 4 minutes; ``--quick`` about 1.

Under the autoscaler (the second table): each policy again, on a trace whose load
rises and falls (``AUTOSCALE_PHASES``: the per-replica workload above for 2, then 6,
then 2 replicas, for 20 %, 30 % and 50 % of ``--autoscale-duration`` virtual s, 1,800 by
default, so the scale-down after the burst shows; ``--quick``: 600 s, too short for
any scale-down, a smoke test), starting from
one ready replica, with the replica count set by the operator's own decision code as
``scaler.Autoscaler.tick`` runs it and bench/autoscale drives it (``parse_metrics`` ->
``pod_pressure`` -> ``aggregate`` -> ``decide``, the CRD's defaults: target 1.0,
tolerance 0.1, scale-down window 300 s, one decision per 15 s; 1..8 replicas; a new
replica serves 120 s after it is asked for). A scale-down removes the replicas the
operator marks (``pressure.choose_removals`` on ``hot_host_tokens``: the least hot
host cache; starting replicas first), whatever the routing policy, and a marked replica
takes no new requests and leaves once drained. Replica-minutes integrate the replicas
holding a GPU (starting, ready, draining) over the run; the other columns are as above.
A policy that keeps prefixes where they are cached needs less GPU time for the same
work, and that is what the autoscaler turns into fewer replicas.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine"))
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT))  # bench.autoscale

from bench.autoscale import (  # noqa: E402
    INTERVAL,
    LOAD_DELAY,
    SCALE_DOWN_WINDOW,
    TOLERANCE,
    DelayedCluster,
)
from spillway_cli.loadgen import TraceSpec, generate_trace, percentile, to_replay_items  # noqa: E402
from spillway_engine.planner.plan import read_plan  # noqa: E402
from spillway_engine.simulator.cluster import Replica, VirtualCluster  # noqa: E402
from spillway_engine.simulator.core import LatencyModel, ReplayItem, _group_salt  # noqa: E402
from spillway_engine.simulator.plan_input import gpu_blocks_for_tokens, parse_plan  # noqa: E402
from spillway_operator.flow.pressure import (  # noqa: E402
    Candidate,
    State,
    aggregate,
    choose_removals,
    decide,
    hot_host_tokens,
    parse_metrics,
    pod_pressure,
)
from spillway_operator.flow.pressure import Policy as ScalePolicy  # noqa: E402
from spillway_router.backends import profile_from_plan  # noqa: E402
from spillway_router.hashing import BlockHasher, HashConfig  # noqa: E402
from spillway_router.index import ApproxTracker, Match, PrefixIndex  # noqa: E402
from spillway_router.scoring import CostModel, PodState, Ring, choose, cold_key  # noqa: E402

PLAN_FILE = ROOT / "tests" / "fixtures" / "plans" / "llama-3.2-1b-upstream.json"
GPU_KV_TOKENS = 8192
HOST_CHUNKS = 64  # 64 x 256 = 16,384 host tokens per replica: the host tier matters
REPLICAS = (1, 2, 4, 8)
POLICIES = (
    "spillway-events",
    "spillway-approx",
    "round-robin",
    "session-chwbl",
    "approx-no-capacity",
)
NEVER = 10**12


def load_plan():
    data = json.loads(PLAN_FILE.read_text())
    tpc = data["kv_groups"][0]["tokens_per_block"] * data["blocks_per_chunk"]
    data.update(num_chunks=HOST_CHUNKS, capacity_tokens=HOST_CHUNKS * tpc)
    plan = read_plan(json.dumps(data), PLAN_FILE.name)
    return plan, parse_plan(plan)


def trace(n: int, duration: float, seed: int) -> list[ReplayItem]:
    """Per replica: 1.5 chat req/s over 12 users, 1 shared-prefix req/s over 3 prefixes."""
    chat = TraceSpec(kind="chat", rate=1.5 * n, duration=duration, seed=seed, users=12 * n,
                     turns=8, system_tokens=512, user_tokens=96, reply_tokens=96,
                     max_tokens=64)  # fmt: skip
    shared = TraceSpec(kind="shared-prefix", rate=1.0 * n, duration=duration, seed=seed + 1,
                       prefixes=3 * n, prefix_tokens=2048, question_tokens=64,
                       max_tokens=32)  # fmt: skip
    items = to_replay_items(generate_trace(chat)) + [
        replace(it, rid=f"s{it.rid}", session=f"p-{it.session}")
        for it in to_replay_items(generate_trace(shared))
    ]
    return sorted(items, key=lambda it: it.arrival)


class Policy:
    def __init__(self, name: str, plan, sim_plan, latency: LatencyModel) -> None:
        self.name = name
        prof = profile_from_plan(plan)
        self.unit = prof.tokens_per_hash
        self.hasher = BlockHasher(HashConfig(self.unit))
        self.cost = CostModel(
            tokens_per_hash=self.unit,
            host_bytes_per_token=prof.host_bytes_per_token,
            host_bandwidth=latency.pcie_bytes_per_s,
            prefill_s_per_token=latency.prefill_s_per_token,
        )
        if name == "spillway-approx":
            self.gpu_units = GPU_KV_TOKENS // self.unit
            self.host_units = prof.host_capacity_tokens // self.unit
        else:  # approx-no-capacity: the same tracker, never full
            self.gpu_units = self.host_units = NEVER
        self.tracker = ApproxTracker(PrefixIndex())
        self.known: set[str] = set()
        self.rr = 0
        self.ring: Ring | None = None
        self.decisions: list[float] = []
        self.sim_plan = sim_plan

    def pick(self, item: ReplayItem, serving: list[Replica]) -> Replica:
        if self.name == "round-robin":
            self.rr += 1
            return serving[self.rr % len(serving)]
        by_name = {r.name: r for r in serving}
        view = {}
        if self.name == "spillway-events":  # stands for the event-fed index: not timed
            view = {r.name: cache_view(r, item.prompt) for r in serving}
        t0 = time.process_time()  # CPU time: what the decision costs one core
        states = [
            PodState(r.name, self.cost, load=r.core.num_running + r.core.num_waiting)
            for r in serving
        ]
        if self.ring is None or self.ring.members != frozenset(by_name):
            self.ring = Ring(list(by_name))
        ring = self.ring
        keys: list[int] = []
        matches: dict[str, Match] = view
        if self.name != "session-chwbl":
            keys = self.hasher.keys(list(item.prompt))
        if self.name in ("spillway-approx", "approx-no-capacity"):
            for r in serving:
                if r.name not in self.known:
                    self.tracker.set_capacity(r.name, self.gpu_units, self.host_units)
                    self.known.add(r.name)
            matches = self.tracker.index.match(keys, by_name)
        d = choose(states, len(item.prompt), matches, ring, cold_key(keys, [], item.session))
        if self.name in ("spillway-approx", "approx-no-capacity"):
            self.tracker.record(d.pod, keys)
        self.decisions.append(time.process_time() - t0)
        return by_name[d.pod]


def cache_view(replica: Replica, prompt) -> Match:
    """What a replica's KV events would say it holds of ``prompt``: the leading blocks
    in its GPU prefix cache, then the leading chunks in its host pool (in hash units)."""
    core = replica.core
    hashes = core._hash_prompt(prompt)
    g = core.groups[core.token_group]
    hpb, salt = g.hashes_per_block, _group_salt(g.index)
    bkeys = [h ^ salt for h in hashes[hpb - 1 :: hpb]]
    n = 0
    for key in bkeys:
        if key not in core.gpu.cached:
            break
        n += 1
    bpc = g.blocks_per_chunk
    pool = core.pools[core.pool_of[g.index]].keys
    m = 0
    for key in bkeys[bpc - 1 :: bpc]:
        if key not in pool:
            break
        m += 1
    gpu = n * hpb
    return Match(gpu, max(0, m * bpc * hpb - gpu))


class RoutedCluster(VirtualCluster):
    def __init__(self, policy: Policy, **kw) -> None:
        self.policy = policy
        self.inflight_sum: dict[str, float] = {}
        super().__init__(**kw)

    def route(self, item: ReplayItem) -> Replica:
        serving = self.serving
        for r in serving:  # sampled at arrivals (Poisson: a time average)
            self.inflight_sum[r.name] = (
                self.inflight_sum.get(r.name, 0.0) + r.core.num_running + r.core.num_waiting
            )
        return self.policy.pick(item, serving)


@dataclass
class Row:
    policy: str
    replicas: int
    requests: int
    gpu_share: float
    host_share: float
    p50: float
    p95: float
    imbalance: float
    decide_p99_us: float


def run(policy_name: str, n: int, plan, sim_plan, items: list[ReplayItem], seed: int) -> Row:
    latency = LatencyModel()
    policy = Policy(policy_name, plan, sim_plan, latency)
    cluster = RoutedCluster(
        policy,
        plan=sim_plan,
        replicas=n,
        gpu_blocks=gpu_blocks_for_tokens(sim_plan, GPU_KV_TOKENS),
        latency=latency,
        seed=seed,
    )
    done = cluster.replay(items)
    prompt = sum(r.prompt_len for r in done) or 1
    ttfts = [r.ttft for r in done if r.ttft is not None]
    loads = list(cluster.inflight_sum.values())
    mean = sum(loads) / len(loads) if loads else 0.0
    return Row(
        policy_name,
        n,
        len(done),
        sum(r.local_hit for r in done) / prompt,
        sum(r.external_hit for r in done) / prompt,
        percentile(ttfts, 50) or 0.0,
        percentile(ttfts, 95) or 0.0,
        max(loads) / mean if mean else 1.0,
        (percentile(policy.decisions, 99) or 0.0) * 1e6,
    )


# ----------------------------------------------------------------- under the autoscaler

# (share of the run, load in replicas' worth of the per-replica workload)
AUTOSCALE_PHASES = ((0.2, 2), (0.3, 6), (0.5, 2))
MAX_REPLICAS = 8


def burst_trace(duration: float, seed: int) -> list[ReplayItem]:
    """``trace`` at 2, then 6, then 2 replicas' worth, back to back; the same seed, so
    chat users and shared prefixes carry on across the phases."""
    items: list[ReplayItem] = []
    start = 0.0
    for k, (share, n) in enumerate(AUTOSCALE_PHASES):
        seg = share * duration
        for it in trace(n, seg, seed):
            items.append(replace(it, arrival=it.arrival + start, rid=f"{k}-{it.rid}"))
        start += seg
    return sorted(items, key=lambda it: it.arrival)


class AutoscaledCluster(DelayedCluster):
    """Replicas that load before they serve (bench/autoscale), routed by a policy."""

    def __init__(self, policy: Policy, plan, **kw) -> None:
        self.policy = policy
        super().__init__(plan, **kw)

    def route(self, item: ReplayItem) -> Replica:
        return self.policy.pick(item, self.serving)


class Scaler:
    """The operator's autoscaler, as ``scaler.Autoscaler.tick`` runs it, with its
    scale-down marks: the replicas it marks are the ones that go."""

    def __init__(self) -> None:
        self.policy = ScalePolicy(min_replicas=1, max_replicas=MAX_REPLICAS, target=1.0,
                                  tolerance=TOLERANCE, scale_up_window=0.0,
                                  scale_down_window=SCALE_DOWN_WINDOW)  # fmt: skip
        self.tau = max(SCALE_DOWN_WINDOW, 4 * INTERVAL)  # as the operator's
        self.samples: dict = {}
        self.hot: dict[str, float] = {}
        self.state = State()
        self.actions = 0

    def tick(self, now: float, cluster: AutoscaledCluster) -> None:
        cur, pods = {}, []
        for r in cluster.serving:
            sample = parse_metrics(cluster.scrape_lean(r), now)
            prev = self.samples.get(r.name)
            pods.append(pod_pressure(prev, sample, 3 * INTERVAL + 3.0))
            self.hot[r.name] = hot_host_tokens(self.hot.get(r.name, 0.0), prev, sample, self.tau)
            cur[r.name] = sample
        self.samples = cur
        current = cluster.desired
        d = decide(self.policy, now, current, len(cluster.serving), len(cluster.starting),
                   aggregate(pods), self.state)  # fmt: skip
        self.state = d.state
        if d.replicas == current:
            return
        self.actions += 1
        if d.replicas > current:
            cluster.request(d.replicas)
            return
        remove = current - d.replicas
        ready = [Candidate(r.name, True, self.hot.get(r.name, 0.0),
                           cur[r.name].values.get("host_tokens", 0.0),
                           created=f"{int(r.name.rsplit('-', 1)[1]):08d}")
                 for r in cluster.serving]  # fmt: skip
        starting = [Candidate(f"starting-{i}", False) for i in range(len(cluster.starting))]
        marked = set(choose_removals(ready + starting, remove))
        # unready pods go first (the ReplicaSet controller's order), then the marked ones
        cancel = min(remove, len(cluster.starting))
        cluster.starting = sorted(cluster.starting)[: len(cluster.starting) - cancel]
        for r in cluster.serving:
            if r.name in marked:
                r.draining = True
        cluster._reap()


@dataclass
class ScaledRow:
    policy: str
    requests: int
    replica_minutes: float
    gpu_share: float
    host_share: float
    p50: float
    p95: float
    max_replicas: int
    actions: int


def run_autoscaled(policy_name: str, plan, sim_plan, items: list[ReplayItem], seed: int,
                   duration: float) -> ScaledRow:  # fmt: skip
    latency = LatencyModel()
    policy = Policy(policy_name, plan, sim_plan, latency)
    cluster = AutoscaledCluster(
        policy,
        sim_plan,
        load_delay=LOAD_DELAY,
        replicas=1,
        gpu_blocks=gpu_blocks_for_tokens(sim_plan, GPU_KV_TOKENS),
        latency=latency,
        seed=seed,
    )
    scaler = Scaler()
    acc = {"t": 0.0, "rs": 0.0, "n": cluster.occupied(), "max": cluster.desired}

    def account(t: float) -> None:
        t = min(t, duration)
        if t > acc["t"]:
            acc["rs"] += acc["n"] * (t - acc["t"])
            acc["t"] = t
        acc["n"] = cluster.occupied()
        acc["max"] = max(acc["max"], cluster.desired)

    next_tick = INTERVAL

    def events_until(t: float) -> None:
        nonlocal next_tick
        while True:
            ready_at = cluster.next_ready()
            nxt = min(next_tick, ready_at if ready_at is not None else float("inf"))
            if nxt > t or nxt > duration:
                return
            cluster.run_until(nxt)
            account(nxt)
            if ready_at is not None and ready_at <= nxt:
                cluster.promote(nxt)
            else:
                scaler.tick(nxt, cluster)
                next_tick += INTERVAL
            account(nxt)

    done = []
    for item in items:
        events_until(item.arrival)
        req = cluster.submit(item)
        account(item.arrival)
        if req is not None:
            done.append(req)
    events_until(duration)
    cluster.run_until(duration)
    account(duration)
    cluster.drain()
    prompt = sum(r.prompt_len for r in done) or 1
    ttfts = [r.ttft for r in done if r.ttft is not None]
    return ScaledRow(
        policy_name,
        len(items),
        acc["rs"] / 60.0,
        sum(r.local_hit for r in done) / prompt,
        sum(r.external_hit for r in done) / prompt,
        percentile(ttfts, 50) or 0.0,
        percentile(ttfts, 95) or 0.0,
        acc["max"],
        scaler.actions,
    )


def autoscaled_table(plan, sim_plan, duration: float, seed: int) -> None:
    items = burst_trace(duration, seed)
    phases = ", ".join(f"{share * duration:.0f} s at {n}" for share, n in AUTOSCALE_PHASES)
    print(f"\nunder the autoscaler (1..{MAX_REPLICAS} replicas, CRD defaults, "
          f"{LOAD_DELAY:.0f} s load): {len(items)} requests, load in replicas' worth: "
          f"{phases}")  # fmt: skip
    head = (f"{'policy':<20} {'replica-min':>11} {'GPU hit':>8} {'host hit':>8} "
            f"{'TTFT p50':>9} {'TTFT p95':>9} {'max N':>5} {'actions':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name in POLICIES:
        t0 = time.perf_counter()
        row = run_autoscaled(name, plan, sim_plan, items, seed, duration)
        print(f"{row.policy:<20} {row.replica_minutes:>11.1f} {row.gpu_share:>8.1%} "
              f"{row.host_share:>8.1%} {row.p50 * 1e3:>7.0f}ms {row.p95 * 1e3:>7.0f}ms "
              f"{row.max_replicas:>5} {row.actions:>7}"
              f"   ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _overhead(direct: str, routed: str, n: int, seconds: float) -> dict[str, float]:
    import asyncio
    import random

    import aiohttp

    rng = random.Random(0)

    def body() -> dict:
        return {"model": "m", "prompt": [rng.randrange(16, 32000) for _ in range(2048)],
                "max_tokens": 1}  # fmt: skip

    async with aiohttp.ClientSession() as http:

        async def one(url: str) -> float:
            t0 = time.perf_counter()
            async with http.post(url + "/v1/completions", json=body()) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}")
            return time.perf_counter() - t0

        for _ in range(200):  # both up
            try:
                await one(routed)
                break
            except (aiohttp.ClientError, RuntimeError):
                await asyncio.sleep(0.1)
        lat = {"direct": [], "routed": []}
        for _ in range(n):
            lat["direct"].append(await one(direct))
            lat["routed"].append(await one(routed))
        out: dict[str, float] = {}
        for name, url in (("direct_rps", direct), ("rps", routed)):
            done = 0
            stop = time.perf_counter() + seconds

            async def client(url: str = url, stop: float = stop) -> None:
                nonlocal done
                while time.perf_counter() < stop:
                    await one(url)
                    done += 1

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(64)))
            out[name] = done / (time.perf_counter() - t0)
    out["direct_p50"] = percentile(lat["direct"], 50) or 0
    for q in (50, 99):
        out[f"p{q}"] = (percentile(lat["routed"], q) or 0) - (percentile(lat["direct"], q) or 0)
    return out


def overhead() -> int:
    import asyncio
    import shutil
    import subprocess
    import tempfile

    plan, _ = load_plan()
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(plan.model_dump_json())
        sport, rport = _free_port(), _free_port()
        env = {**__import__("os").environ, "PYTHONPATH": f"{ROOT / 'engine'}:{ROOT / 'operator'}"}
        sim = subprocess.Popen(
            [sys.executable, "-m", "spillway_engine.simulator", "--plan", str(plan_path),
             "--port", str(sport), "--speed", "1000", "--served-model-name", "m"],
            env=env, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
        router = subprocess.Popen(
            [*pin, sys.executable, "-m", "spillway_router.main", "--host", "127.0.0.1",
             "--port", str(rport), "--log-level", "WARNING", "--backend",
             f"model=m,url=http://127.0.0.1:{sport},plan={plan_path}"],
            env=env,
        )  # fmt: skip
        try:
            got = asyncio.run(
                _overhead(f"http://127.0.0.1:{sport}", f"http://127.0.0.1:{rport}", 500, 10.0)
            )
        finally:
            for proc in (router, sim):
                proc.terminate()
                proc.wait(timeout=30)
    print(f"router overhead ({'one core' if pin else 'unpinned'}): added latency "
          f"p50 {got['p50'] * 1e3:.2f} ms, p99 {got['p99'] * 1e3:.2f} ms; "
          f"{got['rps']:.0f} requests/s through the router, {got['direct_rps']:.0f} direct "
          f"(64 clients, 2,048-token prompts; direct p50 "
          f"{got['direct_p50'] * 1e3:.1f} ms)")  # fmt: skip
    return 0


# ------------------------------------------------------------------------- --gateway

GATEWAY_PATHS = ("gateway + Spillway EPP", "spillway-router", "gateway, round robin")
EPP, PROXY, ROUND_ROBIN = GATEWAY_PATHS
DUPLEX = "gateway + EPP, duplex"  # GIE's own body mode (fail closed), capacity only
GATEWAY_SPEED = 5.0  # modelled seconds per wall second: the trace, compressed
GATEWAY_CLIENTS = 64
#: the engines' /metrics counters the hit shares are read from (summed over engines)
QUERIES, GPU_HITS, HOST_HITS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "spillway_host_hit_tokens_total",
)


def added(direct: list[float], routed: list[float], q: float) -> float:
    """What a path adds at percentile ``q``: its percentile less direct's (as --overhead)."""
    return (percentile(routed, q) or 0.0) - (percentile(direct, q) or 0.0)


def split(counts: list[float]) -> str:
    """Each engine's share of the prompt tokens, in percent: ``52/48``."""
    total = sum(counts) or 1.0
    return "/".join(f"{100 * c / total:.0f}" for c in counts)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_counters(address: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys((QUERIES, GPU_HITS, HOST_HITS), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


class Stack:
    """The processes of one measurement (engines, spillway-router, Envoys), on loopback;
    all stopped on exit. ``pin`` names the one core a process runs on (taskset)."""

    def __init__(self, workdir: Path, plan_path: Path) -> None:
        import os

        self.workdir, self.plan_path = workdir, plan_path
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT / 'engine'}:{ROOT / 'operator'}"}
        self.procs: list = []
        self.envoys: list = []
        workdir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        import subprocess

        for envoy in self.envoys:
            envoy.stop()
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def _start(self, name: str, cmd: list[str], pin: int | None = None):
        import shutil
        import subprocess

        if pin is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(pin), *cmd]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                stderr=(self.workdir / f"{name}.log").open("wb"))  # fmt: skip
        self.procs.append(proc)
        return proc

    def engines(self, ports: list[int], speed: float) -> list[str]:
        addresses = []
        for i, port in enumerate(ports):
            self._start(f"engine-{i}", [
                sys.executable, "-m", "spillway_engine.simulator", "--plan", str(self.plan_path),
                "--port", str(port), "--speed", str(speed), "--served-model-name", "m",
                "--gpu-kv-tokens", str(GPU_KV_TOKENS), "--seed", str(i)])  # fmt: skip
            addresses.append(f"127.0.0.1:{port}")
        for a in addresses:
            _wait_http(f"http://{a}/health", lambda body: True)
        return addresses

    def router(self, addresses: list[str], pin: int | None = None) -> tuple[str, str, int]:
        """spillway-router (approximate index: the simulator publishes no KV events) with
        its endpoint picker: (proxy URL, picker host:port, pid)."""
        port, epp = _free_port(), _free_port()
        backends = [a for i, addr in enumerate(addresses) for a in (
            "--backend", f"model=m,url=http://{addr},name=e{i},plan={self.plan_path}")]
        proc = self._start("router", [
            sys.executable, "-m", "spillway_router.main", "--host", "127.0.0.1", "--port",
            str(port), "--epp-port", str(epp), "--mode", "approx", "--log-level", "WARNING",
            *backends], pin)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        n = len(addresses)
        _wait_http(url + "/healthz", lambda body: json.loads(body)["ready_pods"].get("m") == n)
        return url, f"127.0.0.1:{epp}", proc.pid

    def envoy(self, name: str, picker: str | None, addresses: list[str], pin: int | None = None,
              failure_mode: str = "FailOpen"):  # fmt: skip
        import shutil
        import subprocess

        from e2e.gateway import Envoy, GatewayConfig

        cfg = GatewayConfig(picker=picker, endpoints=addresses, port=_free_port(),
                            admin_port=_free_port(), failure_mode=failure_mode)  # fmt: skip
        envoy = Envoy(cfg, self.workdir / name)
        self.envoys.append(envoy)
        envoy.start()
        if pin is not None and shutil.which("taskset"):  # every thread of it
            subprocess.run(["taskset", "-a", "-cp", str(pin), str(envoy.proc.pid)],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        return envoy


def _wait_http(url: str, ok, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200 and ok(r.read()):
                    return
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: not ready in {timeout:.0f} s")
        time.sleep(0.1)


async def _streamed(http, url: str, item: ReplayItem) -> tuple[float, float] | None:
    """One trace request, streamed: (wall s to the first SSE data chunk, the engine's own
    modelled TTFT), or None when it failed."""
    import aiohttp

    body = {"model": "m", "prompt": list(item.prompt), "max_tokens": item.max_tokens,
            "stream": True, "user": item.session}  # fmt: skip
    t0 = time.perf_counter()
    first = modelled = None
    try:
        async with http.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return None
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                if b'"spillway"' in line:
                    modelled = json.loads(line[5:])["spillway"]["ttft_s"]
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    if first is None or modelled is None:
        return None
    return first, modelled


async def _replay(url: str, items: list[ReplayItem], speed: float) -> list:
    """The trace in real time, ``speed`` times compressed (every request on time, however
    many are in flight)."""
    import asyncio

    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = time.perf_counter()
        tasks = []
        for item in items:
            delay = start + item.arrival / speed - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_streamed(http, url, item)))
        return await asyncio.gather(*tasks)


@dataclass
class GatewayRow:
    path: str
    requests: int
    errors: int
    gpu_share: float
    host_share: float
    split: str
    p50: float  # client-measured TTFT, wall s
    p95: float
    model_p50: float  # the engines' own TTFT, modelled s
    fallbacks: int  # requests Envoy sent on without the picker's answer (failing open)
    added_p50: float = 0.0
    added_p99: float = 0.0


def gateway_path(path: str, items: list[ReplayItem], workdir: Path, plan_path: Path,
                 ports: list[int], speed: float) -> GatewayRow:  # fmt: skip
    """The trace through one path, on fresh (cold) engines and a fresh router."""
    import asyncio

    with Stack(workdir, plan_path) as stack:
        addresses = stack.engines(ports, speed)
        envoy = None
        if path == ROUND_ROBIN:
            envoy = stack.envoy("envoy", None, addresses)
            url = envoy.url
        else:
            url, picker, _ = stack.router(addresses)
            if path in (EPP, DUPLEX):
                mode = "FailClose" if path == DUPLEX else "FailOpen"
                envoy = stack.envoy("envoy", picker, addresses, failure_mode=mode)
                url = envoy.url
        got = asyncio.run(_replay(url, items, speed))
        counters = [_engine_counters(a) for a in addresses]
        fallbacks = 0
        if envoy is not None:
            fallbacks = envoy.stats().get("http.gateway.ext_proc.failure_mode_allowed", 0)
    ok = [g for g in got if g is not None]
    queries = sum(c[QUERIES] for c in counters) or 1.0
    return GatewayRow(
        path,
        len(items),
        len(items) - len(ok),
        sum(c[GPU_HITS] for c in counters) / queries,
        sum(c[HOST_HITS] for c in counters) / queries,
        split([c[QUERIES] for c in counters]),
        percentile([g[0] for g in ok], 50) or 0.0,
        percentile([g[0] for g in ok], 95) or 0.0,
        percentile([g[1] for g in ok], 50) or 0.0,
        int(fallbacks),
    )


async def _gateway_load(urls: dict[str, list[str]], pids: dict[str, list[int]], n: int,
                        seconds: float) -> tuple[dict, dict]:  # fmt: skip
    """Sequential requests direct and through each path (interleaved), then requests/s
    through each with ``GATEWAY_CLIENTS`` concurrent clients, and the CPU share of the
    processes in ``pids`` meanwhile. ``urls["direct"]`` are the engines themselves."""
    import asyncio
    import itertools
    import random

    import aiohttp

    rng = random.Random(0)

    def body() -> bytes:
        return json.dumps({"model": "m", "max_tokens": 1,
                           "prompt": [rng.randrange(16, 32000) for _ in range(2048)]}).encode()

    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(url: str, data: bytes) -> float:
            t0 = time.perf_counter()
            async with http.post(url + "/v1/completions", data=data, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}")
            return time.perf_counter() - t0

        for targets in urls.values():  # all up
            for url in targets:
                await one(url, body())
        lat: dict[str, list[float]] = {name: [] for name in urls}
        for i in range(n):
            for name, targets in urls.items():
                lat[name].append(await one(targets[i % len(targets)], body()))
        pool = [body() for _ in range(512)]  # made before the clock starts
        load: dict[str, dict[str, float]] = {}
        for name, targets in urls.items():
            done = 0
            bodies = itertools.cycle(pool)
            stop = time.perf_counter() + seconds

            async def client(k: int, targets: list[str] = targets, stop: float = stop,
                             bodies: Iterator[bytes] = bodies) -> None:  # fmt: skip
                nonlocal done
                while time.perf_counter() < stop:
                    await one(targets[k % len(targets)], next(bodies))
                    done += 1

            cpu0 = {k: sum(_cpu_s(p) for p in ps) for k, ps in pids.items()}
            t0 = time.perf_counter()
            await asyncio.gather(*(client(k) for k in range(GATEWAY_CLIENTS)))
            wall = time.perf_counter() - t0
            load[name] = {"rps": done / wall}
            for k, ps in pids.items():
                load[name][k] = (sum(_cpu_s(p) for p in ps) - cpu0[k]) / wall
    return lat, load


def gateway(duration: float, seed: int, n: int, speed: float, quick: bool) -> int:
    import os
    import tempfile

    plan, _ = load_plan()
    # the simulator exports no vllm:cache_config_info, so the router takes a pod's GPU
    # KV size from its plan's max_model_len: make that the engines' real GPU size
    plan = plan.model_copy(update={"max_model_len": GPU_KV_TOKENS})
    items = trace(n, duration, seed)
    t_start = time.perf_counter()
    print(f"gateway: {n} simulator engines (GPU KV {GPU_KV_TOKENS} tokens, host tier "
          f"{plan.capacity_tokens} tokens each; speed {speed:g}), the routing trace of {n} "
          f"replicas: {len(items)} requests over {duration:.0f} virtual s = "
          f"{duration / speed:.0f} s wall per path; spillway-router --mode approx (the "
          f"simulator publishes no KV events); fresh engines and router per path", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(plan.model_dump_json())
        ports = [_free_port() for _ in range(n)]
        rows = {}
        for path in GATEWAY_PATHS:
            t0 = time.perf_counter()
            rows[path] = gateway_path(path, items, Path(tmp) / path.replace(" ", "_"),
                                      plan_path, ports, speed)  # fmt: skip
            print(f"  {path}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

        # overhead and capacity: engines at speed 1000 (their modelled time negligible);
        # spillway-router (proxy and picker, one process) alone on core 0, everything
        # else (Envoys, engines, this client) on core 1
        cores = sorted(os.sched_getaffinity(0))
        pinned = len(cores) >= 2
        router_core, rest = (cores[0], cores[1]) if pinned else (None, None)
        before = os.sched_getaffinity(0)
        try:
            if pinned:
                os.sched_setaffinity(0, {rest})  # inherited by the processes started here
            with Stack(Path(tmp) / "load", plan_path) as stack:
                addresses = stack.engines(ports, 1000.0)
                proxy, picker, rpid = stack.router(addresses, pin=router_core)
                with_epp = stack.envoy("envoy-epp", picker, addresses, pin=rest)
                duplex = stack.envoy("envoy-duplex", picker, addresses, pin=rest,
                                     failure_mode="FailClose")  # fmt: skip
                plain = stack.envoy("envoy-rr", None, addresses, pin=rest)
                urls = {"direct": [f"http://{a}" for a in addresses], EPP: [with_epp.url],
                        DUPLEX: [duplex.url], PROXY: [proxy],
                        ROUND_ROBIN: [plain.url]}  # fmt: skip
                pids = {"spillway": [rpid], "envoy": [e.proc.pid for e in stack.envoys],
                        "engines": [p.pid for p in stack.procs if p.pid != rpid]}  # fmt: skip
                import asyncio

                lat, load = asyncio.run(_gateway_load(urls, pids, 100 if quick else 400,
                                                      3.0 if quick else 8.0))  # fmt: skip
        finally:
            os.sched_setaffinity(0, before)
    for path, row in rows.items():
        row.added_p50 = added(lat["direct"], lat[path], 50)
        row.added_p99 = added(lat["direct"], lat[path], 99)
    width = max(6, 3 * n)
    head = (f"{'path':<24} {'reqs':>5} {'err':>4} {'GPU hit':>8} {'host hit':>8} "
            f"{'split %':>{width}} {'TTFT p50':>9} {'TTFT p95':>9} {'model p50':>9} "
            f"{'+p50':>7} {'+p99':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for row in rows.values():
        print(f"{row.path:<24} {row.requests:>5} {row.errors:>4} {row.gpu_share:>8.1%} "
              f"{row.host_share:>8.1%} {row.split:>{width}} {row.p50 * 1e3:>7.1f}ms "
              f"{row.p95 * 1e3:>7.1f}ms {row.model_p50 * 1e3:>7.0f}ms "
              f"{row.added_p50 * 1e3:>5.1f}ms {row.added_p99 * 1e3:>5.1f}ms")  # fmt: skip
    for row in rows.values():
        if row.fallbacks:
            print(f"  {row.path}: {row.fallbacks} requests went on without the picker's "
                  f"answer (Envoy's ext_proc failure_mode_allowed: round robin)")  # fmt: skip
    where = (f"spillway-router alone on core {router_core}, Envoy, engines and client on "
             f"core {rest}" if pinned else "unpinned (fewer than 2 cores)")
    print(f"\n{GATEWAY_CLIENTS} concurrent clients, max_tokens 1, 2,048-token prompts, "
          f"engines at speed 1000; {where}; CPU: share of one core")
    head = f"{'path':<24} {'req/s':>6} {'spillway CPU':>12} {'Envoy CPU':>9} {'engines CPU':>11}"
    print(head)
    print("-" * len(head))
    for name, got in load.items():
        label = "direct to the engines" if name == "direct" else name
        print(f"{label:<24} {got['rps']:>6.0f} {got['spillway']:>12.0%} {got['envoy']:>9.0%} "
              f"{got['engines']:>11.0%}")  # fmt: skip
    print(f"({DUPLEX}: added latency p50 {added(lat['direct'], lat[DUPLEX], 50) * 1e3:.1f} "
          f"ms, p99 {added(lat['direct'], lat[DUPLEX], 99) * 1e3:.1f} ms; direct p50 "
          f"{(percentile(lat['direct'], 50) or 0) * 1e3:.1f} ms; "
          f"wall {time.perf_counter() - t_start:.0f} s)")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=300.0, help="virtual seconds")
    ap.add_argument("--quick", action="store_true", help="120 virtual s, 1 and 4 replicas")
    ap.add_argument("--overhead", action="store_true", help="the HTTP proxy's overhead")
    ap.add_argument("--gateway", action="store_true",
                    help="Envoy + Spillway's endpoint picker vs the proxy vs plain round robin")
    ap.add_argument("--gateway-replicas", type=int, default=2, help="engines for --gateway")
    ap.add_argument("--gateway-speed", type=float, default=GATEWAY_SPEED,
                    help="--gateway: modelled seconds per wall second")
    ap.add_argument("--autoscale-duration", type=float, default=1800.0,
                    help="virtual s of the run under the autoscaler (0: leave it out)")
    args = ap.parse_args(argv)
    if args.overhead:
        return overhead()
    if args.gateway:
        return gateway(60.0 if args.quick else args.duration, args.seed,
                       args.gateway_replicas, args.gateway_speed, args.quick)  # fmt: skip
    counts = (1, 4) if args.quick else REPLICAS
    duration = 120.0 if args.quick else args.duration
    scaled = 600.0 if args.quick else args.autoscale_duration
    plan, sim_plan = load_plan()
    host = plan.capacity_tokens
    print(f"plan {PLAN_FILE.name}: per replica GPU KV {GPU_KV_TOKENS} tokens, host tier "
          f"{host} tokens ({HOST_CHUNKS} chunks); {duration:.0f} virtual s")  # fmt: skip
    head = (f"{'policy':<20} {'N':>2} {'reqs':>6} {'GPU hit':>8} {'host hit':>8} "
            f"{'TTFT p50':>9} {'TTFT p95':>9} {'imbal':>6} {'decide p99':>11}")  # fmt: skip
    print(head)
    print("-" * len(head))
    rows = []
    for n in counts:
        items = trace(n, duration, args.seed)
        for name in POLICIES:
            t0 = time.perf_counter()
            row = run(name, n, plan, sim_plan, items, args.seed)
            rows.append(row)
            print(f"{row.policy:<20} {n:>2} {row.requests:>6} {row.gpu_share:>8.1%} "
                  f"{row.host_share:>8.1%} {row.p50 * 1e3:>7.0f}ms {row.p95 * 1e3:>7.0f}ms "
                  f"{row.imbalance:>6.2f} {row.decide_p99_us:>9.0f}us"
                  f"   ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    if scaled > 0:
        autoscaled_table(plan, sim_plan, scaled, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
