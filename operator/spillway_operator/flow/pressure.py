"""Offload pressure and the scaling decision: pure functions, no I/O.

Offload pressure (1.0 = at target) is computed per pod from two consecutive
scrapes of its /metrics and averaged over the ready pods:

    load     = vllm:kv_cache_usage_perc / 0.80
               (GPU KV held by running requests; cached-but-idle blocks count
               as free in vLLM, so this is live demand, not cache fill)
    thrash   = recomputed_share / 0.05, where recomputed_share =
               d(spillway_host_pool_thrash) * tokens_per_chunk / d(vllm:prompt_tokens)
               (prompt tokens recomputed because the host tier evicted a chunk that
               was asked for again: the KV working set outgrew GPU + host). With a
               disk tier under the host pool (spillway_disk_tier_budget_bytes > 0) a
               chunk the host evicted is still on disk, and what is recomputed is
               what the disk evicted: d(spillway_disk_tier_thrash) instead
    queue    = vllm:num_requests_waiting / max(1, vllm:num_requests_running) / 0.5
    preempt  = d(vllm:num_preemptions) / dt / 0.1   (preemptions per second)
    throughput = rho / 0.6, rho = the share of the replica's serving rate its demand
               (computed prompt + generated tokens per second) takes, the serving rate
               learned online from the pods' own counters and inter-token-latency
               histogram, seeded from the plan's GPU and model size (``throughput``)

    pressure = max(load, thrash, queue, preempt, throughput)

Each term is 1.0 at its own target, so "the worst constraint sets the replica
count", as Kubernetes' HPA does with several metrics. The event-rate terms (thrash,
preempt) are averaged over ``rate_half_life`` (120 s) before they count: a burst of
preemptions or re-misses in one interval (typically right after a scale change) is a
transient, a sustained rate a lack of capacity. Replicas recommended = the measured
pods x pressure / target: a ready pod without its second scrape (just started) counts
as idle, as the HPA counts pods without metrics when it scales up. Ahead of that, a
forecast: the trend of the demand (the throughput term's, else the KV load's) over the
last two minutes, extrapolated over the pods' own start-up time (creation to first
Ready, learned from the pods), asks for the replicas that demand will need when they
are ready -- only for growth past what the
fleet served before the trend began, so the end of a dip is not a ramp. Host pool fill alone is not
pressure (an LRU pool is always full once warm); the host-hit share of prompt
tokens is reported and guards scale-down: a scale-down that would drop more warm,
actually-hit host cache than the remaining replicas have free is delayed.

Samples that are missing, NaN or negative, counters that went backwards (a pod
restart), an inter-token histogram with missing or non-cumulative buckets, a mean step
time of 0, and time deltas that are not positive or are implausibly long (a clock
jump) make that pod's pressure unknown (``pod_reading`` says why); an unknown pod
never lets the autoscaler scale down and teaches the serving rate nothing.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field, replace
from datetime import datetime

from prometheus_client.parser import text_string_to_metric_families

from spillway_engine import metrics as m
from spillway_operator.flow.throughput import (
    TARGET_UTILISATION,
    BadCounters,
    Capacity,
    Rates,
    rates,
)

TARGET_GPU_KV = 0.80
TARGET_RECOMPUTED_SHARE = 0.05
TARGET_QUEUE_RATIO = 0.5
TARGET_PREEMPTIONS_PER_S = 0.1
MAX_RATE_TERM = 2.0
#: The requests already waiting are demand to clear within this many seconds (about
#: one model load) when the policy knows no start-up time of its own.
BACKLOG_DRAIN_SECONDS = 120.0
#: The queue term's cap (None: uncapped).
MAX_QUEUE_TERM: float | None = None

# The series read, by their catalogue entries (spillway_engine.metrics).
GAUGES = {
    m.KV_CACHE_USAGE_PERC.name: "gpu_kv",
    m.NUM_REQUESTS_WAITING.name: "waiting",
    m.NUM_REQUESTS_RUNNING.name: "running",
    m.HOST_POOL_USED_CHUNKS.name: "host_used_chunks",
    m.HOST_POOL_CAPACITY_CHUNKS.name: "host_capacity_chunks",
    m.HOST_POOL_CAPACITY_TOKENS.name: "host_capacity_tokens",
    m.HOST_POOL_TOKENS.name: "host_tokens",
    m.DISK_TIER_BUDGET_BYTES.name: "disk_budget_bytes",
}
COUNTERS = {
    m.PROMPT_TOKENS.name: "prompt_tokens",
    m.NUM_PREEMPTIONS.name: "preemptions",
    m.HOST_POOL_THRASH.name: "thrash_chunks",
    m.HOST_POOL_EVICTIONS.name: "evictions",
    m.DISK_TIER_THRASH.name: "disk_thrash_chunks",
    m.GENERATION_TOKENS.name: "generation_tokens",
    m.REQUEST_SUCCESS.name: "finished",
    # Not pressure: whether the disk tier's stores fail (disk_health).
    m.DISK_TIER_WRITE_FAILURES.name: "disk_write_failures",
    m.DISK_TIER_STORES.name: "disk_stores",
}
HOST_HITS = m.PROMPT_TOKENS_CACHED_BY_SOURCE.name
#: vllm:prompt_tokens_by_source{source="local_compute"}: prompt tokens computed here.
BY_SOURCE = m.PROMPT_TOKENS_BY_SOURCE.name
#: vLLM's inter-token latency histogram: the step time of the decoding batch.
STEP_HISTOGRAM = m.INTER_TOKEN_LATENCY_SECONDS.name
#: Every family ``parse_metrics`` reads (a scrape may be cut to these).
FAMILIES = frozenset(GAUGES) | frozenset(COUNTERS) | {HOST_HITS, BY_SOURCE, STEP_HISTOGRAM}


@dataclass(frozen=True)
class Sample:
    """One scrape of one pod: gauges and counters summed over engines."""

    time: float
    values: dict[str, float]


class MetricsError(ValueError):
    """A pod's /metrics body cannot be used; ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_metrics(text: str, now: float) -> Sample:
    """Parse Prometheus text; raises MetricsError on garbage."""
    values: dict[str, float] = {}
    buckets: dict[float, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name == STEP_HISTOGRAM:
                _read_histogram(family.samples, values, buckets)
                continue
            for s in family.samples:
                name = s.name.removesuffix("_total")
                key = GAUGES.get(name) or COUNTERS.get(name)
                if name == HOST_HITS and s.labels.get("source") in ("host", "device"):
                    key = f"{s.labels['source']}_hit_tokens"
                if name == BY_SOURCE and s.labels.get("source") == "local_compute":
                    key = "computed_tokens"
                if key is None or s.name.endswith("_created"):
                    continue
                values[key] = values.get(key, 0.0) + float(s.value)
    except Exception as exc:
        raise MetricsError("malformed", f"not Prometheus text ({type(exc).__name__}: "
                           f"{str(exc)[:120]})") from None
    if buckets or "step_count" in values:
        _check_histogram(values, buckets)
    return Sample(now, values)


def _read_histogram(samples, values: dict[str, float], buckets: dict[float, float]) -> None:
    """The step histogram's sum, count and cumulative buckets, summed over engines."""
    for s in samples:
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + float(s.value)
        elif s.name.endswith("_sum") or s.name.endswith("_count"):
            key = "step_sum" if s.name.endswith("_sum") else "step_count"
            values[key] = values.get(key, 0.0) + float(s.value)


def _check_histogram(values: dict[str, float], buckets: dict[float, float]) -> None:
    """Mark the sample when the step histogram cannot be trusted: no +Inf bucket, a count
    that is not the +Inf bucket's, buckets that are not cumulative. The number of finite
    buckets is kept, so a scrape that lost some (against the previous) shows too."""
    bounds = sorted(buckets)
    counts = [buckets[b] for b in bounds]
    cumulative = all(a <= b for a, b in itertools.pairwise(counts))
    ok = (bool(bounds) and bounds[-1] == math.inf and cumulative
          and math.isclose(buckets[math.inf], values.get("step_count", -1.0), abs_tol=0.5))
    values["step_buckets"] = float(len(bounds))
    if not ok:
        values["step_histogram_bad"] = 1.0


def parse_body(body: bytes, now: float) -> Sample:
    """A scraped /metrics body (bytes, as received) to a Sample; MetricsError otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MetricsError("not_utf8", f"body is not UTF-8 (byte {exc.start})") from None
    return parse_metrics(text, now)


@dataclass(frozen=True)
class PodPressure:
    pressure: float
    components: dict[str, float]
    warm_tokens: float  # host-pool tokens weighted by how much of them is being hit
    free_host_tokens: float


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v >= 0


@dataclass(frozen=True)
class Unmeasured:
    """Why a pod has no pressure this interval: ``reason`` is a short label; ``bad``
    when its metrics are wrong (not merely new: a first scrape, a stale previous one)."""

    reason: str
    message: str = ""
    bad: bool = False


def pod_pressure(prev: Sample | None, cur: Sample, max_dt: float,
                 capacity: Capacity | None = None) -> PodPressure | None:
    """Pressure of one pod between two scrapes, or None when it cannot be trusted."""
    got = pod_reading(prev, cur, max_dt, capacity)
    return got if isinstance(got, PodPressure) else None


def _capped(value: float, cap: float | None) -> float:
    return value if cap is None else min(value, cap)


def pod_rates(prev: Sample | None, cur: Sample, max_dt: float) -> Rates | Unmeasured:
    """What the pod served between the scrapes (``throughput.rates``), or why not."""
    if prev is None:
        return Unmeasured("first_scrape", "no previous scrape yet")
    if not (0 < cur.time - prev.time <= max_dt):
        return Unmeasured("stale", "the previous scrape is too old (or a clock jump)")
    try:
        got = rates(prev.time, prev.values, cur.time, cur.values)
    except BadCounters as exc:
        return Unmeasured(exc.reason, str(exc), bad=True)
    return got if got is not None else Unmeasured("no_token_counters", "no token counters")


def pod_reading(prev: Sample | None, cur: Sample, max_dt: float,
                capacity: Capacity | None = None,
                drain_seconds: float = BACKLOG_DRAIN_SECONDS) -> PodPressure | Unmeasured:
    """Pressure of one pod between two scrapes, or why it has none. With ``capacity``
    (the deployment's learned serving rate) the throughput term is one of the terms:
    what the pod served and what waits (``Capacity.backlog``, the queue cleared within
    ``drain_seconds``) against what a replica can serve."""
    if prev is None:
        return Unmeasured("first_scrape", "no previous scrape yet")
    dt = cur.time - prev.time
    if not (0 < dt <= max_dt):
        return Unmeasured("stale", "the previous scrape is too old (or a clock jump)")
    v, p = cur.values, prev.values
    needed = ("gpu_kv", "waiting", "running", "prompt_tokens", "preemptions")
    missing = [k for k in needed if not _finite(v.get(k))]
    if missing:
        return Unmeasured("not_a_number", f"{', '.join(missing)} missing or not a number",
                          bad=True)
    deltas = {}
    # the lowest tier decides what is recomputed: the disk when there is one
    thrash = "disk_thrash_chunks" if v.get("disk_budget_bytes", 0.0) > 0 else "thrash_chunks"
    for key in ("prompt_tokens", "preemptions", thrash, "host_hit_tokens"):
        a, b = p.get(key, 0.0), v.get(key, 0.0)
        if not (_finite(a) and _finite(b)):
            return Unmeasured("not_a_number", f"{key} is not a number", bad=True)
        if b < a:  # the pod restarted; wait for a clean pair
            return Unmeasured("counter_reset", f"{key} went backwards ({a:g} -> {b:g}): "
                              "the engine restarted", bad=True)
        deltas[key] = b - a
    served = pod_rates(prev, cur, max_dt)
    if isinstance(served, Unmeasured) and served.bad:
        return served
    cap_chunks = v.get("host_capacity_chunks", 0.0)
    cap_tokens = v.get("host_capacity_tokens", 0.0)
    tokens_per_chunk = cap_tokens / cap_chunks if cap_chunks > 0 else 0.0
    prompt = deltas["prompt_tokens"]
    recomputed = deltas[thrash] * tokens_per_chunk / prompt if prompt > 0 else 0.0
    host_share = deltas["host_hit_tokens"] / prompt if prompt > 0 else 0.0
    components = {
        "load": v["gpu_kv"] / TARGET_GPU_KV,
        # Event-rate terms are capped: alone, they may at most double the replicas
        # per decision (they grow much faster than the excess demand behind them).
        "thrash": min(recomputed / TARGET_RECOMPUTED_SHARE, MAX_RATE_TERM),
        # One request waiting for a moment is not a queue.
        "queue": _capped(max(0.0, v["waiting"] - 1) / max(1.0, v["running"])
                         / TARGET_QUEUE_RATIO, MAX_QUEUE_TERM),
        "preempt": min(deltas["preemptions"] / dt / TARGET_PREEMPTIONS_PER_S, MAX_RATE_TERM),
    }
    info: dict[str, float] = {}
    if capacity is not None and isinstance(served, Rates):
        rho = capacity.utilisation(served)
        backlog = capacity.backlog(p["waiting"], v["waiting"], dt, drain_seconds) \
            if _finite(p.get("waiting")) else 0.0  # fmt: skip
        demand = max(0.0, rho + backlog)
        components["throughput"] = demand / TARGET_UTILISATION
        info["demandTokensPerSecond"] = served.tokens * (demand / rho if rho > 0 else 1.0)
        info["backlogShare"] = max(0.0, backlog) / demand if demand > 0 else 0.0
    host_tokens = v.get("host_tokens", 0.0) if _finite(v.get("host_tokens")) else 0.0
    fill = v.get("host_used_chunks", 0.0) / cap_chunks if cap_chunks > 0 else 0.0
    info |= {"hostHitShare": min(host_share, 1.0), "hostFill": min(max(fill, 0.0), 1.0)}
    return PodPressure(
        pressure=max(components.values()),
        components={**components, **info},
        warm_tokens=host_tokens * min(host_share, 1.0),
        # An LRU pool is always full; what it can take in is everything but its hot part.
        free_host_tokens=max(0.0, cap_tokens - host_tokens * min(host_share, 1.0)),
    )


@dataclass(frozen=True)
class Aggregate:
    pressure: float | None  # None: no pod could be measured
    components: dict[str, float]
    measured: int
    unknown: int
    warm_tokens: list[float] = field(default_factory=list)
    free_host_tokens: list[float] = field(default_factory=list)


def aggregate(pods: list[PodPressure | Unmeasured | None]) -> Aggregate:
    known = [p for p in pods if isinstance(p, PodPressure)]
    if not known:
        return Aggregate(None, {}, 0, len(pods))
    keys = dict.fromkeys(k for p in known for k in p.components)
    comps = {}
    for k in keys:
        have = [p.components[k] for p in known if k in p.components]
        comps[k] = sum(have) / len(have)
    return Aggregate(
        pressure=sum(p.pressure for p in known) / len(known),
        components={k: round(v, 3) for k, v in comps.items()},
        measured=len(known),
        unknown=len(pods) - len(known),
        warm_tokens=[p.warm_tokens for p in known],
        free_host_tokens=[p.free_host_tokens for p in known],
    )


# ---------------------------------------------------------------- decision


@dataclass(frozen=True)
class Policy:
    min_replicas: int = 1
    max_replicas: int = 4
    target: float = 1.0
    tolerance: float = 0.1
    scale_up_window: float = 0.0
    scale_down_window: float = 300.0
    max_scale_up_pods: int = 4
    max_scale_up_percent: float = 100.0
    max_scale_down_pods: int = 1
    # A warm-cache delay never holds a scale-down longer than this many windows.
    warm_cache_max_delay_windows: float = 3.0
    # Forecast across a model load: scale for the demand expected ``lead_seconds`` from
    # now (the trend of the last ``forecast_window`` seconds, rising trends only), so
    # the pods asked for now are ready when the demand arrives. 0: react only.
    lead_seconds: float = 0.0
    forecast_window: float = 120.0
    # Event-rate terms (thrash, preempt) are averaged with this half-life (seconds): a
    # burst of preemptions or of re-misses right after a scale change is a transient,
    # a sustained rate is a lack of capacity. 0: each interval on its own.
    rate_half_life: float = 120.0
    # What the pods showed of their serving rate (the throughput term's step cost) counts
    # half after this many seconds (throughput.learn).
    serving_rate_half_life: float = 1800.0


@dataclass(frozen=True)
class State:
    recommendations: tuple[tuple[float, int], ...] = ()
    warm_hold_since: float | None = None
    # When this autoscaler first saw pressure: a scale-down needs a whole window of
    # low recommendations, also right after the operator (re)starts.
    observing_since: float | None = None
    # (time, demand in replicas at target pressure) of the recent readings: the trend
    # the forecast extrapolates.
    demand: tuple[tuple[float, float], ...] = ()
    # (time, averaged thrash term, averaged preempt term) at the last reading.
    rates: tuple[float, float, float] | None = None


def resume_state(now: float, current: int) -> State:
    """The windows of an autoscaler that starts (or takes over as the new leader) at
    ``now`` with ``current`` replicas: they hold the observed replica count as if it had
    been recommended now. So a scale-up window still waits its full length after a
    failover, and what the previous leader decided (visible as ``current``) is not
    decided again from an empty history. Observation itself starts at the first
    reading (``_remember``): a scale-down needs a whole window of readings by this
    autoscaler, so the first window after a start or a failover never scales down."""
    return State(recommendations=((now, current),))


@dataclass(frozen=True)
class Decision:
    replicas: int
    action: str  # "scale-up", "scale-down", "hold"
    reason: str
    state: State
    # The term behind the replica count: one of TERMS, "forecast:<term>" (the trend of
    # that term's demand asked for more), "bounds" (min/max replicas) or "" (no reading).
    term: str = ""


#: The pressure terms, in the order a tie names them.
TERMS = ("throughput", "load", "queue", "thrash", "preempt")


def decide(policy: Policy, now: float, current: int, ready: int, starting: int,
           agg: Aggregate, state: State) -> Decision:
    """The replica count for this interval; ``current`` is spec.replicas."""
    bounded = min(max(current, policy.min_replicas), policy.max_replicas)
    if bounded != current:
        return Decision(bounded, "scale-up" if bounded > current else "scale-down",
                        f"replicas {current} outside [{policy.min_replicas}, "
                        f"{policy.max_replicas}]", state, "bounds")
    if agg.pressure is None:
        return Decision(current, "hold", "MetricsUnavailable: no ready pod has fresh, valid "
                        "metrics; never scaling down without them", state)
    state, terms = _smoothed(policy, now, agg, state)
    pressure = max(terms.values())
    term = max(TERMS, key=lambda k: terms.get(k, -1.0))
    agg = replace(agg, pressure=pressure)
    ratio = pressure / policy.target
    # Ready pods without a reading yet (just started) count as idle, as the HPA counts
    # pods without metrics when it scales up: taking them at the busy pods' mean
    # scaled up again right after each scale-up (they scale nothing down: unknown).
    measured = agg.measured if agg.measured > 0 else ready
    raw = _recommend(policy, current, measured, ratio)
    # The trend is that of the demand: the throughput term's (what the pods served over
    # the interval, against what they can serve), else the KV held by running requests
    # (the load term). The event and queue terms spike and clear within an interval,
    # extrapolated they explode.
    base = "throughput" if "throughput" in terms else "load"
    demand = terms.get(base, pressure)
    state, ahead = _forecast(policy, now, max(measured, 1) * demand / policy.target, state)
    why = f"pressure {agg.pressure:.2f} above target {policy.target:.2f} ({term})"
    # A forecast is less sure than a reading: it asks for a pod only past the tolerance.
    wanted = math.ceil(ahead * (1.0 - policy.tolerance) - 1e-9)
    # What the served demand needs (the throughput term only: what the pods served
    # against what they can serve; KV held and queues wait for the starting pods).
    needed = max(_recommend(policy, current, measured, demand / policy.target), wanted) \
        if base == "throughput" else 0
    if wanted > raw:
        raw = min(wanted, policy.max_replicas)
        term = f"forecast:{base}"
        why = (f"demand rising: {ahead:.1f} replicas at target expected in "
               f"{policy.lead_seconds:.0f}s ({base}; pressure {agg.pressure:.2f})")
    state = _remember(policy, now, raw, state)
    if raw > current:
        d = _scale_up(policy, now, current, starting, agg, state, why, needed)
    elif raw < current:
        d = _scale_down(policy, now, current, agg, state, term)
    else:
        d = _hold(policy, current, ratio, agg, state, term)
    return replace(d, term=term)


def _recommend(policy: Policy, current: int, ready: int, ratio: float) -> int:
    """The replicas that would bring pressure to target, within the bounds."""
    if abs(ratio - 1.0) <= policy.tolerance:
        raw = current
    else:
        raw = math.ceil(max(ready, 1) * ratio - 1e-9)
    return min(max(raw, policy.min_replicas), policy.max_replicas)


RATE_TERMS = ("thrash", "preempt")


def _smoothed(policy: Policy, now: float, agg: Aggregate, state: State
              ) -> tuple[State, dict[str, float]]:  # fmt: skip
    """The terms, with the event-rate ones averaged over ``rate_half_life``."""
    c = agg.components
    terms = {k: c[k] for k in TERMS if k in c}
    if not terms:  # an aggregate without terms: its pressure stands for them
        return state, {"load": agg.pressure}
    if policy.rate_half_life <= 0 or not all(k in c for k in ("load", "queue", *RATE_TERMS)):
        return state, terms
    new = [c[k] for k in RATE_TERMS]
    if state.rates is not None and now > state.rates[0]:
        keep = 0.5 ** ((now - state.rates[0]) / policy.rate_half_life)
        new = [keep * old + (1 - keep) * v for old, v in zip(state.rates[1:], new, strict=True)]
    state = replace(state, rates=(now, *new))
    return state, {**terms, **dict(zip(RATE_TERMS, new, strict=True))}


def trend(points: tuple[tuple[float, float], ...]) -> float:
    """Least-squares slope (per second) of (time, value) points; 0 for fewer than 3."""
    if len(points) < 3:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var if var > 0 else 0.0


def _forecast(policy: Policy, now: float, demand: float, state: State
              ) -> tuple[State, float]:  # fmt: skip
    """Record this reading's demand (replicas at target pressure) and return the demand
    the rising trend expects ``lead_seconds`` ahead (0 without a forecast)."""
    if policy.lead_seconds <= 0:
        return state, 0.0
    keep = max(policy.forecast_window, policy.scale_down_window)
    history = tuple((t, d) for t, d in state.demand if now - t <= keep)
    state = replace(state, demand=(*history, (now, demand)))
    # Only growth past what the fleet served before the trend's window is extrapolated:
    # the end of a dip, a return to a level seen minutes ago, is not a ramp.
    older = [d for t, d in history if now - t > policy.forecast_window]
    if older and demand <= max(older):
        return state, 0.0
    recent = tuple(p for p in state.demand if now - p[0] <= policy.forecast_window)
    if now - recent[0][0] < 0.75 * policy.forecast_window:
        return state, 0.0  # too short a history for a trend (a start, a failover)
    slope = trend(recent)
    return state, (demand + slope * policy.lead_seconds if slope > 0 else 0.0)


def _remember(policy: Policy, now: float, raw: int, state: State) -> State:
    """Add this recommendation; forget those older than both windows."""
    history = tuple((t, r) for t, r in state.recommendations
                    if now - t <= max(policy.scale_down_window, policy.scale_up_window))
    since = state.observing_since if state.observing_since is not None else now
    return replace(state, recommendations=(*history, (now, raw)), observing_since=since)


def _window(state: State, now: float, seconds: float) -> list[int]:
    return [r for t, r in state.recommendations if now - t <= seconds]


def _scale_up(policy: Policy, now: float, current: int, starting: int, agg: Aggregate,
              state: State, why: str, demand: int = 0) -> Decision:
    """``demand``: the replicas the throughput term (and its forecast) asks for. While
    pods start, only it may scale up further: ``current`` already counts the starting
    pods, so a served demand beyond it is demand they will not serve either; the other
    terms, which the starting pods will relieve, wait for them."""
    in_up = _window(state, now, policy.scale_up_window)
    target = min(in_up) if in_up else state.recommendations[-1][1]
    if target <= current:
        return Decision(current, "hold", "scale-up stabilizing", state)
    if starting > 0:
        if demand <= current:
            return Decision(current, "hold", f"waiting for {starting} starting pod(s) before "
                            "scaling up again", state)
        target = min(target, demand)
    step = max(policy.max_scale_up_pods, math.ceil(current * policy.max_scale_up_percent / 100))
    return Decision(min(target, current + step), "scale-up", why,
                    replace(state, warm_hold_since=None))


def _scale_down(policy: Policy, now: float, current: int, agg: Aggregate,
                state: State, term: str = "") -> Decision:
    if agg.unknown:
        return Decision(current, "hold", f"MetricsUnavailable: {agg.unknown} pod(s) without "
                        "fresh metrics; not scaling down", state)
    target = max(_window(state, now, policy.scale_down_window))
    since = now if state.observing_since is None else state.observing_since
    if target >= current or now - since < policy.scale_down_window:
        return Decision(current, "hold", "scale-down stabilizing "
                        f"({policy.scale_down_window:.0f}s window)", state)
    target = max(target, current - policy.max_scale_down_pods)
    removed = current - target
    dropped = sum(sorted(agg.warm_tokens, reverse=True)[:removed])
    absorbable = sum(sorted(agg.free_host_tokens)[: max(0, len(agg.free_host_tokens) - removed)])
    if dropped > absorbable:
        held = state.warm_hold_since if state.warm_hold_since is not None else now
        if now - held < policy.warm_cache_max_delay_windows * policy.scale_down_window:
            return Decision(current, "hold", f"WarmCacheGuard: scaling down would drop "
                            f"{dropped:.0f} hot host-cache tokens, the rest can absorb "
                            f"{absorbable:.0f}", replace(state, warm_hold_since=held))
    return Decision(target, "scale-down", f"pressure {agg.pressure:.2f} below target "
                    f"{policy.target:.2f} ({term})", replace(state, warm_hold_since=None))


def _hold(policy: Policy, current: int, ratio: float, agg: Aggregate, state: State,
          term: str = "") -> Decision:
    if ratio > 1.0 + policy.tolerance and current >= policy.max_replicas:
        reason = f"pressure {agg.pressure:.2f} above target, at maxReplicas {current} ({term})"
    elif ratio < 1.0 - policy.tolerance and current <= policy.min_replicas:
        reason = f"pressure {agg.pressure:.2f} below target, at minReplicas {current} ({term})"
    else:
        reason = f"pressure {agg.pressure:.2f} within tolerance ({term})"
    return Decision(current, "hold", reason, replace(state, warm_hold_since=None))


# ---------------------------------------------------------------- how long a new pod takes

#: Start-ups longer than this are a pod that was stuck, not a model load.
MAX_LEAD_SECONDS = 1800.0


def startup_seconds(pods: list[tuple[str | None, str | None]]) -> float:
    """The forecast's lead: how long this deployment's pods took from creation to their
    first Ready (``(creationTimestamp, Ready lastTransitionTime)`` of pods that never
    restarted; RFC 3339), the median of those known, 0 when none is (no forecast).
    Scheduling, image pull and model load: what a pod asked for now needs before it
    serves."""
    took = []
    for created, ready_at in pods:
        try:
            dt = (datetime.fromisoformat(str(ready_at).replace("Z", "+00:00"))
                  - datetime.fromisoformat(str(created).replace("Z", "+00:00"))).total_seconds()
        except ValueError:
            continue
        if 0 <= dt <= MAX_LEAD_SECONDS:
            took.append(dt)
    return statistics.median(took) if took else 0.0


# ---------------------------------------------------------------- which pods a scale-down takes

# The ReplicaSet controller deletes, among equally ready pods, those with the lowest cost
# first (PodDeletionCost, on by default since Kubernetes 1.22); absent means 0.
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# Set with the cost on each pod chosen for removal: routers send it no new requests.
DRAINING = "spillway.dev/draining"
_INT32 = 2**31


def hot_host_tokens(hot: float, prev: Sample | None, cur: Sample, tau: float) -> float:
    """A pod's recent host-tier hits: prompt tokens served from its host pool, decayed
    with time constant ``tau`` seconds, updated from one pair of scrapes. An idle pod
    keeps (a decaying) record of what its host tier served, so the hottest cache is
    still known when the load has gone and the autoscaler scales down."""
    if prev is None:
        return hot
    dt = cur.time - prev.time
    a, b = prev.values.get("host_hit_tokens", 0.0), cur.values.get("host_hit_tokens", 0.0)
    if not (dt > 0 and _finite(a) and _finite(b)):
        return hot
    if b < a:
        return b  # restarted: the cache it had is gone, only what it served since counts
    decay = math.exp(-dt / tau) if tau > 0 else 0.0
    return hot * decay + (b - a)


@dataclass(frozen=True)
class Candidate:
    """A live (not terminating) pod, as the scale-down choice sees it."""

    name: str
    ready: bool
    hot: float = 0.0  # hot_host_tokens
    host_tokens: float = 0.0  # tokens held in its host pool now
    created: str = ""  # creationTimestamp: RFC 3339 in UTC sorts as time does
    marked: bool = False  # already carries our draining mark (a scale-down in flight)
    #: a LeaderWorkerSet group's leader: its group index (None: a Deployment's pod)
    group: int | None = None


def choose_removals(pods: list[Candidate], remove: int) -> list[str]:
    """The ready pods to mark for a scale-down that takes ``remove`` of ``pods``.

    The ReplicaSet controller removes unready pods before it looks at deletion costs,
    so each unready pod takes one of the places and is not marked. Then pods already
    marked (still going), then the least hot host cache, the emptiest host pool, the
    newest pod (the controller's own preference), and the name, so the choice is stable.

    A LeaderWorkerSet knows no deletion cost: it removes the groups of the highest
    indices, ready or not, so those leaders are the ones marked (to drain), whatever
    their cache holds."""
    if any(p.group is not None for p in pods):
        going = sorted(pods, key=lambda p: (p.group if p.group is not None else -1, p.name),
                       reverse=True)[:max(0, remove)]
        return [p.name for p in going if p.ready]
    take = max(0, min(remove, len(pods)) - sum(1 for p in pods if not p.ready))
    ready = sorted((p for p in pods if p.ready), key=lambda p: p.name)
    ready.sort(key=lambda p: p.created, reverse=True)
    ready.sort(key=lambda p: (not p.marked, p.hot, p.host_tokens))
    return [p.name for p in ready[:take]]


def parse_cost(value: str | None) -> int:
    """A pod-deletion-cost annotation as the ReplicaSet controller reads it (absent or
    invalid: 0)."""
    try:
        cost = int(str(value).strip()) if value is not None else 0
    except ValueError:
        return 0
    return cost if -_INT32 <= cost < _INT32 else 0


def removal_cost(kept: list[int]) -> int:
    """A deletion cost below every kept pod's (their own, or 0 without one)."""
    return max(min([0, *kept]) - 1, -_INT32)


def stale_marks(marked: list[str], live: int, replicas: int,
                chosen: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Live pods carrying our draining mark that must lose it. A scale-down in flight
    (more live pods than ``replicas``) keeps as many marks as pods are still to go,
    those just ``chosen`` first; any other mark is stale: the scale write failed, the
    decision was reversed, someone scaled up. No live pod stays marked for good."""
    budget = max(0, live - replicas)
    order = [*chosen, *sorted(set(marked) - set(chosen))]
    return [m for m in order[budget:] if m in marked and m not in chosen]
