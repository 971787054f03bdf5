"""Autoscaling policies on six seeded traces, in accelerated (virtual) time.

Replays the SAME seeded trace (``bench.autoscale_traces``: ``bursty``, ``diurnal``,
``multitenant``, ``flash``, ``longctx``, ``agentic``) against simulated vLLM replicas
(``spillway_engine.simulator.cluster.VirtualCluster``, one virtual clock) under each
autoscaling policy, and reports replica-minutes used against the share of requests whose
modelled TTFT meets ``--ttft-target`` (2 s; ``longctx``: 4 s). Every policy reads what
the operator would scrape: each ready replica's ``/metrics`` text, parsed by the
operator's ``parse_metrics`` (and the token-velocity baseline the router's in-flight
tokens).

    python -m bench.autoscale [--trace T ...] [--seed N] [--verbose]   # defaults, one trace
    python -m bench.autoscale --sweep [--seeds 0,1,2,3,4] [--jobs 2] [--out rows.json]
                              [--png-dir docs/figures]                 # the frontier
                              [--reuse old-rows.json [--rerun spillway]]  # keep runs made
    python -m bench.autoscale --sweep --from-rows rows.json [--png-dir D]  # report it again
    python -m bench.autoscale --quick                                  # 600 s smoke run

``--sweep`` runs every policy over its targets (``SWEEP_TARGETS``) on every trace and
seed, and prints per trace the fewest replica-minutes (median over seeds) with which
each policy, at its best-tuned target, reaches 95 / 99 / 99.9 % (median attainment; the
worst seed's is shown beside it), and where Spillway's default stands against the best
tuned baseline. Spillway's default is the CRD's, never tuned per trace.

Policies (all: 1..8 replicas, one decision every ``INTERVAL`` = 15 virtual s, the HPA's
default sync period and the CRD's default ``intervalSeconds``; a replica asked for
becomes ready the trace's load delay (120 s) later and only then receives traffic; it
holds a GPU, and counts in replica-minutes, from the moment it is asked for until it
has drained after removal)

spillway
    The operator's own code, unchanged, driven as ``scaler.Autoscaler.tick`` drives it:
    ``parse_metrics`` -> the serving rate learned from every replica
    (``throughput.learn``, seeded from the plan's GPU and the model's size) ->
    ``pod_reading`` per ready replica -> ``aggregate`` -> ``decide(Policy, ...)`` with
    the CRD defaults, min 1 / max 8.
hpa-kv, hpa-queue
    Kubernetes' HPA algorithm (``replica_calculator.go`` + the default ``behavior``) on
    ``vllm:kv_cache_usage_perc`` / ``vllm:num_requests_waiting``: desired =
    ceil(ready * avg / target), 10 % tolerance, starting pods count as 0 when scaling
    up and are ignored when scaling down, scale-down stabilization 300 s, scale-up by
    max(4 pods, 100 %) per 15 s.
keda
    The HPA a KEDA ScaledObject creates on running + waiting requests per replica (an
    AverageValue target; llm-d's and production-stack's blueprints scale on these).
dynamo
    Dynamo's load-based planner as documented: KV-utilisation and prefill-queue
    thresholds, one replica per 60 s adjustment, the prefix hit rate as a scale-down
    brake (``DynamoPolicy``).
velocity
    llm-d's token-aware ("token velocity") KEDA autoscaling for P+D pods as its guide
    configures it: sum(in-flight uncached prompt tokens) / V_P seconds of prefill
    backlog against the target per replica, beside sum(kv_cache_usage_perc) against
    0.8, one pod per 180 s up and per 300 s down; V_P calibrated as llm-d's
    ``calibrate.sh`` does (``TokenVelocityPolicy``, ``calibrate_peak_prefill``).
static
    N replicas from the first decision on, swept over N: the hindsight fleet.

Routing is the cluster's ``prefix-affinity`` (crc32(session) mod the serving replicas),
the same for all. TTFT = the simulator's modelled first-token time - arrival; a request
the engine rejects counts as missing the target. Replica-minutes integrate (ready +
starting + draining) replicas over the trace. The engine model is the simulator's
defaults (4 ms per step, 60 us per prefill token, 50 us per decoding sequence, 25 GB/s
PCIe, 256 seqs / 8192 batched tokens per step) on the trace's plan and GPU KV size;
replica k gets engine seed ``seed + k``.

``DelayedCluster`` adds the model load delay around the simulator's own classes (a
ReplicaSet-like spec.replicas with starting replicas; removal cancels starting replicas
first, then drains the newest) and runs the cluster with ``break_stalls`` (an
overloaded core preempts its youngest stalled request, counted in
``vllm:num_preemptions``). Two speed-ups that change nothing a policy reads: of the
latency histograms only the inter-token one (the throughput term's step time) is
observed, and the scraped text is cut to the families ``parse_metrics`` reads.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "engine"))
sys.path.insert(0, str(ROOT / "operator"))

from prometheus_client import generate_latest  # noqa: E402

from bench.autoscale_policies import (  # noqa: E402  (the policies and their bounds)
    DEFAULT_TARGET,
    INFLIGHT_TOKENS,
    INTERVAL,
    MIN_REPLICAS,
    SWEEP_TARGETS,
    OnsetPolicy,
    SpillwayPolicy,
    Tick,
    TokenVelocityPolicy,
    make_policy,
)
from bench.autoscale_traces import TRACES, Scenario  # noqa: E402
from spillway_cli.loadgen import percentile  # noqa: E402
from spillway_engine import metrics as m  # noqa: E402
from spillway_engine.simulator.cluster import Replica, VirtualCluster  # noqa: E402
from spillway_engine.simulator.core import (  # noqa: E402
    LatencyModel,
    SchedulerConfig,
    SimRequest,
)
from spillway_engine.simulator.plan_input import (  # noqa: E402
    SimPlan,
    gpu_blocks_for_tokens,
    load_plan,
)
from spillway_operator.flow.pressure import (  # noqa: E402
    FAMILIES,
)

ROUTING = "prefix-affinity"
#: The sample names of the families ``parse_metrics`` reads.
_SAMPLES = frozenset(f"{family}{suffix}" for family in FAMILIES
                     for suffix in ("", "_total", "_bucket", "_sum", "_count"))


class StepObserver:
    """The core's observer, lean: only vLLM's inter-token-latency histogram (the step
    time the throughput term learns from), accumulated in plain floats and moved into
    the replica's Prometheus histogram before each scrape, and the finished-requests
    counter (what a request costs, for the backlog). The exposition is what the full
    observer would write for those families; the other latency histograms, which no
    policy reads, are not observed at all."""

    __slots__ = ("bounds", "counts", "finished", "hist", "sum")

    def __init__(self, metrics) -> None:
        self.hist = metrics.h_itl
        self.finished = metrics.series(m.REQUEST_SUCCESS, "length")
        self.bounds = list(self.hist._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def on_token(self, req, itl: float | None) -> None:
        if itl is not None:
            self.sum += itl
            self.counts[bisect.bisect_left(self.bounds, itl)] += 1

    def on_finished(self, req) -> None:
        self.finished.inc()

    def flush(self) -> None:
        hist = self.hist
        if self.sum:
            hist._sum.inc(self.sum)
        for i, n in enumerate(self.counts):
            if n:
                hist._buckets[i].inc(n)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0


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
        # Only the step histogram is read (by the throughput term): observe it alone
        # (the gauges and counters the policies read are synced from the core).
        replica.core.observer = StepObserver(replica.metrics)
        return replica

    def scrape_lean(self, replica: Replica) -> str:
        """The replica's /metrics text, cut to the families ``parse_metrics`` reads
        (the parsed Sample is identical; writing and parsing every histogram is most of
        the cost of a scrape)."""
        observer = replica.core.observer
        if isinstance(observer, StepObserver):
            observer.flush()
        replica.metrics.sync()
        return generate_latest(replica.metrics.registry.restricted_registry(_SAMPLES)).decode()

    def inflight_tokens(self, replica: Replica) -> float:
        """llm-d's ``llm_d_epp_inflight_tokens`` for the replica: uncached prompt tokens
        dispatched to it and not yet prefilled. A request the engine admitted counts what
        it still has to compute; one still waiting counts its prompt less the share the
        replica's GPU and host tiers have served so far (the router's prefix-index
        estimate of the hit, which it makes before the engine looks)."""
        core = replica.core
        c = core.counters
        hit = (c.cached_device + c.cached_host) / c.prompt_tokens if c.prompt_tokens else 0.0
        total = 0.0
        for req in core.running:
            total += max(0, req.target - req.num_computed)
        for req in core.waiting:
            total += max(0, req.target - req.num_computed) if req.admitted \
                else req.prompt_len * (1.0 - hit)  # fmt: skip
        return total

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


_PLANS: dict[Path, SimPlan] = {}


def plan_of(scenario: Scenario) -> SimPlan:
    if scenario.plan_file not in _PLANS:
        _PLANS[scenario.plan_file] = load_plan(scenario.plan_file)
    return _PLANS[scenario.plan_file]


def run_policy(policy, scenario: Scenario, seed: int, *, gpu_blocks: int | None = None,
               latency: LatencyModel | None = None,
               scheduler: SchedulerConfig | None = None) -> Result:
    """One policy on one trace and seed. ``gpu_blocks``, ``latency`` and ``scheduler``
    replace the trace's GPU KV size and the simulator's engine defaults (the emulated
    fleet's replay sets them to its engines')."""
    start = time.perf_counter()
    duration = scenario.duration
    plan = plan_of(scenario)
    if isinstance(policy, SpillwayPolicy):
        # The operator learns the lead from its pods' start-ups (pressure.startup_seconds):
        # here every pod takes the trace's load delay.
        policy.policy = replace(policy.policy, lead_seconds=scenario.load_delay)
        policy.seed(plan)
    blocks = gpu_blocks or gpu_blocks_for_tokens(plan, scenario.gpu_kv_tokens)
    if isinstance(policy, TokenVelocityPolicy):
        policy.calibrate(scenario.plan_file, blocks)
    cluster = DelayedCluster(
        plan,
        load_delay=scenario.load_delay,
        replicas=MIN_REPLICAS,
        routing=ROUTING,
        gpu_blocks=blocks,
        latency=latency,
        scheduler=scheduler,
        seed=seed,
    )
    acc = {"t": 0.0, "n": cluster.occupied(), "rs": 0.0}
    by_phase = {name: 0.0 for name, _, _ in scenario.phases}

    def account(t: float) -> None:
        t = min(t, duration)
        if t > acc["t"]:
            acc["rs"] += acc["n"] * (t - acc["t"])
            for ph, lo, hi in scenario.phases:
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
            texts = {r.name: cluster.scrape_lean(r) + f"{INFLIGHT_TOKENS} "
                     f"{cluster.inflight_tokens(r)}\n" for r in cluster.serving}  # fmt: skip
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
    for item in scenario.items:
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
        offered=len(scenario.items),
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


def phase_of(scenario: Scenario, t: float) -> str:
    for ph, _lo, hi in scenario.phases:
        if t < hi:
            return ph
    return scenario.phases[-1][0]


def phase_table(results: list[Result], scenario: Scenario, target: float) -> list[str]:
    """Replica-minutes and the share of requests (by arrival) meeting the target, per phase."""
    names = [ph for ph, _, _ in scenario.phases]
    out = ["  " + f"{'policy':10}" + "".join(
        f" {ph + ' rep-min':>15} {ph + ' TTFT ok':>15}" for ph in names)]  # fmt: skip
    for res in results:
        cells = []
        for ph in names:
            sel = [r for r in res.requests if phase_of(scenario, r.arrival) == ph]
            ok = sum(1 for r in sel if r.ttft is not None and r.ttft <= target)
            cells.append(f" {res.phase_seconds[ph] / 60:>15.1f} {ok / max(1, len(sel)):>15.1%}")
        out.append(f"  {res.policy:10}" + "".join(cells))
    return out


def spillway_analysis(res: Result, scenario: Scenario) -> list[str]:
    """Which pressure component drove Spillway's decisions, per phase."""
    out = []
    keys = ("throughput", "load", "thrash", "queue", "preempt")
    drivers: Counter = Counter()
    for tk in res.ticks:
        if tk.replicas > tk.current:
            drivers[tk.term or "-"] += 1
    out.append(
        "  scale-ups by the term the decision named: "
        + (", ".join(f"{k} {n}" for k, n in drivers.most_common()) or "none")
    )
    for ph, _, _ in scenario.phases:
        sel = [tk for tk in res.ticks if tk.components and phase_of(scenario, tk.now) == ph]
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
    out.append("  scaling actions (the term the decision named):")
    for tk in res.ticks:
        if tk.replicas == tk.current:
            continue
        pressure = f"{tk.pressure:.2f}" if tk.pressure is not None else "-"
        out.append(f"    t={tk.now:6.0f} {phase_of(scenario, tk.now):6} {tk.current}->"
                   f"{tk.replicas} pressure {pressure:>5} [{tk.term or '-'}] {tk.reason}")
    last = next((tk.components for tk in reversed(res.ticks) if "servingPrefill" in
                 tk.components), None)
    if last:
        out.append(f"  serving rate learned: {last['servingPrefill']:.0f} prefill tokens/s, "
                   f"{last['servingDecode']:.0f} decode tokens/s at the KV's batch of "
                   f"{last['maxBatch']:.1f} (step {1e3 * last['s0']:.2f} ms + "
                   f"{1e6 * last['a']:.1f} us/prompt token + {1e6 * last['b']:.1f} us/sequence)")
    return out


def timeline_line(res: Result, scenario: Scenario, buckets: int = 24) -> str:
    """Requested replicas (ready+starting) at evenly spaced times."""
    out = []
    step = scenario.duration / buckets
    i = 0
    desired = MIN_REPLICAS
    for b in range(buckets):
        t = (b + 1) * step
        while i < len(res.timeline) and res.timeline[i][0] <= t:
            desired = res.timeline[i][1] + res.timeline[i][2]
            i += 1
        out.append(str(desired))
    return "".join(out)


# ----------------------------------------------------------------------------- sweep

LEVELS = (0.95, 0.99, 0.999)
DEFAULT_TTFT = 2.0
#: Traces whose users are promised another TTFT than DEFAULT_TTFT (Scenario.ttft_target).
TRACE_TTFT = {"longctx": 4.0}


def ttft_of(scenario: Scenario, asked: float | None) -> float:
    """The TTFT target a run is scored against: asked for, else the trace's own."""
    return asked or scenario.ttft_target or DEFAULT_TTFT


@functools.lru_cache(maxsize=4)
def scenario_of(trace: str, seed: int, duration: float | None) -> Scenario:
    build = TRACES[trace]
    return build(seed, duration) if duration else build(seed)


def _sweep_job(job: tuple[str, int, float | None, str, float, float]) -> dict:
    trace, seed, duration, name, target, ttft_target = job
    scenario = scenario_of(trace, seed, duration)
    res = run_policy(make_policy(name, target), scenario, seed)
    s = summarize(res, ttft_of(scenario, ttft_target))
    return {"trace": trace, "seed": seed, "policy": name, "target": target,
            "rm": round(s["rm"], 2), "met": s["met"], "p95": round(s["p95"], 3),
            "actions": res.actions, "wall": round(res.wall, 1)}  # fmt: skip


def points(rows: list[dict], trace: str) -> dict[tuple[str, float], dict]:
    """Per (policy, target) on one trace: the median replica-minutes and attainment over
    the seeds, and the worst seed's attainment."""
    by: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        if r["trace"] == trace:
            by.setdefault((r["policy"], r["target"]), []).append(r)
    return {
        key: {"rm": statistics.median(r["rm"] for r in rs),
              "met": statistics.median(r["met"] for r in rs),
              "worst": min(r["met"] for r in rs), "seeds": len(rs)}
        for key, rs in by.items()
    }  # fmt: skip


def cheapest(pts: dict[tuple[str, float], dict], policy: str, level: float
             ) -> tuple[float, dict] | None:  # fmt: skip
    """The policy's best-tuned target at ``level``: the fewest median replica-minutes
    among its targets whose median attainment reaches it."""
    ok = [(t, p) for (n, t), p in pts.items() if n == policy and p["met"] >= level]
    return min(ok, key=lambda tp: tp[1]["rm"]) if ok else None


def frontier_report(rows: list[dict], traces: list[str]) -> list[str]:
    out = []
    for trace in traces:
        pts = points(rows, trace)
        seeds = max((p["seeds"] for p in pts.values()), default=0)
        out.append(f"\n{trace} ({seeds} seeds; replica-minutes, median over seeds, of each "
                   "policy's best-tuned target reaching the median attainment; "
                   "[target; worst seed's attainment])")  # fmt: skip
        out.append(f"  {'policy':10}" + "".join(f"{f'>= {lv:.1%}':>24}" for lv in LEVELS))
        for name in SWEEP_TARGETS:
            cells = []
            for lv in LEVELS:
                best = cheapest(pts, name, lv)
                cells.append(f"{best[1]['rm']:>7.1f} [{best[0]:g}; {best[1]['worst']:.1%}]"
                             if best else "-")  # fmt: skip
            out.append(f"  {name:10}" + "".join(f"{c:>24}" for c in cells))
        default = pts.get(("spillway", DEFAULT_TARGET["spillway"]))
        if default:
            out.append(f"  spillway default (target {DEFAULT_TARGET['spillway']:g}, untuned): "
                       f"{default['rm']:.1f} replica-minutes, {default['met']:.2%} median, "
                       f"{default['worst']:.2%} worst seed")  # fmt: skip
        for lv in LEVELS:
            best = {n: cheapest(pts, n, lv) for n in SWEEP_TARGETS if n != "spillway"}
            reached = {n: b for n, b in best.items() if b}
            if not reached:
                continue
            rival = min(reached, key=lambda n: reached[n][1]["rm"])
            rrm = reached[rival][1]["rm"]
            if default and default["met"] >= lv:
                verdict = ("cheapest" if default["rm"] <= rrm else
                           f"{default['rm'] - rrm:+.1f} replica-minutes vs {rival}")
            else:
                verdict = "does not reach it"
            out.append(f"  at >= {lv:.1%}: best tuned baseline {rival} "
                       f"[{reached[rival][0]:g}] {rrm:.1f}; spillway default: {verdict}")
    return out


def one_setting_report(rows: list[dict], traces: list[str]) -> list[str]:
    """What a user deploys: one target for every trace. Per policy and level, the target
    whose median attainment reaches the level on all ``traces`` with the fewest
    replica-minutes in total (the sum of the per-trace medians)."""
    if len(traces) < 2:
        return []
    pts = {tr: points(rows, tr) for tr in traces}
    out = [f"\none setting for all of {', '.join(traces)} (replica-minutes summed over the "
           "traces, of each policy's cheapest target whose median attainment reaches the "
           "level on every trace)"]
    out.append(f"  {'policy':10}" + "".join(f"{f'>= {lv:.1%}':>24}" for lv in LEVELS))
    for name in SWEEP_TARGETS:
        cells = []
        for lv in LEVELS:
            ok = []
            for t in SWEEP_TARGETS[name]:
                got = [pts[tr].get((name, t)) for tr in traces]
                if all(g is not None and g["met"] >= lv for g in got):
                    ok.append((sum(g["rm"] for g in got), t))  # type: ignore[index]
            cells.append(f"{min(ok)[0]:>7.1f} [{min(ok)[1]:g}]" if ok else "-")
        out.append(f"  {name:10}" + "".join(f"{c:>24}" for c in cells))
    return out


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: N (seeds 0..N-1) or a comma-separated list (0,1,2,13,21)."""
    parts = [p for p in text.split(",") if p.strip()]
    if len(parts) == 1 and "," not in text:
        return list(range(int(parts[0])))
    return [int(p) for p in parts]


def _key(row: dict) -> tuple:
    return row["trace"], row["seed"], row["policy"], float(row["target"])


def run_sweep(args) -> int:
    traces = args.trace or list(TRACES)
    seeds = parse_seeds(args.seeds)
    jobs = [(tr, seed, args.duration, name, target, args.ttft_target)
            for tr in traces for seed in seeds
            for name, targets in SWEEP_TARGETS.items() if name in args.policies
            for target in targets]  # fmt: skip
    started = time.perf_counter()
    rows: list[dict] = []
    if args.from_rows:  # a saved sweep: report and plot it again
        rows = [r for r in json.loads(args.from_rows.read_text()) if r["trace"] in traces]
        traces = [t for t in traces if any(r["trace"] == t for r in rows)]
        jobs = []
    if args.reuse and not args.duration:
        # Rows of an earlier sweep (an interrupted one, or the baselines of an earlier
        # round, whose code has not changed): taken as they are, except for the
        # policies named by --rerun.
        rerun = {p for p in args.rerun.split(",") if p}
        old = {_key(r): r for path in args.reuse for r in json.loads(path.read_text())
               if r["policy"] not in rerun}
        wanted = {(tr, seed, name, float(target)) for tr, seed, _, name, target, _ in jobs}
        rows = [old[k] for k in wanted if k in old]
        jobs = [j for j in jobs if (j[0], j[1], j[3], float(j[4])) not in old]
        print(f"{len(rows)} runs taken from {', '.join(map(str, args.reuse))}", flush=True)
    print(f"{len(jobs)} runs on {args.jobs} process(es)", flush=True)
    with multiprocessing.get_context("fork").Pool(args.jobs, maxtasksperchild=40) as pool:
        for i, row in enumerate(pool.imap_unordered(_sweep_job, jobs)):
            rows.append(row)
            if args.verbose:
                print(f"  {row}", flush=True)
            if args.out and i % 10 == 9:  # an interrupted sweep resumes with --reuse
                args.out.write_text(json.dumps(rows, indent=0) + "\n")
    rows.sort(key=lambda r: (r["trace"], r["policy"], r["target"], r["seed"]))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=0) + "\n")
        print(f"wrote {args.out}")
    print("\n".join(frontier_report(rows, traces) + one_setting_report(rows, traces)))
    if args.png_dir:
        for trace in traces:
            path = args.png_dir / f"autoscale-{trace}.png"
            target = args.ttft_target or TRACE_TTFT.get(trace, DEFAULT_TTFT)
            write_frontier_png(points(rows, trace), trace, path, target)
            print(f"wrote {path}")
    print(f"\nsweep wall time {time.perf_counter() - started:.0f} s")
    return 0


def write_frontier_png(pts: dict[tuple[str, float], dict], trace: str, path: Path,
                       ttft_target: float) -> None:  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: write the file only
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("bench/autoscale --png-dir needs matplotlib: "
                         "pip install 'spillway[bench]'") from None
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    floor = 0.005  # % missed drawn for 0 (a log axis has no 0)
    for name in SWEEP_TARGETS:
        mine = sorted((p["rm"], max(100 * (1 - p["met"]), floor), t)
                      for (n, t), p in pts.items() if n == name)  # fmt: skip
        if not mine:
            continue
        line = ax.plot([m[0] for m in mine], [m[1] for m in mine], marker="o", label=name)[0]
        for rm, miss, t in mine:
            ax.annotate(f"{t:g}", (rm, miss), fontsize=7, textcoords="offset points",
                        xytext=(3, 3))
            if name == "spillway" and t == DEFAULT_TARGET["spillway"]:
                ax.plot([rm], [miss], marker="*", markersize=16, color=line.get_color(),
                        label="spillway default")
    ax.set_yscale("log")
    ax.invert_yaxis()  # better attainment higher up
    for level in LEVELS:
        ax.axhline(100 * (1 - level), color="grey", lw=0.6, ls="--")
        ax.annotate(f"{level:.1%}", (ax.get_xlim()[0], 100 * (1 - level)), fontsize=7,
                    color="grey", xytext=(2, 2), textcoords="offset points")
    ax.set_xlabel("replica-minutes (median over seeds)")
    ax.set_ylabel(f"requests missing TTFT <= {ttft_target:g} s (%, median; log)")
    ax.set_title(f"{trace}: each policy over its targets (labels), upper-left is better")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def run_one(scenario: Scenario, args) -> None:
    """Each policy at its default target on one trace: a table, phases, timelines."""
    args = argparse.Namespace(**{**vars(args), "ttft_target": ttft_of(scenario, args.ttft_target)})
    items = scenario.items
    print(f"trace {scenario.name}: {scenario.summary}; {len(items)} requests over "
          f"{scenario.duration:.0f} s, seed {args.seed}, plan "
          f"{scenario.plan_file.relative_to(ROOT)}, GPU KV {scenario.gpu_kv_tokens} tokens, "
          f"load {scenario.load_delay:g} s")  # fmt: skip
    chosen = [(n, args.targets.get(n, DEFAULT_TARGET[n]))
              for n in SWEEP_TARGETS if n in args.policies]
    results = [run_policy(make_policy(n, t), scenario, args.seed) for n, t in chosen]
    header = (
        f"{'policy':10} {'target':>6} {'replica-min':>11} "
        f"{'TTFT<=' + format(args.ttft_target, 'g') + 's':>10} {'p50 TTFT':>9} "
        f"{'p95 TTFT':>9} {'p99 TTFT':>9} {'actions':>7} {'max rep':>7} {'dev hit':>7} "
        f"{'host hit':>8} {'preempt':>7} {'wall s':>6}"
    )
    print(header)
    print("-" * len(header))
    for (_, target), res in zip(chosen, results, strict=True):
        s = summarize(res, args.ttft_target)
        print(f"{res.policy:10} {target:>6g} {s['rm']:>11.1f} {s['met']:>10.1%} "
              f"{s['p50']:>8.2f}s {s['p95']:>8.2f}s {s['p99']:>8.2f}s {res.actions:>7} "
              f"{res.max_replicas:>7} {res.device_hit_share:>7.1%} {res.host_hit_share:>8.1%} "
              f"{res.preemptions:>7} {res.wall:>6.1f}")  # fmt: skip
    print("\nper phase (requests by arrival time):")
    print("\n".join(phase_table(results, scenario, args.ttft_target)))
    print(f"\nreplicas asked for over time ({scenario.duration / 24:.0f} s per column):")
    for res in results:
        print(f"  {res.policy:10} {timeline_line(res, scenario)}")
    for res in results:
        if res.policy == "spillway":
            print("\nspillway pressure components (1.0 = at target):")
            print("\n".join(spillway_analysis(res, scenario)))
    if args.verbose:
        for res in results:
            print(f"\n{res.policy} decisions:")
            for tk in res.ticks:
                comps = " ".join(f"{k}={v:.2f}" for k, v in tk.components.items())
                print(f"  t={tk.now:7.0f} cur={tk.current} ready={tk.ready} "
                      f"starting={tk.starting} -> {tk.replicas}  {tk.reason}  {comps}")


def run_onset(args) -> int:
    """``--onset N``: the clairvoyant reaction's replica-minutes and attainment per seed."""
    for trace in args.trace or list(TRACES):
        for seed in parse_seeds(args.seeds):
            scenario = scenario_of(trace, seed, args.duration)
            res = run_policy(OnsetPolicy(args.onset, scenario), scenario, seed)
            target = ttft_of(scenario, args.ttft_target)
            s = summarize(res, target)
            print(f"{trace} seed {seed}: onset {args.onset} at "
                  f"{res.ticks[-1].reason.split()[-1]}: {s['rm']:.1f} replica-minutes, "
                  f"{s['met']:.2%} within {target:g} s")
            print("\n".join(phase_table([res], scenario, target)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="append", choices=list(TRACES),
                        help="a trace (repeatable; default: bursty, or all with --sweep)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default="5",
                        help="--sweep: N (seeds 0..N-1) or a list, e.g. 0,1,2,13,21")
    parser.add_argument("--duration", type=float, help="virtual seconds (default: the trace's)")
    parser.add_argument("--ttft-target", type=float,
                        help="modelled seconds (default: the trace's, 2 s unless it says)")
    parser.add_argument("--policies", default=",".join(SWEEP_TARGETS),
                        help="comma-separated subset of " + ",".join(SWEEP_TARGETS)
                        + "; name:target runs one at that target (not with --sweep)")
    parser.add_argument("--quick", action="store_true", help="a short run for CI smoke")
    parser.add_argument("--verbose", action="store_true", help="print every decision")
    parser.add_argument("--sweep", action="store_true",
                        help="every policy over its targets, every trace and seed")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, help="--sweep: write every run's row (JSON)")
    parser.add_argument("--png-dir", type=Path, help="--sweep: one frontier PNG per trace")
    parser.add_argument("--from-rows", type=Path,
                        help="--sweep: report (and plot) the rows an earlier --out wrote")
    parser.add_argument("--reuse", type=Path, action="append",
                        help="--sweep: take the runs an earlier --out holds instead of "
                        "running them again (repeatable), but for --rerun's policies")
    parser.add_argument("--onset", type=int, metavar="N",
                        help="the clairvoyant reaction (N replicas from the rise's first "
                        "second) on each --trace and --seeds seed: what no policy that "
                        "reacts can beat")
    parser.add_argument("--rerun", default="spillway",
                        help="--sweep --reuse: policies always run again (comma-separated; "
                        "default: spillway, whose code this round changes)")
    args = parser.parse_args(argv)
    # "hpa-kv:0.6": a policy at a target of its own (one run; the sweep sweeps them all)
    picked = [p.split(":", 1) for p in args.policies.split(",") if p]
    args.policies = [p[0] for p in picked]
    try:
        args.targets = {p[0]: float(p[1]) for p in picked if len(p) == 2}
    except ValueError:
        parser.error(f"--policies: a target is a number: {args.policies}")
    if unknown := set(args.policies) - set(SWEEP_TARGETS):
        parser.error(f"--policies: unknown {sorted(unknown)}; known: {', '.join(SWEEP_TARGETS)}")
    if args.quick:
        args.duration = args.duration or 600.0
    if args.onset:
        return run_onset(args)
    if args.sweep:
        return run_sweep(args)
    started = time.perf_counter()
    for trace in args.trace or ["bursty"]:
        run_one(scenario_of(trace, args.seed, args.duration), args)
        print()
    print(f"bench wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
