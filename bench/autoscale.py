"""Autoscaling policies on one bursty, shared-prefix trace, in accelerated (virtual) time.

Replays the SAME seeded trace against simulated vLLM replicas
(``spillway_engine.simulator.cluster.VirtualCluster``, one virtual clock) under three
autoscaling policies (plus a fixed-size reference) and prints one row per policy:
replica-minutes used, the share of requests whose modelled TTFT meets
``--ttft-target``, p50/p95/p99 TTFT, the number of scaling actions and the most replicas
asked for. Every policy reads what the operator would scrape: each ready replica's
``/metrics`` text, parsed by the operator's ``parse_metrics``.

    python -m bench.autoscale [--seed N] [--duration S] [--ttft-target S] [--quick]
                              [--static N] [--verbose]
    python bench/autoscale.py --quick          # CI smoke run (~25 s on one core)

The default run (1800 virtual s, ~9,400 requests x 4 runs) takes ~1.5 minutes of one
core; ``--duration 3600`` about twice that.

Policies (all: 1..8 replicas, one decision every ``INTERVAL`` = 15 virtual s, the HPA's
default sync period and the CRD's default ``intervalSeconds``; a replica asked for
becomes ready ``LOAD_DELAY`` = 120 virtual s later and only then receives traffic; it
holds a GPU, and counts in replica-minutes, from the moment it is asked for until it
has drained after removal)

spillway
    The operator's own code, unchanged, driven as ``autoscaler.Autoscaler.tick`` drives
    it: ``parse_metrics`` -> ``pod_pressure(prev, cur, max_dt = 3 * INTERVAL + 3)`` per
    ready replica -> ``aggregate`` -> ``decide(Policy, now, current, ready, starting,
    agg, state)`` with current = spec.replicas, ready = serving replicas, starting =
    replicas asked for but still loading (so the "wait for starting pods" cascade guard
    acts). ``Policy`` = the CRD defaults (target 1.0, tolerance 0.1, scale-up window 0 s,
    scale-down window 300 s) with min 1 / max 8, and ``Policy``'s own defaults for the
    rest: up by at most max(4 pods, 100 %) per decision, down by 1 pod per decision,
    warm-cache guard for at most 3 windows. Nothing of it is tuned here.
hpa-kv
    Kubernetes' HPA algorithm (``replica_calculator.go`` + the default ``behavior``) on
    ``vllm:kv_cache_usage_perc`` averaged over ready replicas, target 0.8:
    desired = ceil(ready * avg / target), no change within the 10 % tolerance; replicas
    still starting count as 0 when scaling up (the HPA's rule for pods without metrics,
    its cascade guard) and are ignored when scaling down; scale-down stabilization
    300 s (max of the recommendations in the window), scale-up stabilization 0 s; rate
    limits: up by max(4 pods, 100 %), down by 100 %, per 15 s.
hpa-queue
    The same HPA algorithm on ``vllm:num_requests_waiting``, target 2 waiting per
    replica (an AverageValue pods metric).
static-N (``--static N``, default 3; 0 leaves it out)
    Not a policy: N replicas asked for at the first decision and kept. A hindsight
    reference for what a fixed fleet costs and serves; the verdict ignores it.

Every run gets the same trace, seed, plan, routing, load delay, bounds, interval and
start (one ready replica at t = 0). Routing is the cluster's ``prefix-affinity``
(replica = crc32(session) mod the number of serving replicas: a conversation or a
shared system prompt sticks to one replica). It is modulo, not consistent, hashing: a
change of the replica count remaps most sessions to replicas whose caches do not hold
them, which costs every policy cache hits, more so the ones that scale more often.

Engine model (simulator defaults unless stated)
    Plan ``tests/fixtures/plans/llama-3.2-1b-upstream.json`` (Llama-3.2-1B, 16 layers,
    32 KiB of KV per token, vLLM's upstream offloader): host pool 1024 chunks x 256
    tokens = 262,144 tokens (8 GiB) per replica. GPU KV per replica ``GPU_KV_TOKENS`` =
    16,384 tokens (512 MiB; deliberately modest, like a bigger model on a small share of
    the GPU, so that the burst's working set - ~25k tokens of shared prompts plus up to
    ~3.6k per live conversation - exceeds GPU KV and the host pool supplies ~30-50 % of
    prompt tokens). Latency model: the simulator's defaults (4 ms per step, 60 us per
    prefill token, 50 us per decoding sequence, 25 GB/s PCIe, 2 % jitter); scheduler:
    256 seqs, 8192 batched tokens per step. Replica k gets engine seed ``seed + k``.
    Measured on this trace mix with warm caches, one replica keeps p95 TTFT under 1 s
    up to ~4 req/s and collapses at ~6 req/s (preemptions, queueing): the 10 req/s
    peak needs at least 3 replicas.

Trace (``make_trace``; Poisson arrivals; token counts are words = simulator tokens)
    Total rate lambda(t) = ``base_rate`` * (1 + (``burst_factor`` - 1) * bump(t)) with
    base_rate = 2 req/s and burst_factor = 5 (10 req/s at the peak). bump(t) is a
    trapezoid over fractions of ``--duration``: 0 for the first 20 %, a linear ramp up
    over 15 % (270 s by default: longer than the load delay, as a daily rise is), 1 for
    25 %, a ramp down over 15 %, 0 for the last 25 % (a compressed day).
    40 % of the requests are ``shared-prefix``: one of 12 system prompts of 2048 tokens
    + a 64-token question, one stream following 0.4 * lambda(t). 60 % are multi-turn
    ``chat`` (512-token system prompt per conversation, 128-token user turns,
    256-token assistant replies re-sent as history, 8 turns then a new conversation):
    12 base users at 0.6 * base_rate all the time, plus (burst_factor - 1) * 12 = 48
    users active only in the burst (0.6 * base_rate * (burst_factor - 1) * bump(t)), so
    a user's pace is the same in and out of the burst and the working set grows with
    the load. ``max_tokens`` = 256 for every request. A non-constant rate is made by
    time-warping a rate-1 ``generate_trace`` stream through the inverse of the
    cumulative rate. Streams use seeds 3*seed+1..3 and tagged sessions.
    ``--quick``: the same shape and rates over 600 s (~3,100 requests); its ramps
    (90 s) are shorter than the load delay, so it is a flash crowd and a smoke test of
    the machinery, not the comparison.

Metrics
    TTFT = the simulator's modelled first-token time - arrival; a request the engine
    rejects (none with these parameters) counts as missing the target. Replica-minutes
    integrate (ready + starting + draining) replicas over [0, --duration]; requests
    still in flight then drain with the last replica count. Scaling actions = decisions
    that changed the requested replica count. ``stalls`` counts stalls broken (below).

Simulator capabilities added here, around the simulator's own classes
    ``DelayedCluster``: per-replica load delay (a ReplicaSet-like spec.replicas with
    starting replicas; removal cancels starting replicas first, then drains the newest;
    a new replica is always fresh, never a revived draining one). It runs the cluster
    with ``break_stalls``: under overload a core can stall - requests whose host load
    finished hold GPU blocks, wait for more, nothing runs - and the simulator's own
    ``EngineCore.break_stall`` preempts the youngest such request (counted in
    ``vllm:num_preemptions``) instead of raising. Two speed-ups that do not change what
    any policy reads: the latency histograms are not observed (no policy reads them)
    and the scraped text is cut to the families ``parse_metrics`` reads before parsing.

Reading the result: the script prints, under the table, the per-phase split, the
replica count over time, the mean/peak of each Spillway pressure component per phase,
every Spillway scaling action with its dominant component, and a verdict against
each baseline (``--verbose`` prints every decision of every policy).
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine"))
sys.path.insert(0, str(ROOT / "operator"))

from spillway_cli.loadgen import (  # noqa: E402
    TraceSpec,
    generate_trace,
    percentile,
    to_replay_items,
)
from spillway_engine.simulator.cluster import Replica, VirtualCluster  # noqa: E402
from spillway_engine.simulator.core import ReplayItem, SimRequest  # noqa: E402
from spillway_engine.simulator.plan_input import (  # noqa: E402
    SimPlan,
    gpu_blocks_for_tokens,
    load_plan,
)
from spillway_operator.flow.pressure import (  # noqa: E402
    COUNTERS,
    GAUGES,
    HOST_HITS,
    Aggregate,
    Policy,
    Sample,
    State,
    aggregate,
    decide,
    parse_metrics,
    pod_pressure,
)

PLAN_FILE = ROOT / "tests" / "fixtures" / "plans" / "llama-3.2-1b-upstream.json"
GPU_KV_TOKENS = 16384
ROUTING = "prefix-affinity"
MIN_REPLICAS, MAX_REPLICAS = 1, 8
INTERVAL = 15.0  # s between autoscaler decisions (HPA default sync period)
LOAD_DELAY = 120.0  # s from "asked for" to ready (model load)
SCALE_DOWN_WINDOW = 300.0
TOLERANCE = 0.1
HPA_KV_TARGET = 0.8
HPA_QUEUE_TARGET = 2.0
PHASES = ("before", "burst", "after")
_READ = frozenset(GAUGES) | frozenset(COUNTERS) | {HOST_HITS}


# ----------------------------------------------------------------------------- trace


@dataclass(frozen=True)
class Shape:
    """The trace's shape (see the module docstring)."""

    duration: float = 1800.0
    base_rate: float = 2.0
    burst_factor: float = 5.0
    burst_start: float = 0.20  # fractions of duration
    ramp: float = 0.15
    plateau: float = 0.25
    shared_share: float = 0.4
    prefixes: int = 12
    prefix_tokens: int = 2048
    question_tokens: int = 64
    base_users: int = 12
    turns: int = 8
    system_tokens: int = 512
    user_tokens: int = 128
    reply_tokens: int = 256
    max_tokens: int = 256

    def bump(self, t: float) -> float:
        d = self.duration
        t0, r, p = self.burst_start * d, self.ramp * d, self.plateau * d
        if t <= t0 or t >= t0 + 2 * r + p:
            return 0.0
        if t < t0 + r:
            return (t - t0) / r
        if t <= t0 + r + p:
            return 1.0
        return (t0 + 2 * r + p - t) / r

    def phases(self) -> list[tuple[float, float]]:
        """[start, end) of the phases before, during and after the burst (ramps included)."""
        d = self.duration
        t0 = self.burst_start * d
        t3 = t0 + (2 * self.ramp + self.plateau) * d
        return [(0.0, t0), (t0, t3), (t3, d)]

    def total_rate(self, t: float) -> float:
        return self.base_rate * (1.0 + (self.burst_factor - 1.0) * self.bump(t))


def _warp(rate: Callable[[float], float], duration: float, step: float = 1.0):
    """Cumulative intensity on a grid, and its inverse: arrivals of a rate-1 Poisson
    process in "operational time" s map to a Poisson process of intensity ``rate``."""
    ts, cum = [0.0], [0.0]
    t = 0.0
    while t < duration:
        nt = min(duration, t + step)
        cum.append(cum[-1] + 0.5 * (rate(t) + rate(nt)) * (nt - t))
        ts.append(nt)
        t = nt

    def inverse(s: float) -> float:
        i = min(max(bisect.bisect_left(cum, s), 1), len(cum) - 1)
        c0, c1 = cum[i - 1], cum[i]
        return ts[i - 1] + (ts[i] - ts[i - 1]) * ((s - c0) / (c1 - c0) if c1 > c0 else 0.0)

    return cum[-1], inverse


def _stream(spec: TraceSpec, rate: Callable[[float], float], duration: float, tag: str):
    total, inverse = _warp(rate, duration)
    if total <= 0:
        return []
    items = to_replay_items(generate_trace(replace(spec, rate=1.0, duration=total)))
    return [
        ReplayItem(inverse(it.arrival), it.prompt, it.max_tokens, session=f"{tag}/{it.session}")
        for it in items
    ]


def make_trace(shape: Shape, seed: int) -> list[ReplayItem]:
    """The seeded trace: shared-prefix stream + base chat users + burst-only chat users."""
    d = shape.duration
    chat = TraceSpec(
        kind="chat",
        users=shape.base_users,
        turns=shape.turns,
        system_tokens=shape.system_tokens,
        user_tokens=shape.user_tokens,
        reply_tokens=shape.reply_tokens,
        max_tokens=shape.max_tokens,
    )
    shared = TraceSpec(
        kind="shared-prefix",
        prefixes=shape.prefixes,
        prefix_tokens=shape.prefix_tokens,
        question_tokens=shape.question_tokens,
        max_tokens=shape.max_tokens,
        seed=seed * 3 + 1,
    )
    c = 1.0 - shape.shared_share
    extra = shape.burst_factor - 1.0
    items = _stream(shared, lambda t: shape.shared_share * shape.total_rate(t), d, "sp")
    items += _stream(replace(chat, seed=seed * 3 + 2), lambda t: c * shape.base_rate, d, "base")
    burst_users = max(1, round(shape.base_users * extra))
    items += _stream(
        replace(chat, seed=seed * 3 + 3, users=burst_users),
        lambda t: c * shape.base_rate * extra * shape.bump(t),
        d,
        "burst",
    )
    items.sort(key=lambda it: it.arrival)
    return [replace(it, rid=i) for i, it in enumerate(items)]


# ----------------------------------------------------------------------------- cluster


class DelayedCluster(VirtualCluster):
    """A VirtualCluster whose new replicas load the model for ``load_delay`` seconds
    before they take traffic. ``desired`` is spec.replicas; ``starting`` holds the
    ready-at times of replicas asked for but not ready yet."""

    def __init__(self, plan: SimPlan, *, load_delay: float, **kw) -> None:
        # Overload can stall a core; break it (``EngineCore.break_stall``) and count it.
        super().__init__(plan, break_stalls=True, **kw)
        self.load_delay = load_delay
        self.starting: list[float] = []

    @property
    def desired(self) -> int:
        return len(self.serving) + len(self.starting)

    def occupied(self) -> int:
        """Replicas holding a GPU: ready, draining and starting."""
        return len(self.replicas) + len(self.starting)

    def request(self, n: int) -> None:
        """Set spec.replicas to ``n``: start loading new replicas, or remove starting
        ones first (as a ReplicaSet deletes unready pods first), then drain the newest."""
        have = self.desired
        if n > have:
            self.starting += [self.now + self.load_delay] * (n - have)
        elif n < have:
            drop = have - n
            cancel = min(drop, len(self.starting))
            self.starting = sorted(self.starting)[: len(self.starting) - cancel]
            if drop > cancel:
                self.scale_to(len(self.serving) - (drop - cancel))

    def _new_replica(self) -> Replica:
        replica = super()._new_replica()
        # No policy reads the latency histograms: skip their per-token observations
        # (the gauges and counters the policies read are synced from the core).
        replica.core.observer = None
        return replica

    def scrape_lean(self, replica: Replica) -> str:
        """The replica's /metrics text, cut to the families ``parse_metrics`` reads
        (the parsed Sample is identical; parsing every histogram is most of the cost)."""
        keep = []
        for line in self.scrape(replica).splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                name = parts[2] if len(parts) > 2 else ""
            else:
                name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.removesuffix("_total").removesuffix("_created") in _READ:
                keep.append(line)
        return "\n".join(keep) + "\n"

    def promote(self, now: float) -> int:
        """Replicas whose model load finished by ``now`` start serving (fresh, cold)."""
        done = [t for t in self.starting if t <= now]
        self.starting = [t for t in self.starting if t > now]
        for _ in done:
            # A fresh pod: never revive a draining one (a terminating pod cannot be).
            self.replicas.append(self._new_replica())
        return len(done)

    def next_ready(self) -> float | None:
        return min(self.starting) if self.starting else None


# ----------------------------------------------------------------------------- policies


@dataclass
class Tick:
    now: float
    current: int
    ready: int
    starting: int
    replicas: int
    reason: str
    components: dict[str, float] = field(default_factory=dict)
    pressure: float | None = None


class SpillwayPolicy:
    name = "spillway"

    def __init__(self, target: float = 1.0) -> None:
        self.policy = Policy(
            min_replicas=MIN_REPLICAS,
            max_replicas=MAX_REPLICAS,
            target=target,
            tolerance=TOLERANCE,
            scale_up_window=0.0,
            scale_down_window=SCALE_DOWN_WINDOW,
        )
        self.max_dt = 3 * INTERVAL + 3.0  # as the operator's autoscaler
        self.samples: dict[str, Sample] = {}
        self.state = State()

    def tick(self, now: float, texts: dict[str, str], current: int, starting: int) -> Tick:
        cur: dict[str, Sample] = {}
        pods = []
        for name, text in texts.items():
            sample = parse_metrics(text, now)
            cur[name] = sample
            pods.append(pod_pressure(self.samples.get(name), sample, self.max_dt))
        self.samples = cur
        agg: Aggregate = aggregate(pods)
        d = decide(self.policy, now, current, len(texts), starting, agg, self.state)
        self.state = d.state
        return Tick(now, current, len(texts), starting, d.replicas, d.reason,
                    dict(agg.components), agg.pressure)  # fmt: skip


class HpaPolicy:
    """Kubernetes HPA (autoscaling/v2, default behavior) on one per-pod metric."""

    def __init__(self, name: str, key: str, target: float) -> None:
        self.name, self.key, self.target = name, key, target
        self.history: list[tuple[float, int]] = []

    def _raw(self, values: list[float], current: int, starting: int) -> int:
        if not values:
            return current  # no metrics: the HPA does nothing
        ratio = sum(values) / len(values) / self.target
        if starting == 0:
            if abs(1.0 - ratio) <= TOLERANCE:
                return current
            return math.ceil(ratio * len(values))
        # Pods not ready yet: counted as 0 when scaling up, ignored when scaling down.
        pool = values + [0.0] * starting if ratio > 1.0 else values
        new_ratio = sum(pool) / len(pool) / self.target
        if abs(1.0 - new_ratio) <= TOLERANCE or (ratio < 1.0 < new_ratio) or (
            ratio > 1.0 > new_ratio
        ):
            return current
        n = math.ceil(new_ratio * len(pool))
        if (new_ratio < 1.0 and n > current) or (new_ratio > 1.0 and n < current):
            return current
        return n

    def tick(self, now: float, texts: dict[str, str], current: int, starting: int) -> Tick:
        values = [parse_metrics(t, now).values.get(self.key, 0.0) for t in texts.values()]
        raw = min(max(self._raw(values, current, starting), MIN_REPLICAS), MAX_REPLICAS)
        self.history = [(t, r) for t, r in self.history if now - t < SCALE_DOWN_WINDOW]
        self.history.append((now, raw))
        down = max(r for _, r in self.history)  # scale-down stabilization window
        rec = min(max(current, raw), down)  # scale-up window 0: up to raw at once
        if rec > current:
            rec = min(rec, max(current + 4, 2 * current))  # 4 pods or 100 % per 15 s
        rec = min(max(rec, MIN_REPLICAS), MAX_REPLICAS)  # down: 100 % per 15 s
        avg = sum(values) / len(values) if values else float("nan")
        return Tick(now, current, len(texts), starting, rec,
                    f"avg {self.key} {avg:.2f} -> raw {raw}")  # fmt: skip


class StaticPolicy:
    """A reference, not an autoscaler: ask for ``n`` replicas at the first decision and
    keep them (a fleet sized with hindsight)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.name = f"static-{n}"

    def tick(self, now: float, texts: dict[str, str], current: int, starting: int) -> Tick:
        return Tick(now, current, len(texts), starting, self.n, "static")


# ----------------------------------------------------------------------------- run


@dataclass
class Result:
    policy: str
    requests: list[SimRequest]
    offered: int
    replica_seconds: float
    phase_seconds: dict[str, float]
    actions: int
    max_replicas: int
    ticks: list[Tick]
    timeline: list[tuple[float, int, int]]  # (t, ready, starting)
    host_hit_share: float
    device_hit_share: float
    stalls: int
    preemptions: int
    wall: float


def run_policy(policy, plan: SimPlan, items: list[ReplayItem], shape: Shape,
               seed: int) -> Result:  # fmt: skip
    start = time.perf_counter()
    duration = shape.duration
    bounds = shape.phases()
    cluster = DelayedCluster(
        plan,
        load_delay=LOAD_DELAY,
        replicas=MIN_REPLICAS,
        routing=ROUTING,
        gpu_blocks=gpu_blocks_for_tokens(plan, GPU_KV_TOKENS),
        seed=seed,
    )
    acc = {"t": 0.0, "n": cluster.occupied(), "rs": 0.0}
    by_phase = dict.fromkeys(PHASES, 0.0)

    def account(t: float) -> None:
        t = min(t, duration)
        if t > acc["t"]:
            acc["rs"] += acc["n"] * (t - acc["t"])
            for ph, (lo, hi) in zip(PHASES, bounds, strict=True):
                overlap = min(t, hi) - max(acc["t"], lo)
                if overlap > 0:
                    by_phase[ph] += acc["n"] * overlap
            acc["t"] = t
        acc["n"] = cluster.occupied()

    ticks: list[Tick] = []
    timeline: list[tuple[float, int, int]] = []
    actions = 0
    max_rep = cluster.desired
    next_tick = INTERVAL

    def events_until(t: float) -> None:
        nonlocal next_tick, actions, max_rep
        while True:
            ready_at = cluster.next_ready()
            nxt = min(next_tick, ready_at if ready_at is not None else math.inf)
            if nxt > t or nxt > duration:
                return
            cluster.run_until(nxt)
            account(nxt)
            if ready_at is not None and ready_at <= nxt:
                cluster.promote(nxt)
                account(nxt)
                continue
            texts = {r.name: cluster.scrape_lean(r) for r in cluster.serving}
            current = cluster.desired
            tk = policy.tick(nxt, texts, current, len(cluster.starting))
            ticks.append(tk)
            if tk.replicas != current:
                actions += 1
                cluster.request(tk.replicas)
                max_rep = max(max_rep, cluster.desired)
            account(nxt)
            timeline.append((nxt, len(cluster.serving), len(cluster.starting)))
            next_tick += INTERVAL

    accepted: list[SimRequest] = []
    for item in items:
        events_until(item.arrival)
        req = cluster.submit(item)
        account(item.arrival)
        if req is not None:
            accepted.append(req)
    events_until(duration)
    cluster.run_until(duration)
    account(duration)
    cluster.drain()
    replicas: list[Replica] = cluster.replicas + cluster.retired
    prompt = sum(r.core.counters.prompt_tokens for r in replicas)
    host = sum(r.core.counters.cached_host for r in replicas)
    device = sum(r.core.counters.cached_device for r in replicas)
    return Result(
        policy=policy.name,
        requests=accepted,
        offered=len(items),
        replica_seconds=acc["rs"],
        phase_seconds=by_phase,
        actions=actions,
        max_replicas=max_rep,
        ticks=ticks,
        timeline=timeline,
        host_hit_share=host / max(1, prompt),
        stalls=cluster.stalls,
        device_hit_share=device / max(1, prompt),
        preemptions=sum(r.core.counters.preemptions for r in replicas),
        wall=time.perf_counter() - start,
    )


def summarize(res: Result, target: float) -> dict:
    ttfts = [r.ttft for r in res.requests if r.ttft is not None]
    met = sum(1 for v in ttfts if v <= target)
    return {
        "rm": res.replica_seconds / 60.0,
        "met": met / max(1, res.offered),
        "n_met": met,
        "p50": percentile(ttfts, 50) or 0.0,
        "p95": percentile(ttfts, 95) or 0.0,
        "p99": percentile(ttfts, 99) or 0.0,
    }


def phase_of(shape: Shape, t: float) -> str:
    for ph, (_lo, hi) in zip(PHASES, shape.phases(), strict=True):
        if t < hi:
            return ph
    return PHASES[-1]


def phase_table(results: list[Result], shape: Shape, target: float) -> list[str]:
    """Replica-minutes and the share of requests (by arrival) meeting the target, per phase."""
    out = ["  " + f"{'policy':10}" + "".join(
        f" {ph + ' rep-min':>15} {ph + ' TTFT ok':>15}" for ph in PHASES)]  # fmt: skip
    for res in results:
        cells = []
        for ph in PHASES:
            sel = [r for r in res.requests if phase_of(shape, r.arrival) == ph]
            ok = sum(1 for r in sel if r.ttft is not None and r.ttft <= target)
            cells.append(f" {res.phase_seconds[ph] / 60:>15.1f} {ok / max(1, len(sel)):>15.1%}")
        out.append(f"  {res.policy:10}" + "".join(cells))
    return out


def spillway_analysis(res: Result, shape: Shape) -> list[str]:
    """Which pressure component drove Spillway's decisions, per phase."""
    out = []
    keys = ("load", "thrash", "queue", "preempt")
    drivers: Counter = Counter()
    for tk in res.ticks:
        if tk.replicas > tk.current and tk.components:
            drivers[max(keys, key=lambda k: tk.components.get(k, 0.0))] += 1
    out.append(
        "  scale-ups by the largest (ready-pod mean) component: "
        + (", ".join(f"{k} {n}" for k, n in drivers.most_common()) or "none")
    )
    for ph in PHASES:
        sel = [tk for tk in res.ticks if tk.components and phase_of(shape, tk.now) == ph]
        if not sel:
            continue
        mean = {k: sum(tk.components.get(k, 0.0) for tk in sel) / len(sel) for k in keys}
        peak = {k: max(tk.components.get(k, 0.0) for tk in sel) for k in keys}
        hh = sum(tk.components.get("hostHitShare", 0.0) for tk in sel) / len(sel)
        out.append(
            f"  {ph:6} mean/peak  "
            + "  ".join(f"{k} {mean[k]:.2f}/{peak[k]:.2f}" for k in keys)
            + f"  hostHitShare {hh:.2f}"
        )
    holds: Counter = Counter()
    for tk in res.ticks:
        if tk.replicas == tk.current:
            holds[tk.reason.split(":")[0].split(" (")[0].split(" before")[0]] += 1
    waiting = sum(n for r, n in holds.items() if r.startswith("waiting for"))
    guard = sum(n for r, n in holds.items() if r.startswith("WarmCacheGuard"))
    stab = sum(n for r, n in holds.items() if r.startswith("scale-down stabilizing"))
    out.append(f"  holds: cascade guard (starting pods) {waiting}, warm-cache guard {guard}, "
               f"scale-down stabilizing {stab} (of {len(res.ticks)} decisions)")  # fmt: skip
    out.append("  scaling actions (largest component of the ready-pod mean at that decision):")
    last_down = -math.inf
    for tk in res.ticks:
        if tk.replicas == tk.current:
            continue
        comps = tk.components
        top = max(keys, key=lambda k: comps.get(k, 0.0)) if comps else "-"
        note = ""
        if tk.replicas > tk.current and tk.now - last_down <= 2 * INTERVAL:
            note = "  <- right after a scale-down"
        if tk.replicas < tk.current:
            last_down = tk.now
        pressure = f"{tk.pressure:.2f}" if tk.pressure is not None else "-"
        detail = f"{top} {comps.get(top, 0.0):.2f}"
        if top != "load":
            detail += f", load {comps.get('load', 0.0):.2f}"
        out.append(f"    t={tk.now:6.0f} {phase_of(shape, tk.now):6} {tk.current}->{tk.replicas} "
                   f"pressure {pressure:>5} ({detail}){note}")  # fmt: skip
    return out


def timeline_line(res: Result, shape: Shape, buckets: int = 24) -> str:
    """Requested replicas (ready+starting) at evenly spaced times."""
    out = []
    step = shape.duration / buckets
    i = 0
    desired = MIN_REPLICAS
    for b in range(buckets):
        t = (b + 1) * step
        while i < len(res.timeline) and res.timeline[i][0] <= t:
            desired = res.timeline[i][1] + res.timeline[i][2]
            i += 1
        out.append(str(desired))
    return "".join(out)


#: Targets each policy is swept over (``--sweep``): around its default, from eager
#: (more replicas, better TTFT) to frugal.
SWEEP_TARGETS: dict[str, tuple[float, ...]] = {
    "spillway": (0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0),
    "hpa-kv": (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95),
    "hpa-queue": (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0),
}


def sweep_policy(name: str, target: float):
    if name == "spillway":
        return SpillwayPolicy(target)
    key = "gpu_kv" if name == "hpa-kv" else "waiting"
    return HpaPolicy(name, key, target)


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (replica-minutes, attainment) points no other point beats on both."""
    return [p for p in points
            if not any(q[0] <= p[0] and q[1] >= p[1] and q != p for q in points)]


def cheapest_at(points: list[tuple[float, float]], attainment: float) -> float | None:
    """Fewest replica-minutes among the points reaching ``attainment``."""
    costs = [rm for rm, met in points if met >= attainment]
    return min(costs) if costs else None


def run_sweep(plan: SimPlan, items: list[ReplayItem], shape: Shape, args) -> int:
    """Each policy at each of its targets on the same trace: replica-minutes against
    the share of requests meeting the TTFT target, a table and a PNG."""
    curves: dict[str, list[tuple[float, float, float]]] = {}
    print(f"{'policy':10} {'target':>7} {'replica-min':>11} "
          f"{'TTFT<=' + format(args.ttft_target, 'g') + 's':>10} {'p95 TTFT':>9} "
          f"{'actions':>7} {'wall s':>6}", flush=True)  # fmt: skip
    for name, targets in SWEEP_TARGETS.items():
        for target in targets:
            res = run_policy(sweep_policy(name, target), plan, items, shape, args.seed)
            s = summarize(res, args.ttft_target)
            curves.setdefault(name, []).append((target, s["rm"], s["met"]))
            print(f"{name:10} {target:>7g} {s['rm']:>11.1f} {s['met']:>10.1%} "
                  f"{s['p95']:>8.2f}s {res.actions:>7} {res.wall:>6.1f}", flush=True)
    print("\nfewest replica-minutes reaching each attainment (- : never reached):")
    levels = (0.90, 0.95, 0.98, 0.99)
    print(f"  {'policy':10}" + "".join(f"{f'>= {lv:.0%}':>10}" for lv in levels))
    for name, pts in curves.items():
        cells = [cheapest_at([(rm, met) for _, rm, met in pts], lv) for lv in levels]
        print(f"  {name:10}" + "".join(f"{c:>10.0f}" if c is not None else f"{'-':>10}"
                                       for c in cells))  # fmt: skip
    for lv in levels:
        best = {n: cheapest_at([(rm, met) for _, rm, met in pts], lv)
                for n, pts in curves.items()}
        reached = {n: c for n, c in best.items() if c is not None}
        if reached:
            winner = min(reached, key=reached.get)
            print(f"  at >= {lv:.0%}: {winner} needs the fewest replica-minutes "
                  f"({reached[winner]:.0f})")
    if args.png:
        write_sweep_png(curves, args.png, args.ttft_target)
        print(f"\nwrote {args.png}")
    return 0


def write_sweep_png(curves: dict[str, list[tuple[float, float, float]]], path: Path,
                    ttft_target: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: write the file only
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("bench/autoscale --sweep --png needs matplotlib: "
                         "pip install 'spillway[bench]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, pts in curves.items():
        pts = sorted(pts, key=lambda p: p[1])
        ax.plot([p[1] for p in pts], [100 * p[2] for p in pts], marker="o", label=name)
        for target, rm, met in pts:
            ax.annotate(f"{target:g}", (rm, 100 * met), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("replica-minutes")
    ax.set_ylabel(f"requests with TTFT <= {ttft_target:g} s (%)")
    ax.set_title("Autoscaling policies swept over their targets (labels: target)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, help="virtual seconds (default 1800)")
    parser.add_argument("--ttft-target", type=float, default=2.0, help="modelled seconds")
    parser.add_argument("--quick", action="store_true", help="a smaller run for CI smoke")
    parser.add_argument("--verbose", action="store_true", help="print every decision")
    parser.add_argument("--static", type=int, default=3, metavar="N",
                        help="add a fixed N-replica reference row (0: none; default 3)")
    parser.add_argument("--sweep", action="store_true",
                        help="sweep each policy's target; print replica-minutes vs TTFT "
                        "attainment per point")
    parser.add_argument("--png", type=Path, help="with --sweep: write the curves to this PNG")
    args = parser.parse_args(argv)
    shape = Shape()
    if args.quick:
        shape = replace(shape, duration=600.0)
    if args.duration:
        shape = replace(shape, duration=args.duration)
    plan = load_plan(PLAN_FILE)
    items = make_trace(shape, args.seed)
    gpu_blocks = gpu_blocks_for_tokens(plan, GPU_KV_TOKENS)
    tpc = plan.capacity_tokens // max(1, plan.num_chunks)
    d = shape.duration
    t0 = shape.burst_start * d
    sp = sum(1 for it in items if it.session and it.session.startswith("sp/"))
    burst_users = max(1, round(shape.base_users * (shape.burst_factor - 1)))
    print("Assumptions (virtual time; see the module docstring for every parameter)")
    print(f"  plan          {PLAN_FILE.relative_to(ROOT)} ({plan.model_name}, "
          f"offloader {plan.offloader})")  # fmt: skip
    print(f"  GPU KV        {GPU_KV_TOKENS} tokens ({gpu_blocks} blocks) per replica")
    print(f"  host pool     {plan.capacity_tokens} tokens ({plan.num_chunks} chunks x {tpc} "
          f"tokens, {plan.num_chunks * plan.row_bytes / 2**30:.0f} GiB) per replica")  # fmt: skip
    print(f"  trace         seed {args.seed}, {len(items)} requests over {d:.0f} s: "
          f"{shape.base_rate:g} req/s, burst x{shape.burst_factor:g} "
          f"({shape.base_rate * shape.burst_factor:g} req/s) from {t0:.0f} s, ramps "
          f"{shape.ramp * d:.0f} s, plateau {shape.plateau * d:.0f} s")  # fmt: skip
    print(f"                {sp} shared-prefix ({shape.prefixes} x {shape.prefix_tokens}-token "
          f"system prompts + {shape.question_tokens}), {len(items) - sp} chat "
          f"({shape.base_users} users + {burst_users} during the burst, {shape.turns} turns, "
          f"{shape.system_tokens}+{shape.user_tokens}/{shape.reply_tokens} tokens); "
          f"max_tokens {shape.max_tokens}")  # fmt: skip
    print(f"  scaling       {MIN_REPLICAS}..{MAX_REPLICAS} replicas, decision every "
          f"{INTERVAL:g} s, load delay {LOAD_DELAY:g} s, tolerance {TOLERANCE:g}, "
          f"scale-down stabilization {SCALE_DOWN_WINDOW:g} s")  # fmt: skip
    print(f"  routing       {ROUTING} (crc32(session) mod serving replicas), same for all")
    print(f"  targets       hpa-kv: kv_cache_usage_perc {HPA_KV_TARGET}; hpa-queue: "
          f"num_requests_waiting {HPA_QUEUE_TARGET:g}/replica; spillway: pressure 1.0; "
          f"TTFT target {args.ttft_target:g} s")  # fmt: skip
    print(flush=True)
    if args.sweep:
        return run_sweep(plan, items, shape, args)

    policies = [
        SpillwayPolicy(),
        HpaPolicy("hpa-kv", "gpu_kv", HPA_KV_TARGET),
        HpaPolicy("hpa-queue", "waiting", HPA_QUEUE_TARGET),
    ]
    if args.static:
        policies.append(StaticPolicy(args.static))
    started = time.perf_counter()
    results = [run_policy(p, plan, items, shape, args.seed) for p in policies]
    header = (
        f"{'policy':10} {'replica-min':>11} {'TTFT<=' + format(args.ttft_target, 'g') + 's':>10} "
        f"{'p50 TTFT':>9} {'p95 TTFT':>9} {'p99 TTFT':>9} {'actions':>7} {'max rep':>7} "
        f"{'dev hit':>7} {'host hit':>8} {'preempt':>7} {'stalls':>6} {'wall s':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = {}
    for res in results:
        s = summarize(res, args.ttft_target)
        rows[res.policy] = s
        print(f"{res.policy:10} {s['rm']:>11.1f} {s['met']:>10.1%} {s['p50']:>8.2f}s "
              f"{s['p95']:>8.2f}s {s['p99']:>8.2f}s {res.actions:>7} {res.max_replicas:>7} "
              f"{res.device_hit_share:>7.1%} {res.host_hit_share:>8.1%} {res.preemptions:>7} "
              f"{res.stalls:>6} {res.wall:>6.1f}")  # fmt: skip
    print("\nper phase (burst = ramps + plateau; requests by arrival time):")
    print("\n".join(phase_table(results, shape, args.ttft_target)))
    print(f"\nreplicas asked for over time ({d / 24:.0f} s per column; burst "
          f"{t0:.0f}-{t0 + (2 * shape.ramp + shape.plateau) * d:.0f} s):")  # fmt: skip
    for res in results:
        print(f"  {res.policy:10} {timeline_line(res, shape)}")
    print("\nspillway pressure components (1.0 = at target):")
    print("\n".join(spillway_analysis(results[0], shape)))
    sw = rows["spillway"]
    print("\nverdict (spillway vs each autoscaling baseline; the static row is a hindsight "
          "reference, not a policy):")  # fmt: skip
    for name in ("hpa-kv", "hpa-queue"):
        b = rows[name]
        diff = sw["n_met"] - b["n_met"]
        ttft = "more" if diff > 0 else ("as many" if diff == 0 else "fewer")
        cost = "fewer" if sw["rm"] < b["rm"] else "more"
        both = diff >= 0 and sw["rm"] < b["rm"]
        print(f"  vs {name:9}: spillway meets the TTFT target for {ttft} requests "
              f"({sw['n_met']} vs {b['n_met']}: {sw['met']:.1%} vs {b['met']:.1%}) with "
              f"{cost} replica-minutes ({sw['rm']:.0f} vs {b['rm']:.0f}) -> "
              + ("spillway better on both" if both else "NOT better on both"))  # fmt: skip
    if args.verbose:
        for res in results:
            print(f"\n{res.policy} decisions:")
            for tk in res.ticks:
                comps = " ".join(f"{k}={v:.2f}" for k, v in tk.components.items())
                print(f"  t={tk.now:7.0f} cur={tk.current} ready={tk.ready} "
                      f"starting={tk.starting} -> {tk.replicas}  {tk.reason}  {comps}")  # fmt: skip
    print(f"\nbench wall time {time.perf_counter() - started:.1f} s "
          f"(+ trace generation); {len(items)} requests x {len(results)} policies")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
