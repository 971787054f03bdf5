"""The throughput term: what a replica can serve, learned online; pure functions, no I/O.

A vLLM engine steps continuously while it has requests; one step of ``R`` decoding
sequences and ``p`` prompt tokens takes about

    step = s0 + a * p + b * R

(``s0``: reading the weights once, launch and scheduling; ``a``: compute per prompt
token; ``b``: per decoding sequence). At a demand of ``P`` computed prompt tokens/s
(prompt tokens not served from the GPU or the host tier) and ``D`` generated
tokens/s, the engine keeps up as long as

    rho = D * (s0 / R_max + b) + P * a  <  1

where ``R_max`` is the batch its KV cache affords (GPU KV / the KV one running
sequence holds, at most ``max_num_seqs``): decode steps are shared by the whole batch,
so their fixed cost is paid once per ``R_max`` tokens at the most. ``rho`` is the
share of one replica's serving rate the demand takes -- the throughput term is
``rho / TARGET_UTILISATION`` -- and 1 / ``rho`` the load factor it can still absorb.
(Solve the step equation with ``p = P * step``, ``R = D * step`` for the load at which
``R`` reaches ``R_max``, or ``a * P + b * D`` reaches 1.)

Nothing is calibrated by hand. The cost ``(s0, a, b)`` starts from a roofline seed --
the plan's GPU (:mod:`spillway_engine.emulator.latency`'s FLOPs and HBM profiles) and
the model's parameter count -- and is replaced by what the pods' own metrics show:
vLLM's inter-token-latency histogram gives the mean step time ``m`` of the decoding
sequences between two scrapes, its counters the computed prompt and generated tokens,
so every pod and interval is one equation ``s0 + a * P * m + b * D * m = m`` (Little's
law: ``D * m`` sequences decode on average, ``P * m`` prompt tokens ride each step).
The equations are pooled over the deployment's pods by exponentially forgotten
least squares (half-life ``serving_rate_half_life``), with the seed as a prior worth
:data:`PRIOR_WEIGHT` intervals, in units of the seed (so the fit is scale-free and a
direction the data does not pin keeps the seed's value). ``R_max`` is learned the same
way from ``vllm:kv_cache_usage_perc / vllm:num_requests_running``.

The demand is what arrives, not only what was served: a replica that runs out of
serving rate serves at most its rate, and the requests it cannot take wait. So the
queue counts too (:meth:`Capacity.backlog`): its growth over the interval is demand
beyond what was served, and what already waits is demand to clear within about one
model load. A request's cost in rho-seconds comes from the same fit and the mean
computed prompt and generated tokens per finished request (``vllm:request_success``),
learned with the same forgetting.

A pod whose counters went backwards (a restart), whose histogram lost buckets or is
not cumulative, or whose mean step time is 0 or not a number teaches nothing and is
not measured (:class:`BadCounters`, with the reason as a short label).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from spillway_engine import metrics as m

#: rho at which the throughput term is 1.0: the share of a replica's serving rate
#: demand may take before the autoscaler adds a replica. The fit is a line through the
#: step times; near saturation a KV-bound batch also loses prefix hits and preempts,
#: which the line does not see, so replicas queue before rho reaches 1. At 0.75 the
#: bench's replicas queued on the ramps (bursty: 90-95 % of requests within 2 s on
#: four seeds of five); at 0.6 they do not (95-100 %), with fewer replica-minutes.
TARGET_UTILISATION = 0.6
#: The seed's weight in the fit, in the units of the normal equations (a ridge towards
#: the seed): small, so one interval moves the cost along what it showed (mostly the
#: step's fixed part) and a parameter the data pin moves as far as they say, while one
#: they never touch keeps the seed's value.
PRIOR_WEIGHT = 1e-6
#: Fewer inter-token samples in an interval than this teach nothing (too noisy).
MIN_STEP_SAMPLES = 20
#: Learned multipliers of the seed stay within these factors of it.
MIN_FACTOR, MAX_FACTOR = 1 / 50, 50.0
#: vLLM's default ``--max-num-seqs``: the batch never exceeds it.
MAX_NUM_SEQS = 256
#: The inter-token-latency histogram's bucket bounds (vLLM 0.33.0).
STEP_BUCKETS = tuple(float(b) for b in m.INTER_TOKEN_LATENCY_BUCKETS)


class BadCounters(ValueError):
    """A pod's counters or histogram cannot be used this interval; ``reason`` is short."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------- the seed

#: The roofline the seed is made of: dense BF16 FLOP/s and HBM bytes/s per GPU (the
#: vendors' datasheets) and the fractions of them an engine achieves -- the emulated
#: GPU's figures (``spillway_engine.emulator.latency``, which the operator may not
#: import; tests/unit/test_throughput.py keeps the two equal). Other GPUs seed as an
#: H100 does: the pods' own readings replace the seed either way.
ROOFLINE: dict[str, tuple[float, float]] = {
    "h100": (989.5e12, 3.35e12),
    "h200": (989.5e12, 4.8e12),
}
MFU, HBM_EFFICIENCY = 0.45, 0.8
DEFAULT_PARAMS = 8e9  # an 8B dense model, the emulator's default too
BYTES_PER_PARAM = 2.0  # bf16 weights


@dataclass(frozen=True)
class StepCost:
    """Seconds per engine step, per prompt token and per decoding sequence."""

    step_s: float
    prefill_s: float
    decode_s: float

    def scaled(self, k: tuple[float, float, float]) -> StepCost:
        return StepCost(self.step_s * k[0], self.prefill_s * k[1], self.decode_s * k[2])


_SIZE = re.compile(r"(?<![0-9.])(\d+(?:\.\d+)?)\s*([bBmM])(?![a-zA-Z])")
_ACTIVE = re.compile(r"[-_ ][aA](\d+(?:\.\d+)?)[bB](?![a-zA-Z])")


def params_from_name(model: str) -> float | None:
    """Parameters from a hub id's size tag: ``Llama-3.2-1B`` 1e9, ``Qwen3-Next-80B-A3B``
    3e9 (a mixture of experts computes with its active parameters), ``SmolLM-360M``
    3.6e8; None when the name carries none."""
    name = model.rsplit("/", 1)[-1]
    active = _ACTIVE.search(name)
    if active:
        return float(active.group(1)) * 1e9
    found = _SIZE.findall(name)
    if not found:
        return None
    value, unit = found[-1]
    return float(value) * (1e9 if unit in "bB" else 1e6)


def seed_cost(gpu: str | None, params_per_gpu: float | None) -> StepCost:
    """The roofline's step cost for ``params_per_gpu`` parameters (bf16) on ``gpu``:
    one read of the weights per step, ``2 x params`` FLOPs per prompt token and per
    decoding sequence, at the emulator's achieved fractions of peak. An estimate, to be
    replaced by what the pods show (:func:`learn`)."""
    params = params_per_gpu or DEFAULT_PARAMS
    flops, hbm = ROOFLINE.get((gpu or "h100").lower(), ROOFLINE["h100"])
    per_token = 2.0 * params / (flops * MFU)
    weights_s = params * BYTES_PER_PARAM / (hbm * HBM_EFFICIENCY)
    return StepCost(weights_s, per_token, per_token)


# ---------------------------------------------------------------- one pod, one interval


@dataclass(frozen=True)
class Rates:
    """What one pod served between two scrapes."""

    dt: float
    prefill: float  # computed prompt tokens per second (not from the GPU or host tier)
    decode: float  # generated tokens per second
    step: float | None  # mean inter-token latency (s): the decoding batch's step time
    step_samples: float  # inter-token samples behind ``step``
    kv_per_seq: float | None  # GPU KV share one running sequence holds (at the scrape)
    finished: float | None = None  # requests finished per second (None: no counter)

    @property
    def tokens(self) -> float:
        return self.prefill + self.decode


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v >= 0


def _delta(prev: dict[str, float], cur: dict[str, float], key: str) -> float | None:
    """The counter's increase; None when it is absent; BadCounters when it went back."""
    if key not in cur and key not in prev:
        return None
    a, b = prev.get(key), cur.get(key)
    if not (_finite(a) and _finite(b)):
        raise BadCounters("not_a_number", f"{key} is missing or not a number")
    if b < a:  # type: ignore[operator]
        raise BadCounters("counter_reset", f"{key} went backwards ({a:g} -> {b:g}): "
                          "the engine restarted")
    return b - a  # type: ignore[operator]


def rates(prev_time: float, prev: dict[str, float], cur_time: float,
          cur: dict[str, float]) -> Rates | None:
    """The pod's rates between two scrapes (``Sample`` values), None without the token
    counters; BadCounters when they cannot be trusted."""
    dt = cur_time - prev_time
    if not dt > 0:
        raise BadCounters("clock", "no time passed between the scrapes")
    for sample in (prev, cur):
        if sample.get("step_histogram_bad"):
            raise BadCounters("histogram", f"{m.INTER_TOKEN_LATENCY_SECONDS.name} has "
                              "missing or non-cumulative buckets")
    if "step_buckets" in prev and "step_buckets" in cur and \
            prev["step_buckets"] != cur["step_buckets"]:
        raise BadCounters("histogram", f"{m.INTER_TOKEN_LATENCY_SECONDS.name} went from "
                          f"{prev['step_buckets']:g} to {cur['step_buckets']:g} buckets")
    generated = _delta(prev, cur, "generation_tokens")
    prompt = _delta(prev, cur, "prompt_tokens")
    if generated is None or prompt is None:
        return None
    computed = _delta(prev, cur, "computed_tokens")
    if computed is None:  # engines without the by-source counter: prompt less the hits
        hits = sum(_delta(prev, cur, k) or 0.0 for k in ("device_hit_tokens", "host_hit_tokens"))
        computed = max(0.0, prompt - hits)
    samples = _delta(prev, cur, "step_count") or 0.0
    total = _delta(prev, cur, "step_sum") or 0.0
    step = None
    if samples > 0:
        step = total / samples
        if not (math.isfinite(step) and step > 0):
            raise BadCounters("zero_rate", f"mean inter-token latency {step!r} s over "
                              f"{samples:g} tokens")
    running, kv = cur.get("running"), cur.get("gpu_kv")
    kv_per_seq = kv / running if _finite(running) and _finite(kv) and running >= 1 and kv > 0 \
        else None  # fmt: skip
    finished = _delta(prev, cur, "finished")
    return Rates(dt, computed / dt, generated / dt, step, samples, kv_per_seq,
                 None if finished is None else finished / dt)


# ---------------------------------------------------------------- learning


@dataclass(frozen=True)
class Learner:
    """One deployment's serving rate: the seed and what its pods showed, forgotten with
    a half-life (normal equations of the fit in units of the seed)."""

    seed: StepCost
    info: tuple[float, ...] = (0.0,) * 9  # sum of w x x^T, row-major 3 x 3
    moment: tuple[float, float, float] = (0.0, 0.0, 0.0)  # sum of w x
    weight: float = 0.0  # sum of w: how many (forgotten) intervals the fit holds
    kv_per_seq: float | None = None  # the KV share one running sequence holds (mean)
    kv_weight: float = 0.0
    # Computed prompt tokens, generated tokens and finished requests (forgotten sums):
    # the work one request brings, what a waiting request will cost.
    per_request: tuple[float, float, float] = (0.0, 0.0, 0.0)
    at: float | None = None  # time of the last update


def learner(seed: StepCost) -> Learner:
    return Learner(seed)


def learn(state: Learner, now: float, observed: list[Rates], half_life: float) -> Learner:
    """``state`` with this interval's rates of the deployment's pods added; what is
    older counts half per ``half_life`` seconds (0: only this interval)."""
    keep = 1.0
    if state.at is not None and now > state.at:
        keep = 0.5 ** ((now - state.at) / half_life) if half_life > 0 else 0.0
    info = [v * keep for v in state.info]
    moment = [v * keep for v in state.moment]
    weight = state.weight * keep
    kv_sum = (state.kv_per_seq or 0.0) * state.kv_weight * keep
    kv_weight = state.kv_weight * keep
    work = [v * keep for v in state.per_request]
    s = state.seed
    for r in observed:
        if r.kv_per_seq is not None:
            kv_sum += r.kv_per_seq
            kv_weight += 1.0
        if r.finished is not None and r.finished > 0:
            work = [work[0] + r.prefill * r.dt, work[1] + r.decode * r.dt,
                    work[2] + r.finished * r.dt]
        if r.step is None or r.step_samples < MIN_STEP_SAMPLES:
            continue
        # s0 + a * (P m) + b * (D m) = m, divided by m: relative errors, scale-free.
        x = (s.step_s / r.step, s.prefill_s * r.prefill, s.decode_s * r.decode)
        for i in range(3):
            moment[i] += x[i]
            for j in range(3):
                info[3 * i + j] += x[i] * x[j]
        weight += 1.0
    return replace(state, info=tuple(info), moment=(moment[0], moment[1], moment[2]),
                   weight=weight, kv_per_seq=kv_sum / kv_weight if kv_weight > 0 else None,
                   kv_weight=kv_weight, per_request=(work[0], work[1], work[2]),
                   at=now)  # fmt: skip


def _solve3(a: list[float], b: list[float]) -> list[float] | None:
    """x with a x = b (a row-major 3 x 3), by elimination with partial pivoting."""
    rows = [[a[3 * i], a[3 * i + 1], a[3 * i + 2], b[i]] for i in range(3)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(rows[r][c]))
        if abs(rows[p][c]) < 1e-12:
            return None
        rows[c], rows[p] = rows[p], rows[c]
        for r in range(c + 1, 3):
            f = rows[r][c] / rows[c][c]
            rows[r] = [v - f * w for v, w in zip(rows[r], rows[c], strict=True)]
    x = [0.0, 0.0, 0.0]
    for c in (2, 1, 0):
        x[c] = (rows[c][3] - sum(rows[c][j] * x[j] for j in range(c + 1, 3))) / rows[c][c]
    return x


def _fit(state: Learner) -> list[float]:
    """The seed's multipliers that fit the pods' equations best (ridge towards 1); one
    that leaves its range is held at the bound and the others fitted again."""
    a = list(state.info)
    for i in range(3):
        a[4 * i] += PRIOR_WEIGHT
    b = [v + PRIOR_WEIGHT for v in state.moment]
    fixed: dict[int, float] = {}
    for _ in range(3):
        # Fixed parameters leave the system: k_i = value, its column moves to the right.
        aa, bb = list(a), list(b)
        for i, v in fixed.items():
            for r in range(3):
                bb[r] -= aa[3 * r + i] * v
                aa[3 * r + i] = 0.0
            aa[3 * i:3 * i + 3] = [0.0, 0.0, 0.0]
            aa[4 * i], bb[i] = 1.0, v
        k = _solve3(aa, bb) or [1.0, 1.0, 1.0]
        out = {i: min(max(v, MIN_FACTOR), MAX_FACTOR) for i, v in enumerate(k)
               if not MIN_FACTOR <= v <= MAX_FACTOR and i not in fixed}
        if not out:
            return k
        fixed |= out
    return [min(max(v, MIN_FACTOR), MAX_FACTOR) for v in k]


@dataclass(frozen=True)
class Capacity:
    """A replica's serving rate as the throughput term uses it."""

    cost: StepCost
    max_batch: float
    learned: float = 0.0  # pod-intervals behind it (0: the seed alone)
    info: dict[str, float] = field(default_factory=dict, compare=False)
    #: (computed prompt, generated) tokens one request brings (None: none finished yet)
    request_tokens: tuple[float, float] | None = None

    def utilisation(self, r: Rates) -> float:
        """rho: the share of one replica's serving rate this pod's demand takes."""
        return self._rho(r.prefill, r.decode)

    def _rho(self, prefill: float, decode: float) -> float:
        c = self.cost
        return decode * (c.step_s / self.max_batch + c.decode_s) + prefill * c.prefill_s

    @property
    def request_cost(self) -> float:
        """rho-seconds one request takes (0 before any request finished)."""
        return self._rho(*self.request_tokens) if self.request_tokens else 0.0

    def backlog(self, waiting_before: float, waiting: float, dt: float,
                drain_seconds: float) -> float:
        """rho of the demand the pod did not serve: the queue's growth over the
        interval (arrivals beyond what was served; negative while it drains) and the
        requests already waiting, to clear within ``drain_seconds``."""
        if not (dt > 0 and drain_seconds > 0):
            return 0.0
        return self.request_cost * ((waiting - waiting_before) / dt + waiting / drain_seconds)

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.cost.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second at the largest batch (decode alone)."""
        c = self.cost
        return self.max_batch / (c.step_s + c.decode_s * self.max_batch)


def capacity(state: Learner, max_num_seqs: int = MAX_NUM_SEQS) -> Capacity:
    """The fitted serving rate: the seed where nothing was learned."""
    k = _fit(state)
    batch = float(max_num_seqs)
    if state.kv_per_seq is not None and state.kv_per_seq > 0:
        batch = min(batch, max(1.0, 1.0 / state.kv_per_seq))
    prefill, decode, requests = state.per_request
    per_request = (prefill / requests, decode / requests) if requests > 0 else None
    return Capacity(state.seed.scaled((k[0], k[1], k[2])), batch, state.weight,
                    request_tokens=per_request)
