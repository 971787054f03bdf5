"""bench/autoscale: its traces are pure functions of the seed with the shapes they claim,
its baselines follow the algorithms they name, and the sweep report picks each policy's
best-tuned target the way the README reads it."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import autoscale as bench  # noqa: E402
from bench import autoscale_policies as policies  # noqa: E402
from bench import autoscale_traces as traces  # noqa: E402
from spillway_operator.flow.pressure import Sample  # noqa: E402


def _arrivals_in(items, lo, hi):
    return sum(1 for it in items if lo <= it.arrival < hi)


@pytest.mark.parametrize("build, kw", [
    (traces.bursty, {"duration": 300.0}),
    (traces.diurnal, {"duration": 300.0}),
    (traces.multitenant, {"duration": 300.0}),
    (traces.flash, {"duration": 300.0, "start": 100.0, "rise": 20.0, "hold": 100.0}),
    (traces.longctx, {"duration": 300.0}),
    (traces.agentic, {"duration": 300.0}),
])  # fmt: skip
def test_a_trace_is_a_pure_function_of_its_seed(build, kw):
    a, b, c = build(1, **kw), build(1, **kw), build(2, **kw)
    assert [(i.arrival, list(i.prompt), i.session) for i in a.items] == [
        (i.arrival, list(i.prompt), i.session) for i in b.items]
    assert [i.arrival for i in a.items] != [i.arrival for i in c.items]
    assert [i.rid for i in a.items] == list(range(len(a.items)))
    assert all(0 <= i.arrival <= a.duration for i in a.items)
    assert a.phases[0][1] == 0.0 and a.phases[-1][2] == a.duration


def test_the_flash_crowd_multiplies_the_load_by_five_within_a_minute():
    sc = traces.flash(0, duration=900.0, start=300.0, rise=60.0, hold=300.0)
    before = _arrivals_in(sc.items, 0, 300) / 300
    crowd = _arrivals_in(sc.items, 360, 660) / 300
    assert 4.0 < crowd / before < 6.0, (before, crowd)
    assert sc.rate(300.0) == pytest.approx(2.0) and sc.rate(360.0) == pytest.approx(10.0)


def test_the_diurnal_day_goes_ten_times_up_and_back():
    sc = traces.diurnal(0, duration=1200.0)
    night = _arrivals_in(sc.items, 0, 120) + _arrivals_in(sc.items, 1080, 1200)
    noon = _arrivals_in(sc.items, 540, 660)
    assert noon / (night / 2) > 5.0, (night, noon)
    assert sc.rate(0.0) == pytest.approx(1.2) and sc.rate(600.0) == pytest.approx(12.0)


def test_multitenant_conversations_share_their_tenants_system_prompt():
    sc = traces.multitenant(3, duration=600.0)
    spec = traces.Tenants()
    heads = {tuple(i.prompt[: spec.system_tokens]) for i in sc.items}
    assert 1 < len(heads) <= spec.tenants
    by_session: dict[str, list] = {}
    for it in sc.items:
        by_session.setdefault(it.session, []).append(it.prompt)
    turns = max(len(v) for v in by_session.values())
    assert 1 < turns <= spec.turns
    for prompts in by_session.values():  # each turn re-sends the conversation so far
        for a, b in itertools.pairwise(prompts):
            assert list(b[: len(a) - 1]) == list(a[:-1])
    assert sc.plan_file == traces.GEMMA_PLAN


def test_long_context_prompts_are_8k_to_32k_with_few_shared_prefixes():
    sc = traces.longctx(1, duration=500.0)
    spec = traces.Retrieval()
    lengths = [len(i.prompt) for i in sc.items]
    assert min(lengths) >= spec.shortest - 1 and max(lengths) <= spec.longest
    assert max(lengths) + spec.max_tokens <= 32768  # the plan's max_model_len
    docs = {tuple(i.prompt[spec.instruction_tokens: spec.instruction_tokens + 256])
            for i in sc.items}
    hot = sum(1 for i in sc.items if i.session.startswith("doc/"))
    assert 0.15 < hot / len(sc.items) < 0.35  # a quarter on the six hot documents
    assert len(docs) > 0.6 * len(sc.items)  # the rest each on its own
    assert sc.ttft_target == 4.0 and bench.ttft_of(sc, None) == 4.0
    assert bench.ttft_of(sc, 2.0) == 2.0  # --ttft-target overrides the trace's
    assert sc.rate(0.0) == pytest.approx(0.25) and sc.rate(spec.start + spec.rise) == 2.0


def test_agent_sessions_pause_between_turns_on_a_growing_shared_context():
    sc = traces.agentic(2, duration=500.0)
    spec = traces.Agents()
    by_session: dict[str, list] = {}
    for it in sc.items:
        by_session.setdefault(it.session, []).append(it)
    heads = {tuple(i.prompt[:512]) for i in sc.items}
    assert len(heads) <= spec.agents  # every session opens on one of the agents' prompts
    turns = [len(v) for v in by_session.values()]
    assert max(turns) <= spec.max_turns and sum(turns) / len(turns) > spec.min_turns - 1
    for items in by_session.values():
        for a, b in itertools.pairwise(items):
            gap = b.arrival - a.arrival
            assert spec.reply_seconds + spec.min_pause - 1e-6 <= gap
            assert gap <= spec.reply_seconds + spec.max_pause + 1e-6
            # the next turn re-sends the session so far, with the reply and a tool's output
            assert list(b.prompt[: len(a.prompt) - 1]) == list(a.prompt[:-1])
            grown = len(b.prompt) - len(a.prompt)
            assert spec.reply_tokens + spec.min_tool_tokens <= grown
            assert grown <= spec.reply_tokens + spec.max_tool_tokens + 8


def test_the_token_velocity_baseline_is_llm_d_s_calibration_and_triggers():
    """V_P = CHUNK / median TTFT of sequential cache-missing CHUNK-token prompts on an
    idle replica (calibrate.sh); replicas = max(ceil(backlog s / target), ceil(sum kv /
    0.8)), one pod per 180 s up and per 300 s down after the 300 s window."""
    v_p = policies.calibrate_peak_prefill(traces.LLAMA_PLAN, 1024)
    # the simulator's engine: 4 ms a step + 60 us a prompt token, one 8,192-token chunk
    assert v_p == pytest.approx(8192 / (0.004 + 8192 * 60e-6), rel=0.03)
    vel = bench.make_policy("velocity", 1.5)
    vel.peak_prefill = 10_000.0

    def text(inflight: float, kv: float) -> str:
        return _texts(gpu_kv=kv) + f"{bench.INFLIGHT_TOKENS} {inflight}\n"

    backlog = {"a": text(40_000, 0.1)}  # 4 s of prefill backlog on one replica
    assert vel.tick(15, backlog, 1, 0).replicas == 2  # raw ceil(4 / 1.5) = 3, +1 a step
    assert vel.tick(30, backlog, 2, 1).replicas == 2  # the next pod after 180 s
    assert vel.tick(200, backlog, 2, 0).replicas == 3
    full = {"a": text(0, 0.95), "b": text(0, 0.95), "c": text(0, 0.9)}
    assert vel._desired(2.8, 0.8, 3) == 4  # KV: ceil(2.8 / 0.8)
    assert vel.tick(400, full, 3, 0).replicas == 4
    idle = {"a": text(0, 0.1), "b": text(0, 0.1), "c": text(0, 0.1), "d": text(0, 0.1)}
    assert vel.tick(500, idle, 4, 0).replicas == 4  # the 300 s window
    assert vel.tick(720, idle, 4, 0).replicas == 3
    assert vel.tick(735, idle, 3, 0).replicas == 3  # one pod per 300 s
    assert vel.tick(1030, idle, 3, 0).replicas == 2


def test_the_sweep_takes_a_seed_list():
    assert bench.parse_seeds("5") == [0, 1, 2, 3, 4]
    assert bench.parse_seeds("0,1,2,13,21") == [0, 1, 2, 13, 21]


def test_a_sweep_reuses_an_earlier_sweeps_runs_but_reruns_spillway(tmp_path, monkeypatch):
    old = [{"trace": "bursty", "seed": 0, "policy": p, "target": t, "rm": 1.0, "met": 1.0}
           for p, t in (("static", 2), ("spillway", 1.0))]
    (tmp_path / "old.json").write_text(bench.json.dumps(old))
    ran: list[tuple] = []

    def fake(job):
        ran.append(job)
        return {"trace": job[0], "seed": job[1], "policy": job[3], "target": job[4],
                "rm": 2.0, "met": 0.5}

    monkeypatch.setattr(bench, "_sweep_job", fake)

    class Pool:
        def __init__(self, *a, **k): ...
        def __enter__(self): return self
        def __exit__(self, *a): return False
        def imap_unordered(self, f, jobs): return map(f, jobs)

    monkeypatch.setattr(bench.multiprocessing, "get_context", lambda _: type(
        "Ctx", (), {"Pool": Pool})())
    out = tmp_path / "rows.json"
    bench.main(["--sweep", "--trace", "bursty", "--seeds", "1", "--policies",
                "spillway,static", "--reuse", str(tmp_path / "old.json"), "--out", str(out)])
    rows = {(r["policy"], r["target"]): r for r in bench.json.loads(out.read_text())}
    assert rows[("static", 2)]["rm"] == 1.0  # taken from the earlier sweep
    assert rows[("spillway", 1.0)]["rm"] == 2.0  # run again
    assert ("static", 2) not in {(j[3], j[4]) for j in ran}


def _texts(**values):
    lines = []
    names = {"gpu_kv": "vllm:kv_cache_usage_perc", "waiting": "vllm:num_requests_waiting",
             "running": "vllm:num_requests_running"}  # fmt: skip
    for key, v in values.items():
        lines += [f"# TYPE {names[key]} gauge", f'{names[key]}{{engine="0"}} {v}']
    return "\n".join(lines) + "\n"


def test_the_hpa_baseline_follows_kubernetes_rules():
    hpa = bench.make_policy("hpa-kv", 0.6)
    two = {"a": _texts(gpu_kv=0.9), "b": _texts(gpu_kv=0.9)}
    assert hpa.tick(15, two, 2, 0).replicas == 3  # ceil(2 * 0.9 / 0.6)
    same = {"a": _texts(gpu_kv=0.62), "b": _texts(gpu_kv=0.58)}
    assert hpa.tick(30, same, 3, 0).replicas == 3  # within tolerance
    idle = {"a": _texts(gpu_kv=0.1), "b": _texts(gpu_kv=0.1), "c": _texts(gpu_kv=0.1)}
    assert hpa.tick(45, idle, 3, 0).replicas == 3  # the 300 s window holds the 3
    assert hpa.tick(400, idle, 3, 0).replicas == 1
    keda = bench.make_policy("keda", 8.0)
    busy = {"a": _texts(running=12, waiting=4)}
    assert keda.tick(15, busy, 1, 0).replicas == 2  # ceil(16 / 8)


def test_the_dynamo_baseline_moves_one_replica_per_adjustment_and_brakes_when_cold():
    dyn = policies.DynamoPolicy(0.7)
    hot = {"a": _texts(gpu_kv=0.9, waiting=0, running=4)}
    assert dyn.tick(15, hot, 1, 0).replicas == 2
    assert dyn.tick(30, hot, 2, 0).replicas == 2  # within the 60 s adjustment interval
    assert dyn.tick(90, hot, 2, 1).replicas == 2  # a replica is starting
    assert dyn.tick(90, hot, 2, 0).replicas == 3
    dyn.hit_mean = 0.9
    cold = ("# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine=\"0\"} %d\n"
            + _texts(gpu_kv=0.1, waiting=0, running=1))  # fmt: skip
    dyn.prev = {"a": policies.parse_metrics(cold % 0, 150)}
    assert dyn.tick(165, {"a": cold % 1000}, 3, 0).replicas == 3  # hit rate 0: no scale-down
    dyn.prev, dyn.hit_mean = {}, None
    assert dyn.tick(240, {"a": cold % 2000}, 3, 0).replicas == 2
    assert isinstance(dyn.prev["a"], Sample)


@pytest.mark.parametrize("name", list(bench.SWEEP_TARGETS))
def test_every_policy_runs_a_short_trace(name):
    sc = traces.bursty(0, duration=240.0)
    res = bench.run_policy(bench.make_policy(name, bench.DEFAULT_TARGET[name]), sc, 0)
    s = bench.summarize(res, 2.0)
    assert 0 < s["rm"] <= policies.MAX_REPLICAS * 240 / 60
    assert 0.0 <= s["met"] <= 1.0 and res.offered == len(sc.items)
    assert len(res.ticks) == 240 // bench.INTERVAL


def test_the_report_takes_each_policys_cheapest_target_at_the_median():
    rows = []
    for seed, (m1, m2) in enumerate([(0.999, 0.95), (0.991, 0.995), (0.97, 0.999)]):
        rows += [
            {"trace": "t", "policy": "hpa-kv", "target": 0.5, "seed": seed, "rm": 80 + seed,
             "met": m1},
            {"trace": "t", "policy": "hpa-kv", "target": 0.7, "seed": seed, "rm": 60 + seed,
             "met": m2},
            {"trace": "t", "policy": "spillway", "target": bench.DEFAULT_TARGET["spillway"],
             "seed": seed, "rm": 70.0, "met": 0.996},
        ]  # fmt: skip
    pts = bench.points(rows, "t")
    assert pts[("hpa-kv", 0.5)] == {"rm": 81, "met": 0.991, "worst": 0.97, "seeds": 3}
    assert bench.cheapest(pts, "hpa-kv", 0.99)[0] == 0.7  # median 0.995 at 61
    assert bench.cheapest(pts, "hpa-kv", 0.999) is None
    report = "\n".join(bench.frontier_report(rows, ["t"]))
    assert "at >= 99.0%: best tuned baseline hpa-kv [0.7] 61.0; spillway default: " \
        "+9.0 replica-minutes vs hpa-kv" in report
    assert "at >= 99.9%" not in report  # nobody reached it


def test_one_setting_for_all_traces_needs_the_level_on_every_trace():
    """The HPA wins each trace with another target; with one target for both it must
    take the one that holds on both, and pays the sum."""
    rows = [
        {"trace": tr, "policy": p, "target": t, "seed": 0, "rm": rm, "met": met}
        for tr, p, t, rm, met in [
            ("a", "hpa-kv", 0.5, 90.0, 0.999), ("a", "hpa-kv", 0.8, 60.0, 0.995),
            ("b", "hpa-kv", 0.5, 95.0, 0.999), ("b", "hpa-kv", 0.8, 55.0, 0.90),
            ("a", "spillway", 1.0, 70.0, 0.995), ("b", "spillway", 1.0, 72.0, 0.992),
        ]
    ]  # fmt: skip
    report = bench.one_setting_report(rows, ["a", "b"])
    [hpa] = [ln for ln in report if ln.strip().startswith("hpa-kv")]
    [ours] = [ln for ln in report if ln.strip().startswith("spillway")]
    assert hpa.split()[1:5] == ["185.0", "[0.5]", "185.0", "[0.5]"]  # 0.8 fails trace b
    assert ours.split()[1:5] == ["142.0", "[1]", "142.0", "[1]"] and ours.split()[-1] == "-"
    assert bench.one_setting_report(rows, ["a"]) == []


@pytest.mark.parametrize("trace", ["bursty", "agentic"])
def test_the_fleet_replay_trace_fits_the_tiny_model_and_its_sides_agree_on_the_plan(trace):
    """bench/autoscale_replay: each trace it plays on real engines is seeded, inside the
    tiny tokenizer's ids and the engines' max_model_len (a request vLLM rejects would
    miss on the fleet and in the simulator alike, telling nothing), keeps shared
    prefixes shared, and its simulator side runs the plan the operator makes."""
    from bench import autoscale_replay as replay

    make = replay.FLEET_TRACES[trace]
    a, b = make(1, 300.0), make(1, 300.0)
    assert [list(i.prompt) for i in a] == [list(i.prompt) for i in b]
    assert [list(i.prompt) for i in make(2, 300.0)] != [list(i.prompt) for i in a]
    lo, hi = replay.VOCAB
    assert all(lo <= t < hi for i in a for t in i.prompt)
    limit = replay.SPEC["engine"]["maxModelLen"]
    assert max(len(i.prompt) + i.max_tokens for i in a) <= limit
    if trace == "bursty":
        shared = [i for i in a if i.session and i.session.startswith("sp/")]
        by_prefix: dict[str, set[tuple[int, ...]]] = {}
        for i in shared:
            by_prefix.setdefault(i.session, set()).add(tuple(i.prompt[:512]))
        assert shared and all(len(v) == 1 for v in by_prefix.values())
    else:  # a session's turns grow one prompt; the agents' contexts are shared
        sessions: dict[str, list[list[int]]] = {}
        for i in a:
            sessions.setdefault(i.session, []).append(list(i.prompt))
        assert max(len(v) for v in sessions.values()) >= 3
        for turns in sessions.values():
            for prev, nxt in itertools.pairwise(turns):
                assert nxt[:len(prev)] == prev
        assert len({tuple(t[0][:300]) for t in sessions.values()}) <= 4
    _, plan = replay.planned()
    assert len(plan.kv_groups) == 4 and plan.offloader == "spillway"
    sim = replay.simulate(a, plan.model_dump_json(), duration=300.0, load_delay=30.0,
                          overhead_s=0.005, scheduler=bench.SchedulerConfig(max_model_len=limit),
                          seed=1)
    assert len(sim.ttfts) == len(a) and sim.replica_minutes >= 5.0


def test_the_replay_reads_the_operators_decisions_from_its_log():
    """The same lines from the operator as a process and from its pod's log."""
    from bench import autoscale_replay as replay

    log = ("2026-12-06 17:00:01 INFO gated-replay/replay: replicas 1 -> 2 (pressure 1.3)\n"
           "2026-12-06 17:00:02 INFO gated-replay/other: replicas 1 -> 3 (x)\n"
           "2026-12-06 17:00:09 INFO gated-replay/replay: replicas 2 -> 1 (low)\n"
           '{"message": "gated-replay/replay: replicas 1 -> 3 (rising)", "severity": "info"}\n'
           '{"message": "not json\n')
    assert replay._decisions(log) == ["replicas 1 -> 2 (pressure 1.3)", "replicas 2 -> 1 (low)",
                                      "replicas 1 -> 3 (rising)"]


def test_the_replay_reads_the_engines_scheduler_limits_from_vllms_log():
    from bench import autoscale_replay as replay

    log = ("INFO ... Chunked prefill is enabled with max_num_batched_tokens=2048.\n"
           "INFO ... max_num_seqs=64 ...")
    got = replay._scheduler(log, 1024)
    assert (got.max_num_batched_tokens, got.max_num_seqs, got.max_model_len) == (2048, 64, 1024)
    assert replay._scheduler("", 512).max_num_batched_tokens == 8192


def test_the_onset_oracle_reacts_at_the_rise_s_first_second_and_no_sooner():
    """--onset: one replica until the rate leaves its starting level, N from then to the
    end of that phase, one after; the ceiling of any policy that holds no spare replica."""
    sc = traces.flash(0, duration=300.0, start=100.0, rise=20.0, hold=100.0)
    oracle = bench.OnsetPolicy(3, sc)
    assert oracle.start == 101  # the first whole second the rate is above 2 req/s
    ask = {t: oracle.tick(float(t), {}, 1, 0).replicas for t in (0, 90, 101, 150, 239, 240)}
    assert ask == {0: 1, 90: 1, 101: 3, 150: 3, 239: 3, 240: 1}


def test_the_spillway_policy_learns_what_a_request_costs_from_the_replicas():
    """The throughput term's backlog needs the cost of a request, learned from
    vllm:request_success: the bench's lean observer must export it as the engine does."""
    from spillway_operator.flow.throughput import capacity

    sc = traces.bursty(0, duration=240.0)
    policy = bench.make_policy("spillway", 1.0)
    res = bench.run_policy(policy, sc, 0)
    finished = sum(1 for r in res.requests if r.finish_time is not None)
    assert finished > 0 and policy.learner.per_request[2] > 0
    assert capacity(policy.learner).request_cost > 0


def test_one_run_takes_a_policy_at_a_target_of_its_own(capsys):
    """--policies hpa-kv:0.6: the side-by-side runs the README's bursty paragraph quotes;
    a target that is not a number, or an unknown policy, is refused by name."""
    assert bench.main(["--trace", "flash", "--duration", "120", "--policies", "static:2"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("static"))
    assert row.split()[1] == "2"
    for bad in ("static:two", "nonesuch"):
        with pytest.raises(SystemExit):
            bench.main(["--policies", bad])


def test_the_replay_reads_the_pods_counters_over_their_labels():
    """The fleet's side: prompt, host-hit and GPU-hit tokens and preemptions, summed over
    label sets; a series that only starts with a counter's name is not that counter."""
    from bench import autoscale_replay as replay

    text = ('vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0\n'
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 50.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0\n'
            'vllm:prefix_cache_hits_total_other 99.0\n'
            'spillway_host_hit_tokens_total{engine="0",model_name="m"} 40.0\n'
            'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0\n'
            '# HELP vllm:num_preemptions_total x\n')
    assert replay._counters(text) == {
        "vllm:prompt_tokens_total": 150.0, "spillway_host_hit_tokens_total": 40.0,
        "vllm:prefix_cache_hits_total": 30.0, "vllm:num_preemptions_total": 2.0}
