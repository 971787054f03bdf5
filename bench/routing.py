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
the picker (``GatewayConfig(picker=None)``); ``gateway + GIE EPP``, Envoy asking GIE
v1.2.0's own picker (``e2e.gateway.gie``: built by tools/build.sh, reading an
InferencePool and a pod per engine from an API server of its own, in GIE's full-duplex
mode), sent the trace as chat messages (it refuses token-id prompts; the engines
tokenize them into the same ids), its prefix scorer sized as its autoTune would size it
from vLLM's cache_config_info at the messages' characters per token; the engines listen
on pod IPs (127.N.0.i, one port) for it. Each path starts on fresh engine processes
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
closed); GIE's picker is measured against the engines sent the same prompts as text
(``direct, text prompts``: 2,048 words), since it takes no token ids, and runs on the
router's core (one of them loaded at a time). About 7 minutes; ``--quick`` about 2.5.

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
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine"))
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT))  # bench.autoscale

from bench.autoscale import DelayedCluster  # noqa: E402
from bench.autoscale_policies import INTERVAL, SCALE_DOWN_WINDOW, TOLERANCE  # noqa: E402
from bench.routing_trace import (  # noqa: E402  (the trace, shared with --gateway)
    GPU_KV_TOKENS,
    HOST_CHUNKS,
    PLAN_FILE,
    free_port,
    load_plan,
    trace,
)
from spillway_cli.loadgen import percentile  # noqa: E402
from spillway_engine.simulator.cluster import Replica, VirtualCluster  # noqa: E402
from spillway_engine.simulator.core import LatencyModel, ReplayItem, _group_salt  # noqa: E402
from spillway_engine.simulator.plan_input import gpu_blocks_for_tokens  # noqa: E402
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

LOAD_DELAY = 120.0  # s from "asked for" to ready (model load); bench.autoscale's old default
REPLICAS = (1, 2, 4, 8)
POLICIES = (
    "spillway-events",
    "spillway-approx",
    "round-robin",
    "session-chwbl",
    "approx-no-capacity",
)
NEVER = 10**12
GATEWAY_SPEED = 5.0  # --gateway: modelled seconds per wall second, the trace compressed


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
        sport, rport = free_port(), free_port()
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
        from bench.routing_gateway import gateway  # real processes: Envoy, pickers, engines

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
