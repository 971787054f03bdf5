"""spillway_operator.flow.throughput: the serving rate learned from the pods' own counters
and step histogram, the throughput term, and what a bad counter does to them."""

from __future__ import annotations

import math
import random

import pytest

from spillway_engine.metrics import INTER_TOKEN_LATENCY_BUCKETS
from spillway_operator.flow.pressure import (
    Aggregate,
    Policy,
    Sample,
    State,
    Unmeasured,
    aggregate,
    decide,
    parse_metrics,
    pod_rates,
    pod_reading,
)
from spillway_operator.flow.throughput import (
    TARGET_UTILISATION,
    BadCounters,
    Learner,
    Rates,
    StepCost,
    capacity,
    learn,
    learner,
    params_from_name,
    rates,
    seed_cost,
)

#: What the simulated engine really costs (the bench's simulator defaults), ten times and
#: more off the roofline seed of a 1B model on an H100.
TRUE = StepCost(step_s=0.004, prefill_s=60e-6, decode_s=50e-6)
SEED = seed_cost("h100", 1e9)

BASE = {
    "gpu_kv": 0.4, "waiting": 0.0, "running": 4.0, "prompt_tokens": 10_000.0,
    "preemptions": 0.0, "thrash_chunks": 0.0, "host_hit_tokens": 0.0, "device_hit_tokens": 0.0,
    "host_capacity_chunks": 100.0, "host_capacity_tokens": 25_600.0, "host_tokens": 12_800.0,
    "host_used_chunks": 50.0, "generation_tokens": 5_000.0, "computed_tokens": 8_000.0,
    "step_sum": 10.0, "step_count": 4_000.0, "step_buckets": 19.0,
}


def sample(t: float, **over: float) -> Sample:
    return Sample(t, {**BASE, **over})


def engine_interval(cost: StepCost, prefill: float, decode: float, dt: float = 15.0,
                    jitter: float = 0.0, rng: random.Random | None = None) -> tuple[Sample, Sample]:
    """Two scrapes of an engine with ``cost`` serving ``prefill`` computed prompt tokens/s
    and ``decode`` generated tokens/s for ``dt`` seconds, stepping without a pause:
    step = s0 / (1 - a P - b D) (the step equation with p = P step, R = D step)."""
    step = cost.step_s / (1.0 - cost.prefill_s * prefill - cost.decode_s * decode)
    if rng is not None:
        step *= 1.0 + rng.uniform(-jitter, jitter)
    tokens = decode * dt
    prev = sample(0.0)
    cur = sample(dt, prompt_tokens=BASE["prompt_tokens"] + prefill * dt,
                 computed_tokens=BASE["computed_tokens"] + prefill * dt,
                 generation_tokens=BASE["generation_tokens"] + tokens,
                 step_sum=BASE["step_sum"] + tokens * step,
                 step_count=BASE["step_count"] + tokens,
                 running=decode * step, gpu_kv=min(1.0, decode * step / 8.0))
    return prev, cur


def observe(state: Learner, now: float, cost: StepCost, prefill: float, decode: float,
            **kw) -> Learner:
    prev, cur = engine_interval(cost, prefill, decode, **kw)
    r = rates(prev.time, prev.values, cur.time, cur.values)
    assert r is not None
    return learn(state, now, [r], half_life=1800.0)


# ---------------------------------------------------------------- the seed


@pytest.mark.parametrize(("name", "params"), [
    ("meta-llama/Llama-3.2-1B", 1e9),
    ("meta-llama/Llama-3.1-8B-Instruct", 8e9),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 3e9),  # a MoE computes with its active experts
    ("HuggingFaceTB/SmolLM2-360M", 3.6e8),
    ("google/gemma-3-1b-it", 1e9),
    ("openai-community/gpt2", None),
])
def test_the_model_size_comes_from_the_hub_id(name, params):
    got = params_from_name(name)
    assert got == (pytest.approx(params) if params else None)


def test_the_roofline_is_the_emulated_gpu_s():
    """The operator may not import the emulator (a stand-in for the GPU): its copy of the
    figures must stay the emulator's."""
    from spillway_engine.emulator import latency
    from spillway_operator.flow import throughput

    for name, (flops, hbm) in throughput.ROOFLINE.items():
        profile = latency.GPU_PROFILES[name]
        assert (flops, hbm) == (profile.bf16_flops, profile.hbm_bytes_per_s)
        assert (
            profile.mfu, profile.hbm_efficiency) == (throughput.MFU, throughput.HBM_EFFICIENCY)
        cost = latency.ModelCost.of(7e9)
        seed = seed_cost(name, 7e9)
        assert seed.prefill_s == pytest.approx(1 / latency.prefill_tokens_per_s(profile, cost))
        assert seed.step_s == pytest.approx(latency.memory_s(profile, cost))
    assert throughput.DEFAULT_PARAMS == latency.DEFAULT_MODEL_PARAMS


def test_the_seed_is_the_roofline_of_the_planned_gpu_and_model():
    small, big = seed_cost("h100", 1e9), seed_cost("h100", 8e9)
    assert big.prefill_s == pytest.approx(8 * small.prefill_s)
    assert big.step_s == pytest.approx(8 * small.step_s)
    # an H200 reads the weights faster (HBM3e) and computes as fast (same Hopper)
    h200 = seed_cost("h200", 8e9)
    assert h200.step_s < big.step_s and h200.prefill_s == pytest.approx(big.prefill_s)
    # an unknown model is the documented default (8B), an unknown GPU an H100
    assert seed_cost(None, None) == big


# ---------------------------------------------------------------- learning


def test_before_any_reading_the_capacity_is_the_seed():
    cap = capacity(learner(SEED))
    assert cap.cost == SEED and cap.learned == 0
    assert cap.max_batch == 256  # vLLM's max_num_seqs until a running batch is seen


def test_the_serving_rate_is_learned_from_the_pods_not_calibrated():
    """The seed is 13x too fast on prefill; the pods' readings at a few loads replace it."""
    state, rng = learner(SEED), random.Random(1)
    for i in range(40):
        load = 0.2 + 0.7 * rng.random()
        state = observe(state, 15.0 * i, TRUE, prefill=3000 * load, decode=2000 * load,
                        jitter=0.02, rng=rng)
    cost = capacity(state).cost
    assert cost.step_s == pytest.approx(TRUE.step_s, rel=0.05)
    assert cost.prefill_s == pytest.approx(TRUE.prefill_s, rel=0.25)
    assert cost.decode_s == pytest.approx(TRUE.decode_s, rel=0.25)
    assert capacity(state).prefill_tokens_per_s == pytest.approx(1 / TRUE.prefill_s, rel=0.25)


def test_the_utilisation_is_what_the_true_engine_has_left():
    """rho predicts the load factor at which the engine saturates: with the learned cost
    the replicas the term asks for serve the demand at the target utilisation."""
    state = learner(SEED)
    rng = random.Random(2)
    for i in range(30):
        load = 0.1 + 0.8 * rng.random()
        state = observe(state, 15.0 * i, TRUE, prefill=4000 * load, decode=1500 * load)
    prev, cur = engine_interval(TRUE, prefill=4000 * 0.5, decode=1500 * 0.5)
    cap = capacity(state)
    r = rates(prev.time, prev.values, cur.time, cur.values)
    truth = 1500 * 0.5 * (TRUE.step_s / cap.max_batch + TRUE.decode_s) + 4000 * 0.5 * TRUE.prefill_s
    assert cap.utilisation(r) == pytest.approx(truth, rel=0.1)
    # the seed alone says the engine is nearly idle at this load: the term would not move
    assert capacity(learner(SEED)).utilisation(r) < truth / 5


def test_what_was_learned_is_forgotten_with_the_half_life():
    """A pod replaced by a slower one (another GPU, another engine version): the fit
    follows within a few half-lives."""
    state = learner(SEED)
    for i in range(40):
        state = observe(state, 15.0 * i, TRUE, prefill=2000 * (1 + i % 3), decode=800)
    slow = StepCost(TRUE.step_s * 2, TRUE.prefill_s * 2, TRUE.decode_s * 2)
    for i in range(40, 40 + 4 * 120):  # four half-lives of 1800 s
        state = observe(state, 15.0 * i, slow, prefill=1000 * (1 + i % 3), decode=400)
    assert capacity(state).cost.step_s == pytest.approx(slow.step_s, rel=0.1)


def test_the_batch_the_kv_affords_is_learned():
    state = learner(SEED)
    r = Rates(15.0, 1000.0, 500.0, 0.005, 100.0, kv_per_seq=0.1)
    state = learn(state, 15.0, [r, r], half_life=1800.0)
    assert capacity(state).max_batch == pytest.approx(10.0)


# ---------------------------------------------------------------- bad counters


def test_a_restart_is_no_reading_and_teaches_nothing():
    """Counters going backwards (the engine restarted): the pod is unmeasured, with the
    reason, and the serving rate learns nothing from it."""
    prev = sample(0.0, generation_tokens=90_000.0, step_count=80_000.0, step_sum=400.0)
    cur = sample(15.0)  # fresh counters after a restart
    with pytest.raises(BadCounters) as bad:
        rates(prev.time, prev.values, cur.time, cur.values)
    assert bad.value.reason == "counter_reset"
    got = pod_reading(prev, cur, 60.0, capacity(learner(SEED)))
    assert isinstance(got, Unmeasured) and got.bad and got.reason == "counter_reset"
    assert isinstance(pod_rates(prev, cur, 60.0), Unmeasured)
    agg = aggregate([got])
    assert agg.pressure is None and agg.unknown == 1


@pytest.mark.parametrize(("over", "reason"), [
    ({"step_sum": BASE["step_sum"]}, "zero_rate"),  # 600 tokens in 0 s: a rate of infinity
    ({"step_sum": math.nan}, "not_a_number"),
    ({"generation_tokens": math.nan}, "not_a_number"),
    ({"step_histogram_bad": 1.0}, "histogram"),
    ({"step_buckets": 12.0}, "histogram"),  # a scrape that lost buckets
])
def test_bad_counters_make_the_pod_unmeasured(over, reason):
    prev = sample(0.0)
    cur = sample(15.0, **{"generation_tokens": BASE["generation_tokens"] + 600,
                          "step_count": BASE["step_count"] + 600, **over})
    got = pod_reading(prev, cur, 60.0, capacity(learner(SEED)))
    assert isinstance(got, Unmeasured) and got.bad and got.reason == reason, got


def test_a_first_scrape_is_unmeasured_but_not_bad():
    got = pod_reading(None, sample(0.0), 60.0)
    assert isinstance(got, Unmeasured) and not got.bad


def _histogram(buckets: list[tuple[str, float]], count: float, total: float) -> str:
    lines = ["# TYPE vllm:inter_token_latency_seconds histogram"]
    lines += [f'vllm:inter_token_latency_seconds_bucket{{engine="0",le="{le}"}} {n}'
              for le, n in buckets]
    lines += [f'vllm:inter_token_latency_seconds_count{{engine="0"}} {count}',
              f'vllm:inter_token_latency_seconds_sum{{engine="0"}} {total}']
    return "\n".join(lines) + "\n"


def test_the_step_histogram_is_read_and_checked():
    bounds = [str(float(b)) for b in INTER_TOKEN_LATENCY_BUCKETS]
    good = [(b, 10.0 * (i + 1)) for i, b in enumerate(bounds)] + [("+Inf", 500.0)]
    s = parse_metrics(_histogram(good, 500.0, 2.5), 0.0).values
    assert s["step_count"] == 500.0 and s["step_sum"] == 2.5
    assert s["step_buckets"] == len(bounds) + 1 and "step_histogram_bad" not in s
    no_inf = parse_metrics(_histogram(good[:-1], 500.0, 2.5), 0.0).values
    not_cumulative = parse_metrics(_histogram([(bounds[0], 50.0), (bounds[1], 10.0),
                                               ("+Inf", 500.0)], 500.0, 2.5), 0.0).values
    wrong_count = parse_metrics(_histogram(good, 400.0, 2.5), 0.0).values
    for bad in (no_inf, not_cumulative, wrong_count):
        assert bad["step_histogram_bad"] == 1.0


def test_the_computed_prompt_tokens_come_from_vllm_s_by_source_counter():
    text = ('# TYPE vllm:prompt_tokens_by_source counter\n'
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 700\n'
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 300\n'
            '# TYPE vllm:generation_tokens counter\n'
            'vllm:generation_tokens_total{engine="0"} 90\n')
    v = parse_metrics(text, 0.0).values
    assert v["computed_tokens"] == 700 and v["generation_tokens"] == 90
    # without it: prompt tokens less what the GPU and the host tier served
    prev, cur = dict(BASE), dict(BASE)
    del prev["computed_tokens"], cur["computed_tokens"]
    cur |= {"prompt_tokens": BASE["prompt_tokens"] + 1500, "device_hit_tokens": 600.0,
            "host_hit_tokens": 300.0}
    assert rates(0.0, prev, 15.0, cur).prefill == pytest.approx(600 / 15)


# ---------------------------------------------------------------- in the decision


def test_the_throughput_term_drives_when_the_replica_runs_out_of_compute():
    """A replica whose KV is a third full but whose serving rate is spent: the load term
    says hold, the throughput term asks for a replica, and the decision says which."""
    state = learner(SEED)
    rng = random.Random(3)
    for i in range(30):
        load = 0.2 + 0.6 * rng.random()
        state = observe(state, 15.0 * i, TRUE, prefill=6000 * load, decode=3000 * load)
    cap = capacity(state)
    prev, cur = engine_interval(TRUE, prefill=9000, decode=4000)
    cur = Sample(cur.time, {**cur.values, "gpu_kv": 0.3})
    got = pod_reading(prev, cur, 60.0, cap)
    assert got.components["throughput"] > 1.2 > got.components["load"]
    d = decide(Policy(max_replicas=8), 15.0, 1, 1, 0, aggregate([got]), State())
    assert d.action == "scale-up" and d.term == "throughput", d
    assert "throughput" in d.reason


def test_every_decision_names_its_term():
    policy = Policy(max_replicas=8)
    low = Aggregate(0.2, {"load": 0.2, "queue": 0.0, "thrash": 0.0, "preempt": 0.0,
                          "throughput": 0.1}, 1, 0)
    assert decide(policy, 0.0, 1, 1, 0, low, State()).term == "load"
    assert decide(policy, 0.0, 9, 9, 0, low, State()).term == "bounds"
    none = Aggregate(None, {}, 0, 1)
    assert decide(policy, 0.0, 2, 2, 0, none, State()).term == ""


def test_the_forecast_extrapolates_the_throughput_demand():
    policy = Policy(max_replicas=8, lead_seconds=120.0)
    state = State()
    d = None
    for i in range(12):
        thr = 0.5 + 0.05 * i  # the demand grows 0.05 replica per 15 s
        agg = Aggregate(thr, {"load": 0.1, "queue": 0.0, "thrash": 0.0, "preempt": 0.0,
                              "throughput": thr}, 2, 0)
        d = decide(policy, 15.0 * i, 2, 2, 0, agg, state)
        state = d.state
        if d.action == "scale-up":
            break
    assert d is not None and d.action == "scale-up" and d.term == "forecast:throughput", d


def test_a_demand_beyond_the_starting_pods_scales_up_while_they_start():
    """Pods already starting are counted in ``current``: a queue waits for them, a
    demand for more than they bring does not."""
    policy = Policy(max_replicas=8)
    queue = Aggregate(3.0, {"load": 0.3, "queue": 3.0, "thrash": 0.0, "preempt": 0.0,
                            "throughput": 0.9}, 2, 0)
    d = decide(policy, 0.0, 3, 2, 1, queue, State())
    assert d.action == "hold" and "starting" in d.reason
    demand = Aggregate(2.4, {"load": 0.3, "queue": 0.0, "thrash": 0.0, "preempt": 0.0,
                             "throughput": 2.4}, 2, 0)
    d = decide(policy, 0.0, 3, 2, 1, demand, State())
    assert d.action == "scale-up" and d.replicas == 5 and d.term == "throughput"


def test_the_term_is_at_one_at_the_target_utilisation():
    cap = capacity(learner(TRUE))
    r = Rates(15.0, prefill=TARGET_UTILISATION / TRUE.prefill_s, decode=0.0, step=None,
              step_samples=0.0, kv_per_seq=None)
    prev, cur = sample(0.0), sample(15.0, computed_tokens=BASE["computed_tokens"] + r.prefill * 15,
                                    prompt_tokens=BASE["prompt_tokens"] + r.prefill * 15)
    assert pod_reading(prev, cur, 60.0, cap).components["throughput"] == pytest.approx(1.0)


# ---------------------------------------------------------------- what waits


def _learned_with_requests(prompt: float, generated: float) -> Learner:
    """The true engine learned at a few loads, every request bringing ``prompt`` computed
    prompt tokens and ``generated`` generated ones."""
    state, rng = learner(SEED), random.Random(4)
    for i in range(30):
        load = 0.2 + 0.6 * rng.random()
        prev, cur = engine_interval(TRUE, prefill=3000 * load,
                                    decode=3000 * load * generated / prompt)
        finished = 3000 * load * 15.0 / prompt
        cur = Sample(cur.time, {**cur.values, "finished": 40.0 + finished})
        prev = Sample(prev.time, {**prev.values, "finished": 40.0})
        r = rates(prev.time, prev.values, cur.time, cur.values)
        state = learn(state, 15.0 * i, [r], half_life=1800.0)
    return state


def test_what_one_request_costs_is_learned_from_vllm_s_finished_requests():
    text = ('# TYPE vllm:request_success counter\n'
            'vllm:request_success_total{engine="0",finished_reason="stop"} 30\n'
            'vllm:request_success_total{engine="0",finished_reason="length"} 12\n')
    assert parse_metrics(text, 0.0).values["finished"] == 42
    cap = capacity(_learned_with_requests(prompt=2000.0, generated=100.0))
    assert cap.request_tokens == pytest.approx((2000.0, 100.0), rel=1e-6)
    c = cap.cost
    assert cap.request_cost == pytest.approx(
        2000 * c.prefill_s + 100 * (c.step_s / cap.max_batch + c.decode_s))
    # before any request finished, nothing is known of a request: what waits costs 0
    assert capacity(learner(SEED)).request_cost == 0.0


def test_a_queue_the_replica_cannot_serve_is_demand_beyond_what_it_served():
    """A replica serving at its full rate serves no more however much arrives: what it
    does not take waits, and the throughput term counts the queue's growth and what
    already waits (cleared within a model load) as demand, which the served tokens alone
    never show."""
    cap = capacity(_learned_with_requests(prompt=2000.0, generated=100.0))
    prev, cur = engine_interval(TRUE, prefill=9000, decode=450)
    calm = pod_reading(prev, cur, 60.0, cap, 120.0)
    grow = pod_reading(Sample(prev.time, {**prev.values, "waiting": 10.0}),
                       Sample(cur.time, {**cur.values, "waiting": 40.0}), 60.0, cap, 120.0)
    served = calm.components["throughput"]
    # 30 more requests in 15 s, and 40 waiting to clear within 120 s
    extra = cap.request_cost * (30 / 15 + 40 / 120) / TARGET_UTILISATION
    assert grow.components["throughput"] == pytest.approx(served + extra)
    assert grow.components["throughput"] > 1.5 * served
    assert grow.components["backlogShare"] == pytest.approx(extra / (served + extra))
    assert grow.components["demandTokensPerSecond"] > calm.components["demandTokensPerSecond"]
    # a queue draining faster than it is cleared lowers the demand, never below nothing
    drain = pod_reading(Sample(prev.time, {**prev.values, "waiting": 400.0}),
                        Sample(cur.time, {**cur.values, "waiting": 0.0}), 60.0, cap, 120.0)
    assert drain.components["throughput"] == 0.0
    # a longer model load spreads what waits thinner
    slow = pod_reading(Sample(prev.time, {**prev.values, "waiting": 40.0}),
                       Sample(cur.time, {**cur.values, "waiting": 40.0}), 60.0, cap, 480.0)
    fast = pod_reading(Sample(prev.time, {**prev.values, "waiting": 40.0}),
                       Sample(cur.time, {**cur.values, "waiting": 40.0}), 60.0, cap, 120.0)
    assert served < slow.components["throughput"] < fast.components["throughput"]
