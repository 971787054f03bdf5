"""The autoscaling policies bench.autoscale compares, each deciding from what it would
scrape: Spillway's own (the operator's ``flow.pressure`` code, unchanged), the HPA on a
gauge, a Dynamo-style threshold planner, llm-d's token velocity, a static fleet, and the
clairvoyant onset oracle. Split from bench/autoscale.py, which runs and scores them.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.autoscale_traces import Scenario
from spillway_engine.simulator.core import EngineCore
from spillway_engine.simulator.plan_input import SimPlan, load_plan
from spillway_operator.flow.pressure import (
    BACKLOG_DRAIN_SECONDS,
    Aggregate,
    Policy,
    Rates,
    Sample,
    State,
    aggregate,
    decide,
    parse_metrics,
    pod_rates,
    pod_reading,
)
from spillway_operator.flow.throughput import (
    capacity,
    learn,
    learner,
    params_from_name,
    seed_cost,
)

MIN_REPLICAS, MAX_REPLICAS = 1, 8
INTERVAL = 15.0  # s between autoscaler decisions (HPA default sync period)
SCALE_DOWN_WINDOW = 300.0
TOLERANCE = 0.1

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
    term: str = ""


class SpillwayPolicy:
    """The operator's own autoscaler: ``parse_metrics`` -> the serving rate learned from
    every pod (``throughput.learn``) -> ``pod_reading`` per ready pod -> ``aggregate`` ->
    ``decide``, with the CRD's defaults unless ``target`` is given. The serving rate is
    seeded as the operator seeds it, from the plan's GPU and the model's size
    (``seed``: set by ``run_policy`` from the trace's plan)."""

    name = "spillway"

    def __init__(self, target: float | None = None, **overrides) -> None:
        base = Policy(min_replicas=MIN_REPLICAS, max_replicas=MAX_REPLICAS)
        self.policy = replace(base, **({"target": target} if target else {}), **overrides)
        self.max_dt = 3 * INTERVAL + 3.0  # as the operator's autoscaler
        self.samples: dict[str, Sample] = {}
        self.state = State()
        self.learner = None

    def seed(self, plan: SimPlan) -> None:
        params = params_from_name(plan.model_name)
        per_gpu = params / plan.tensor_parallel_size if params else None
        self.learner = learner(seed_cost(plan.plan.gpu.name, per_gpu))

    def tick(self, now: float, texts: dict[str, str], current: int, starting: int) -> Tick:
        cur = {name: parse_metrics(text, now) for name, text in texts.items()}
        cap = None
        if self.learner is not None:
            served = [pod_rates(self.samples.get(n), s, self.max_dt) for n, s in cur.items()]
            self.learner = learn(self.learner, now, [r for r in served if isinstance(r, Rates)],
                                 self.policy.serving_rate_half_life)
            cap = capacity(self.learner)
        drain = self.policy.lead_seconds or BACKLOG_DRAIN_SECONDS
        pods = [pod_reading(self.samples.get(n), s, self.max_dt, cap, drain)
                for n, s in cur.items()]
        self.samples = cur
        agg: Aggregate = aggregate(pods)
        d = decide(self.policy, now, current, len(texts), starting, agg, self.state)
        self.state = d.state
        comps = dict(agg.components)
        if cap is not None:
            comps |= {"servingPrefill": cap.prefill_tokens_per_s,
                      "servingDecode": cap.decode_tokens_per_s, "maxBatch": cap.max_batch,
                      "s0": cap.cost.step_s, "a": cap.cost.prefill_s, "b": cap.cost.decode_s}
        return Tick(now, current, len(texts), starting, d.replicas, d.reason, comps,
                    agg.pressure, d.term)


def _gauge(key: str) -> Callable[[dict[str, float]], float]:
    return lambda v: v.get(key, 0.0)


class HpaPolicy:
    """Kubernetes' HPA (autoscaling/v2, default behavior) on one per-pod metric:
    desired = ceil(ready * mean / target), the 10 % tolerance, pods still starting
    counted as 0 when scaling up and ignored when scaling down, scale-down stabilization
    300 s, scale-up by max(4 pods, 100 %) per 15 s. A KEDA ScaledObject is this HPA on
    its query (an AverageValue target)."""

    def __init__(self, name: str, metric: Callable[[dict[str, float]], float],
                 target: float, label: str) -> None:  # fmt: skip
        self.name, self.metric, self.target, self.label = name, metric, target, label
        self.history: list[tuple[float, int]] = []

    def _raw(self, values: list[float], current: int, starting: int) -> int:
        if not values:
            return current  # no metrics: the HPA does nothing
        ratio = sum(values) / len(values) / self.target
        if starting == 0:
            if abs(1.0 - ratio) <= TOLERANCE:
                return current
            return math.ceil(ratio * len(values))
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
        values = [self.metric(parse_metrics(t, now).values) for t in texts.values()]
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
                    f"avg {self.label} {avg:.2f} -> raw {raw}")  # fmt: skip


class DynamoPolicy:
    """Dynamo's load-based planner as its documentation describes it (decode KV
    utilisation and prefill queue thresholds, one replica per adjustment interval),
    with the prefix hit rate as a brake: KV utilisation above ``target`` or more than
    0.5 waiting per replica adds one replica; utilisation below ``target`` - 0.4 and
    under 0.2 waiting per replica removes one, unless the fleet's prefix hit rate
    (GPU + host hits over prompt tokens) fell below 80 % of its running mean in the
    last interval (a fleet that is losing its cache is not shrunk). One adjustment per
    ``ADJUST`` seconds, none while a replica is starting."""

    ADJUST = 60.0

    def __init__(self, target: float) -> None:
        self.name, self.target = "dynamo", target
        self.last_adjust = -math.inf
        self.prev: dict[str, Sample] = {}
        self.hit_mean: float | None = None

    def tick(self, now: float, texts: dict[str, str], current: int, starting: int) -> Tick:
        cur = {n: parse_metrics(t, now) for n, t in texts.items()}
        kv = [s.values.get("gpu_kv", 0.0) for s in cur.values()]
        waiting = [s.values.get("waiting", 0.0) for s in cur.values()]
        prompt = hits = 0.0
        for n, s in cur.items():
            p = self.prev.get(n)
            if p is not None:
                prompt += s.values.get("prompt_tokens", 0.0) - p.values.get("prompt_tokens", 0.0)
                hits += (s.values.get("device_hit_tokens", 0.0)
                         - p.values.get("device_hit_tokens", 0.0)
                         + s.values.get("host_hit_tokens", 0.0)
                         - p.values.get("host_hit_tokens", 0.0))  # fmt: skip
        self.prev = cur
        hit = hits / prompt if prompt > 0 else None
        cold = hit is not None and self.hit_mean is not None and hit < 0.8 * self.hit_mean
        if hit is not None:
            self.hit_mean = hit if self.hit_mean is None else 0.9 * self.hit_mean + 0.1 * hit
        if not kv or starting or now - self.last_adjust < self.ADJUST:
            return Tick(now, current, len(texts), starting, current, "hold")
        mkv, mq = sum(kv) / len(kv), sum(waiting) / len(waiting)
        n = current
        if mkv > self.target or mq > 0.5:
            n = current + 1
        elif mkv < self.target - 0.4 and mq < 0.2 and not cold:
            n = current - 1
        n = min(max(n, MIN_REPLICAS), MAX_REPLICAS)
        if n != current:
            self.last_adjust = now
        return Tick(now, current, len(texts), starting, n,
                    f"kv {mkv:.2f} waiting {mq:.2f} hit {hit if hit is not None else -1:.2f}")


INFLIGHT_TOKENS = "llm_d_epp_inflight_tokens"
#: llm-d's calibration: prompts of --max-num-batched-tokens tokens (vLLM's chunk), one
#: at a time on an idle replica, cache misses; V_P = CHUNK_SIZE / median(TTFT).
CALIBRATION_CHUNK = 8192
CALIBRATION_REQUESTS = 5


@functools.lru_cache(maxsize=8)
def calibrate_peak_prefill(plan_file: Path, gpu_blocks: int, seed: int = 0) -> float:
    """``peakPrefillThroughput`` (V_P) as llm-d's ``calibrate.sh`` measures it, on one
    idle simulated replica of the trace's plan: sequential CHUNK_SIZE-token prompts of
    random tokens (no prefix hit), V_P = CHUNK_SIZE / median(TTFT)."""
    import random

    core = EngineCore(load_plan(plan_file), gpu_blocks=gpu_blocks, seed=seed)
    rng = random.Random(seed)
    ttfts = []
    for _ in range(CALIBRATION_REQUESTS):
        prompt = [rng.randrange(16, 32000) for _ in range(CALIBRATION_CHUNK)]
        req = core.add_request(prompt, 1, arrival=core.now)
        core.run_until_idle()
        ttfts.append(req.first_token_time - req.arrival)
    return CALIBRATION_CHUNK / statistics.median(ttfts)


class TokenVelocityPolicy:
    """llm-d's token-aware autoscaling for P+D co-located pods ("token velocity",
    guides/workload-autoscaling/keda-epp-token-aware) as its ScaledObject configures it:
    one KEDA ScaledObject, two Prometheus triggers, both AverageValue, the HPA taking
    the larger replica count:

    - prefill: sum(llm_d_epp_inflight_tokens) / V_P -- seconds of prefill backlog --
      against ``target`` seconds per replica (the guide ships 1.5 for ~2 s TTFT SLOs);
    - decode: sum(vllm:kv_cache_usage_perc) against 0.8 per replica.

    V_P (``peakPrefillThroughput``) is calibrated as the guide documents
    (:func:`calibrate_peak_prefill`, set by ``run_policy``). The HPA behavior is the
    guide's: scale up by 1 pod per 180 s (no stabilization), down by 1 pod per 300 s
    after a 300 s stabilization window; external metrics with an AverageValue target
    give desired = ceil(sum / target), no change within the 10 % tolerance."""

    KV_TARGET = 0.8
    UP_PERIOD, DOWN_PERIOD = 180.0, 300.0

    def __init__(self, target: float) -> None:
        self.name, self.target = "velocity", target
        self.peak_prefill: float | None = None
        self.history: list[tuple[float, int]] = []
        self.ups: list[float] = []
        self.downs: list[float] = []

    def calibrate(self, plan_file: Path, gpu_blocks: int) -> None:
        self.peak_prefill = calibrate_peak_prefill(plan_file, gpu_blocks)

    @staticmethod
    def _desired(total: float, target: float, current: int) -> int:
        if abs(total / (target * max(current, 1)) - 1.0) <= TOLERANCE:
            return current
        return math.ceil(total / target - 1e-9)

    def tick(self, now: float, texts: dict[str, str], current: int, starting: int) -> Tick:
        inflight = kv = 0.0
        for text in texts.values():
            kv += parse_metrics(text, now).values.get("gpu_kv", 0.0)
            for line in text.splitlines():
                if line.startswith(INFLIGHT_TOKENS + " "):
                    inflight += float(line.split()[1])
        backlog = inflight / (self.peak_prefill or 1.0)
        raw = max(self._desired(backlog, self.target, current),
                  self._desired(kv, self.KV_TARGET, current))  # fmt: skip
        raw = min(max(raw, MIN_REPLICAS), MAX_REPLICAS)
        self.history = [(t, r) for t, r in self.history if now - t < SCALE_DOWN_WINDOW]
        self.history.append((now, raw))
        rec = min(max(current, raw), max(r for _, r in self.history))
        if rec > current:  # 1 pod per 180 s
            self.ups = [t for t in self.ups if now - t < self.UP_PERIOD]
            rec = current if self.ups else current + 1
            if rec > current:
                self.ups.append(now)
        elif rec < current:  # 1 pod per 300 s
            self.downs = [t for t in self.downs if now - t < self.DOWN_PERIOD]
            rec = current if self.downs else current - 1
            if rec < current:
                self.downs.append(now)
        rec = min(max(rec, MIN_REPLICAS), MAX_REPLICAS)
        return Tick(now, current, len(texts), starting, rec,
                    f"prefill backlog {backlog:.2f} s, kv {kv:.2f} -> raw {raw}")


class StaticPolicy:
    """Not an autoscaler: ask for ``n`` replicas at the first decision and keep them (the
    hindsight reference: swept over n, its cheapest n at each attainment)."""

    def __init__(self, n: int) -> None:
        self.n = int(n)
        self.name = "static"

    def tick(self, now: float, texts: dict[str, str], current: int, starting: int) -> Tick:
        return Tick(now, current, len(texts), starting, self.n, "static")


class OnsetPolicy:
    """Not an autoscaler either: a clairvoyant reaction. One replica until the trace's
    rate first rises 1 % above where it started, then ``n`` from the first decision after
    that second (decisions come every INTERVAL, as for every policy) to the end of the
    rise's phase, then one again. No policy that reads the fleet can react
    sooner, so what this one misses (the model load after the onset) is what any
    reactive policy misses unless it held spare replicas before (``--onset N``)."""

    def __init__(self, n: int, scenario: Scenario) -> None:
        self.n, self.name = int(n), "onset"
        assert scenario.rate is not None, f"{scenario.name} has no rate to react to"
        base = scenario.rate(0.0)
        rising = (t for t in range(int(scenario.duration)) if scenario.rate(t) > 1.01 * base)
        self.start = next(rising)
        self.end = next((end for _, start, end in scenario.phases if start <= self.start < end),
                        scenario.duration)  # fmt: skip

    def tick(self, now: float, texts: dict[str, str], current: int, starting: int) -> Tick:
        n = self.n if self.start <= now < self.end else 1
        return Tick(now, current, len(texts), starting, n, f"onset at {self.start}s")


#: Each policy and the targets it is swept over; the first Spillway entry is its
#: default (the CRD's), never tuned per trace.
SWEEP_TARGETS: dict[str, tuple[float, ...]] = {
    "spillway": (Policy().target, 0.8, 1.2),
    "hpa-kv": (0.5, 0.6, 0.7, 0.8),
    "hpa-queue": (1.0, 4.0),
    "keda": (4.0, 6.0, 8.0),
    "dynamo": (0.5, 0.6, 0.7),
    "velocity": (0.5, 1.0, 1.5, 3.0),
    "static": (2, 3, 4, 5),
}
DEFAULT_TARGET = {"spillway": Policy().target, "hpa-kv": 0.8, "hpa-queue": 2.0,
                  "keda": 8.0, "dynamo": 0.9, "velocity": 1.5, "static": 3}  # fmt: skip


def make_policy(name: str, target: float):
    if name == "spillway":
        return SpillwayPolicy(target)
    if name == "hpa-kv":
        return HpaPolicy(name, _gauge("gpu_kv"), target, "kv_cache_usage_perc")
    if name == "hpa-queue":
        return HpaPolicy(name, _gauge("waiting"), target, "num_requests_waiting")
    if name == "keda":
        return HpaPolicy(name, lambda v: v.get("running", 0.0) + v.get("waiting", 0.0),
                         target, "running+waiting")  # fmt: skip
    if name == "dynamo":
        return DynamoPolicy(target)
    if name == "velocity":
        return TokenVelocityPolicy(target)
    if name == "static":
        return StaticPolicy(int(target))
    raise ValueError(f"unknown policy {name!r}")
