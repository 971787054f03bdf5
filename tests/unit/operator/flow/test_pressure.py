"""spillway_operator.flow.pressure: offload pressure and the scaling decision (pure,
property-tested)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillway_operator.flow.pressure import (
    Aggregate,
    Candidate,
    MetricsError,
    Policy,
    Sample,
    State,
    aggregate,
    choose_removals,
    decide,
    parse_body,
    parse_metrics,
    pod_pressure,
    resume_state,
    startup_seconds,
)

BASE = {
    "gpu_kv": 0.4, "waiting": 0.0, "running": 4.0, "prompt_tokens": 10_000.0,
    "preemptions": 0.0, "thrash_chunks": 0.0, "host_hit_tokens": 0.0,
    "host_capacity_chunks": 100.0, "host_capacity_tokens": 25_600.0, "host_tokens": 12_800.0,
    "host_used_chunks": 50.0,
}


def sample(t: float, **over) -> Sample:
    return Sample(t, {**BASE, **over})


TEXT = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 6
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 300
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 200
# TYPE spillway_host_pool_thrash counter
spillway_host_pool_thrash_total{engine="0",model_name="m"} 4
"""


def test_parse_reads_vllm_and_spillway_names():
    s = parse_metrics(TEXT, 5.0)
    assert s.values["gpu_kv"] == 0.5 and s.values["waiting"] == 3 and s.values["running"] == 6
    assert s.values["prompt_tokens"] == 1000 and s.values["preemptions"] == 2
    assert s.values["host_hit_tokens"] == 300  # only source="host"
    assert s.values["thrash_chunks"] == 4


def test_parse_refuses_garbage():
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus", 1.0)


def test_components_have_their_targets_at_one():
    prev = sample(0.0)
    # 5% of 10k prompt tokens (500) recomputed after capacity evictions, 256-token chunks.
    cur = sample(10.0, prompt_tokens=20_000.0, thrash_chunks=500 / 256,
                 gpu_kv=0.8, waiting=3.0, running=4.0, preemptions=1.0)
    p = pod_pressure(prev, cur, max_dt=60)
    assert p.components["load"] == pytest.approx(1.0)
    assert p.components["queue"] == pytest.approx(1.0)
    assert p.components["preempt"] == pytest.approx(1.0)
    assert p.components["thrash"] == pytest.approx(1.0)
    assert p.pressure == pytest.approx(1.0)


def test_host_hits_make_cache_warm():
    p = pod_pressure(sample(0.0), sample(10.0, prompt_tokens=20_000.0, host_hit_tokens=5_000.0),
                     60)
    assert p.components["hostHitShare"] == pytest.approx(0.5)
    assert p.warm_tokens == pytest.approx(12_800 * 0.5)
    # A full LRU pool can still take in what is not hot: all but the hit half.
    assert p.free_host_tokens == pytest.approx(25_600 - 12_800 * 0.5)


def test_rate_terms_are_capped_and_a_lone_waiter_is_no_queue():
    p = pod_pressure(sample(0.0), sample(10.0, prompt_tokens=20_000.0, preemptions=50.0,
                                         thrash_chunks=1_000.0, waiting=1.0, running=1.0), 60)
    assert p.components["preempt"] == 2.0 and p.components["thrash"] == 2.0
    assert p.components["queue"] == 0.0


@pytest.mark.parametrize(
    ("prev", "cur"),
    [
        (None, sample(10.0)),                                        # first scrape
        (sample(0.0), sample(10.0, gpu_kv=math.nan)),                # NaN gauge
        (sample(0.0), sample(10.0, waiting=-1.0)),                   # negative gauge
        (sample(0.0), sample(10.0, prompt_tokens=5.0)),              # counter reset (restart)
        (sample(0.0), sample(10.0, preemptions=-3.0)),               # garbage counter
        (sample(10.0), sample(10.0)),                                # no time passed
        (sample(20.0), sample(10.0)),                                # clock went backwards
        (sample(0.0), sample(1_000.0)),                              # stale previous sample
        (sample(0.0), Sample(10.0, {"gpu_kv": 0.5})),                # metrics missing
    ],
)
def test_untrustworthy_samples_give_no_pressure(prev, cur):
    assert pod_pressure(prev, cur, max_dt=60) is None


def agg_of(pressure, n=2, unknown=0, warm=0.0, free=1e9):
    if pressure is None:
        return Aggregate(None, {}, 0, n)
    return Aggregate(pressure, {}, n, unknown, [warm] * n, [free] * n)


POLICY = Policy(min_replicas=1, max_replicas=10, scale_down_window=300)


def test_scale_up_is_proportional_and_rate_limited():
    d = decide(POLICY, 0, 2, 2, 0, agg_of(2.0), State())
    assert (d.replicas, d.action) == (4, "scale-up")
    d = decide(Policy(max_replicas=100), 0, 2, 2, 0, agg_of(40.0), State())
    assert d.replicas == 2 + 4  # max(4 pods, 100%) per step


def test_within_tolerance_holds():
    assert decide(POLICY, 0, 3, 3, 0, agg_of(1.08), State()).action == "hold"


def test_cascade_guard_blocks_scale_up_while_pods_start():
    d = decide(POLICY, 0, 4, 2, 2, agg_of(3.0), State())
    assert d.action == "hold" and "starting" in d.reason


def test_scale_down_waits_for_the_window():
    state, t = State(), 0.0
    d = decide(POLICY, t, 4, 4, 0, agg_of(1.0), state)
    state = d.state
    for t in range(15, 300, 15):
        d = decide(POLICY, float(t), 4, 4, 0, agg_of(0.2), state)
        state = d.state
        assert d.replicas == 4, t
    d = decide(POLICY, 315.0, 4, 4, 0, agg_of(0.2), state)
    assert (d.replicas, d.action) == (3, "scale-down")  # one pod per decision


def test_missing_metrics_never_scale_down():
    d = decide(POLICY, 0, 4, 4, 0, agg_of(None), State())
    assert d.action == "hold" and d.reason.startswith("MetricsUnavailable")
    d = decide(Policy(scale_down_window=0), 0, 4, 4, 0, agg_of(0.1, unknown=1), State())
    assert d.action == "hold" and d.reason.startswith("MetricsUnavailable")


def test_warm_cache_guard_delays_then_gives_up():
    p = Policy(scale_down_window=10, warm_cache_max_delay_windows=3)
    hot = agg_of(0.1, n=3, warm=5_000.0, free=1_000.0)
    state = decide(p, 0, 3, 3, 0, agg_of(0.1, n=3), State()).state
    d = decide(p, 11, 3, 3, 0, hot, state)
    assert d.action == "hold" and d.reason.startswith("WarmCacheGuard")
    d = decide(p, 50, 3, 3, 0, hot, d.state)
    assert d.action == "scale-down"  # held 3 windows at most


def test_bounds_are_enforced_first():
    assert decide(POLICY, 0, 0, 0, 0, agg_of(None), State()).replicas == 1
    assert decide(POLICY, 0, 12, 12, 0, agg_of(5.0), State()).replicas == 10


@settings(max_examples=300, deadline=None)
@given(
    current=st.integers(1, 20),
    starting=st.integers(0, 3),
    pressure=st.one_of(st.none(), st.floats(0, 50, allow_nan=False)),
    unknown=st.integers(0, 3),
    lo=st.integers(1, 5),
    span=st.integers(0, 15),
)
def test_decision_invariants(current, starting, pressure, unknown, lo, span):
    policy = Policy(min_replicas=lo, max_replicas=lo + span, scale_down_window=0)
    ready = max(current - starting, 0)
    agg = agg_of(pressure, n=max(ready, 1), unknown=unknown)
    d = decide(policy, 100.0, current, ready, starting, agg, State())
    assert policy.min_replicas <= d.replicas <= policy.max_replicas
    in_bounds = policy.min_replicas <= current <= policy.max_replicas
    if in_bounds and (pressure is None or unknown):
        assert d.replicas >= current  # never down without everyone's metrics
    if in_bounds and starting and d.replicas > current:
        pytest.fail("scaled up while pods were starting")
    if in_bounds and d.replicas > current:
        assert d.replicas <= current + max(4, current)


@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=8))
def test_aggregate_is_the_mean_of_known_pods(values):
    from spillway_operator.flow.pressure import PodPressure

    pods = [PodPressure(v, {"load": v}, 0, 0) for v in values] + [None]
    agg = aggregate(pods)
    assert agg.pressure == pytest.approx(sum(values) / len(values))
    assert agg.unknown == 1 and agg.measured == len(values)


def test_fresh_scaler_observes_a_whole_window_before_scaling_down():
    """After an operator restart there is no history: no instant scale-down."""
    d = decide(POLICY, 1_000.0, 4, 4, 0, agg_of(0.1), State())
    assert d.action == "hold" and "stabilizing" in d.reason
    d = decide(POLICY, 1_299.0, 4, 4, 0, agg_of(0.1), d.state)
    assert d.action == "hold"
    assert decide(POLICY, 1_300.0, 4, 4, 0, agg_of(0.1), d.state).action == "scale-down"


def test_hold_reasons_name_the_bound():
    assert "at maxReplicas" in decide(POLICY, 0, 10, 10, 0, agg_of(3.0, n=10), State()).reason
    assert "at minReplicas" in decide(Policy(scale_down_window=0), 0, 1, 1, 0, agg_of(0.1),
                                      State()).reason


# ---------------------------------------------------------------- hostile bodies

_NAMES = ["vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
          "vllm:prompt_tokens_cached_by_source_total", "spillway_host_pool_thrash_total", "x"]
_VALUES = ["0", "1e400", "-1", "NaN", "+Inf", "0x10", "1_0", "", "1 2 3", "\u00e9", "1e-400"]
_LINE = st.one_of(
    st.builds(lambda n, lb, v: f"{n}{lb} {v}", st.sampled_from(_NAMES),
              st.sampled_from(["", '{source="host"}', "{", '{a="\\', '{a="b",}', "{=}",
                               '{a="' + "x" * 300 + '"}']),
              st.sampled_from(_VALUES)),
    st.builds(lambda n, t: f"# TYPE {n} {t}", st.sampled_from(_NAMES),
              st.sampled_from(["gauge", "counter", "histogram", "bogus", ""])),
    st.sampled_from(["# HELP", "# TYPE", "#", "# EOF", "\x00", "\r", "{}", "} 1"]),
    st.text(max_size=40),
)
_BODY = st.one_of(
    st.binary(max_size=300),
    st.lists(_LINE, max_size=30).map(lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass")),
    st.lists(_LINE, max_size=30).map(lambda ls: "\n".join(ls).encode("utf-16")),
    st.lists(_LINE, max_size=30).map(lambda ls: "\n".join(ls).encode("latin-1", "replace")),
    st.builds(lambda a, b: TEXT.encode()[:a] + b + TEXT.encode()[a:], st.integers(0, 600),
              st.binary(min_size=1, max_size=4)),
)


@settings(max_examples=1500, deadline=None)
@given(_BODY)
def test_any_body_is_a_sample_or_a_metrics_error(body):
    """Whatever a pod answers, parsing yields a Sample or MetricsError (with a reason
    the scrape-failure metric uses), never another exception."""
    try:
        got = parse_body(body, 1.0)
    except MetricsError as exc:
        assert exc.reason in ("not_utf8", "malformed") and str(exc)
        assert "\n" not in str(exc)
    else:
        assert isinstance(got, Sample)
        assert all(isinstance(v, float) for v in got.values.values())


def test_non_utf8_body_says_so():
    with pytest.raises(MetricsError, match="not UTF-8") as info:
        parse_body(TEXT.encode() + b"\xff\xfe", 1.0)
    assert info.value.reason == "not_utf8"


# ---------------------------------------------------------------- after a failover


def test_a_new_leader_never_scales_down_in_its_first_window():
    # Takes over at t=5000 with 4 replicas; pressure is low from its first reading on.
    state = resume_state(5_000.0, 4)
    for t in range(5_000, 5_301, 15):  # the window includes its end
        d = decide(POLICY, float(t), 4, 4, 0, agg_of(0.1), state)
        assert (d.action, d.replicas) == ("hold", 4), t
        state = d.state
    d = decide(POLICY, 5_315.0, 4, 4, 0, agg_of(0.1), state)
    assert (d.action, d.replicas) == ("scale-down", 3)


def test_a_new_leader_keeps_the_scale_up_window_and_makes_no_burst():
    # A 60 s scale-up window: the new leader's first high readings do not scale up at
    # once (a fresh State would: its window would hold nothing but the new reading).
    p = Policy(max_replicas=10, scale_up_window=60.0)
    assert decide(p, 5_015.0, 2, 2, 0, agg_of(3.0), State()).action == "scale-up"
    state = resume_state(5_000.0, 2)
    decisions = []
    for t in range(5_015, 5_120, 15):
        d = decide(p, float(t), 2, 2, 0, agg_of(3.0), state)
        state = d.state
        decisions.append((t, d.action))
        if d.action == "scale-up":
            break
    # Holds while the observed count is in the window, then one scale-up.
    assert [a for _, a in decisions[:-1]] == ["hold"] * (len(decisions) - 1)
    assert decisions[-1] == (5_075, "scale-up")
    # With no stabilization window (the default), a high reading still scales up on the
    # first measured tick.
    assert decide(POLICY, 5_015.0, 2, 2, 0, agg_of(2.0), resume_state(5_000.0, 2)).action \
        == "scale-up"


def test_a_new_leader_s_first_window_starts_at_its_first_reading():
    # Took over at 5000, but the pods' metrics come only from 5100 on.
    state = resume_state(5_000.0, 4)
    d = decide(POLICY, 5_050.0, 4, 4, 0, agg_of(None), state)
    assert d.action == "hold" and d.state.observing_since is None
    state = d.state
    for t in range(5_100, 5_400, 15):  # a whole window of its own readings
        d = decide(POLICY, float(t), 4, 4, 0, agg_of(0.1), state)
        assert d.action == "hold", t
        state = d.state
    assert decide(POLICY, 5_400.0, 4, 4, 0, agg_of(0.1), state).action == "scale-down"


def test_the_crd_defaults_are_the_policy_defaults():
    """AutoscalingSpec takes its defaults from Policy, and policy_of maps them back."""
    from spillway_operator.flow.scaler import policy_of
    from spillway_operator.flow.spec import InferenceDeploymentSpec

    assert policy_of(InferenceDeploymentSpec(model={"name": "a/b"})) == Policy()


def test_with_a_disk_tier_only_what_the_disk_evicted_is_recomputed():
    """A chunk the host pool evicted is still on disk: host thrash is no pressure then,
    the disk tier's own thrash is (counted the same way, one anchor key per chunk)."""
    disk = {"disk_budget_bytes": 1e9, "disk_thrash_chunks": 0.0}
    prev = sample(0.0, **disk)
    host_only = sample(10.0, prompt_tokens=20_000.0, thrash_chunks=1_000.0, **disk)
    assert pod_pressure(prev, host_only, max_dt=60).components["thrash"] == 0.0
    both = sample(10.0, prompt_tokens=20_000.0, thrash_chunks=1_000.0,
                  **{**disk, "disk_thrash_chunks": 500 / 256})
    assert pod_pressure(prev, both, max_dt=60).components["thrash"] == pytest.approx(1.0)
    # a disk counter that went backwards (a restart) makes the pod unknown, as others do
    assert pod_pressure(sample(0.0, **{**disk, "disk_thrash_chunks": 9.0}), both, 60) is None
    # without a disk tier its counter is not read
    no_disk = sample(10.0, prompt_tokens=20_000.0, thrash_chunks=500 / 256)
    assert pod_pressure(sample(0.0), no_disk, max_dt=60).components["thrash"] == \
        pytest.approx(1.0)


def test_the_disk_series_are_parsed():
    text = TEXT + """# TYPE spillway_disk_tier_budget_bytes gauge
spillway_disk_tier_budget_bytes{engine="0",model_name="m",tier="SpillwayDiskTier"} 65536
# TYPE spillway_disk_tier_thrash counter
spillway_disk_tier_thrash_total{engine="0",model_name="m",tier="SpillwayDiskTier"} 7
"""
    s = parse_metrics(text, 1.0)
    assert s.values["disk_budget_bytes"] == 65536 and s.values["disk_thrash_chunks"] == 7


# ------------------------------------------------------------ decisions on recorded sequences


def replay(policy: Policy, demand: list[float], ready: int = 2,
           interval: float = 15.0) -> list[tuple[float, int, str]]:  # fmt: skip
    """Feed one reading per interval, as the autoscaler's tick would: ``demand`` is in
    replicas at target, so the pods' mean pressure is demand / replicas, and decided
    replicas become ready at once; (time, replicas, action) per decision."""
    state, current, out = State(), ready, []
    for i, w in enumerate(demand):
        t = i * interval
        d = decide(policy, t, current, current, 0, agg_of(w / current, n=current), state)
        state, current = d.state, d.replicas
        out.append((t, current, d.action))
    return out


def first_scale_up(decisions):
    return next((t for t, _, a in decisions if a == "scale-up"), None)


def test_the_forecast_scales_up_ahead_of_a_ramp():
    ramp = [1.0 + 0.1 * i for i in range(16)]  # demand rising 0.1 replica per 15 s
    reactive = replay(POLICY, ramp)
    ahead = replay(replace(POLICY, lead_seconds=120.0), ramp)
    assert first_scale_up(reactive) == 15 * 12  # pressure 1.1+: past the tolerance
    assert first_scale_up(ahead) is not None
    assert first_scale_up(ahead) <= first_scale_up(reactive) - 3 * 15  # three decisions early
    rising = tuple((-t, 1.0 + (120 - t) / 150) for t in (120, 90, 60, 30, 15))
    d = decide(replace(POLICY, lead_seconds=120.0), 0, 2, 2, 0, agg_of(0.9), State(demand=rising))
    assert d.action == "scale-up" and d.reason.startswith("demand rising"), d.reason


def test_the_forecast_ignores_noise_and_falling_demand():
    flat = [1.6, 1.4, 1.7, 1.5, 1.6, 1.4, 1.7, 1.6, 1.5, 1.6] * 3
    assert first_scale_up(replay(replace(POLICY, lead_seconds=120.0), flat)) is None
    falling = [3.0 - 0.09 * i for i in range(20)]
    assert replay(replace(POLICY, lead_seconds=120.0), falling, ready=3) == replay(
        POLICY, falling, ready=3)


def test_a_dip_shorter_than_a_model_load_is_held_through():
    dip = [3.0] * 8 + [0.9] * 8 + [3.0] * 8  # 120 s at 30 % of the load on 3 replicas
    for policy in (POLICY, replace(POLICY, lead_seconds=120.0)):
        assert {r for _, r, _ in replay(policy, dip, ready=3)} == {3}


def test_scale_down_keeps_the_replicas_whose_host_tier_is_hot():
    pods = [Candidate("hot", True, hot=9e5, host_tokens=2e5),
            Candidate("warm", True, hot=2e5, host_tokens=2e5),
            Candidate("cold", True, hot=1e3, host_tokens=2e5)]  # fmt: skip
    assert choose_removals(pods, 1) == ["cold"]
    assert choose_removals(pods, 2) == ["cold", "warm"]


def agg_terms(load=0.5, queue=0.0, thrash=0.0, preempt=0.0, n=2):
    comps = {"load": load, "queue": queue, "thrash": thrash, "preempt": preempt}
    return Aggregate(max(comps.values()), comps, n, 0, [0.0] * n, [1e9] * n)


def test_a_one_interval_burst_of_preemptions_is_a_transient_a_sustained_one_is_not():
    state = decide(POLICY, 0, 2, 2, 0, agg_terms(), State()).state
    d = decide(POLICY, 15, 2, 2, 0, agg_terms(preempt=2.0), state)
    assert d.action == "hold", d.reason  # 2.0 for one interval: about 0.17 averaged
    state, t = d.state, 15
    while d.action != "scale-up":
        t += 15
        d = decide(POLICY, t, 2, 2, 0, agg_terms(preempt=2.0), state)
        state = d.state
        assert t <= 15 * 12, "a sustained preemption rate never scaled up"
    assert t >= 60  # the average crosses 1.1 after about one half-life
    raw = decide(replace(POLICY, rate_half_life=0.0), 15, 2, 2, 0, agg_terms(preempt=2.0),
                 State())  # fmt: skip
    assert raw.action == "scale-up"  # without averaging: at once


def test_pods_without_a_reading_count_as_idle_when_scaling_up():
    # 4 ready, 2 measured at 1.5 (the two new ones have no second scrape yet): the
    # demand is 2 x 1.5 = 3 replicas, not 4 x 1.5 = 6.
    agg = Aggregate(1.5, {}, 2, 2, [0.0] * 2, [1e9] * 2)
    d = decide(POLICY, 0, 4, 4, 0, agg, State())
    assert d.action == "hold" and d.replicas == 4, d.reason
    agg = Aggregate(3.0, {}, 2, 2, [0.0] * 2, [1e9] * 2)
    assert decide(POLICY, 0, 4, 4, 0, agg, State()).replicas == 6


@pytest.mark.parametrize("pods, lead", [
    ([], 0.0),
    ([("2026-12-03T10:00:00Z", "2026-12-03T10:02:00Z")], 120.0),
    ([("2026-12-03T10:00:00Z", "2026-12-03T10:01:00Z"),
      ("2026-12-03T10:00:00Z", "2026-12-03T10:03:00Z"),
      ("2026-12-03T10:00:00Z", "2026-12-03T11:30:00Z")], 120.0),  # median of 60, 180, 5400
    ([("2026-12-03T10:00:00Z", "2026-12-03T12:00:00Z")], 0.0),  # stuck pods are no lead
    ([("2026-12-03T10:00:00Z", None), (None, None), ("junk", "2026-12-03T10:00:00Z")], 0.0),
    ([("2026-12-03T10:05:00Z", "2026-12-03T10:00:00Z")], 0.0),  # clock skew
])  # fmt: skip
def test_the_lead_is_the_median_start_up_of_the_pods(pods, lead):
    assert startup_seconds(pods) == lead
