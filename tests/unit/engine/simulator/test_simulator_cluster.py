"""Several replicas on one virtual clock (the autoscaling benchmark's substrate)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spillway_cli.loadgen import TraceSpec, generate_trace, to_replay_items
from spillway_engine.simulator.cluster import VirtualCluster
from spillway_engine.simulator.plan_input import gpu_blocks_for_tokens
from tests.unit.simulator_support import sim_plan


def chat_items(n=300, rate=10.0):
    spec = TraceSpec(kind="chat", rate=rate, num_requests=n, duration=None, users=12,
                     turns=6, system_tokens=300, user_tokens=80, reply_tokens=80,
                     max_tokens=8, seed=4)  # fmt: skip
    return to_replay_items(generate_trace(spec))


def cluster(**kw) -> VirtualCluster:
    plan = sim_plan()
    return VirtualCluster(plan, gpu_blocks=gpu_blocks_for_tokens(plan, 16384), **kw)


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_round_robin_spreads_and_metrics_are_scrapable():
    c = cluster(replicas=3)
    reqs = c.replay(chat_items())
    assert len(reqs) == 300 and all(r.num_output == 8 for r in reqs)
    texts = c.scrape_all()
    assert len(texts) == 3
    counts = [
        sample(t, "vllm:request_success_total", finished_reason="length") for t in texts.values()
    ]
    assert counts == [100.0, 100.0, 100.0]
    assert all(sample(t, "vllm:num_requests_running") == 0 for t in texts.values())


def test_prefix_affinity_keeps_conversations_together():
    def device_hits(routing: str) -> float:
        c = cluster(replicas=3, routing=routing)
        c.replay(chat_items())
        return sum(r.core.counters.cached_device for r in c.replicas)

    assert device_hits("prefix-affinity") > 1.5 * device_hits("round-robin")


def test_scaling_up_and_down_while_traffic_flows():
    c = cluster(replicas=1)
    seen = []

    def autoscale(cl: VirtualCluster) -> None:
        seen.append(len(cl.serving))
        if cl.now >= 10 and cl.now < 20:
            cl.scale_to(3)
        elif cl.now >= 20:
            cl.scale_to(1)

    c.replay(chat_items(n=300, rate=10), tick=5.0, on_tick=autoscale)
    assert 3 in seen and seen[-1] == 1
    assert len(c.replicas) == 1  # the two extra replicas drained and left
    assert len(c.retired) == 2
    assert all(r.core.counters.requests_finished > 0 for r in c.retired)
    total = sum(r.core.counters.requests_finished for r in c.replicas + c.retired)
    assert total == 300


def test_invalid_arguments():
    with pytest.raises(ValueError):
        cluster(replicas=0)
    with pytest.raises(ValueError):
        cluster(routing="random")
    with pytest.raises(ValueError):
        cluster().scale_to(0)


def test_a_stalled_core_raises_or_is_broken_by_a_preemption():
    # 2,048 tokens of GPU KV for 1,088-token shared-prefix prompts: requests whose host
    # load finished hold blocks and wait for more, and nothing runs to free any.
    spec = TraceSpec(kind="shared-prefix", rate=20.0, num_requests=400, duration=None,
                     prefixes=6, prefix_tokens=1024, question_tokens=64, max_tokens=64,
                     seed=1)  # fmt: skip
    items = to_replay_items(generate_trace(spec))
    plan = sim_plan()
    with pytest.raises(RuntimeError, match="stalled"):
        VirtualCluster(plan, gpu_blocks=gpu_blocks_for_tokens(plan, 2048)).replay(items)
    c = VirtualCluster(plan, gpu_blocks=gpu_blocks_for_tokens(plan, 2048), break_stalls=True)
    reqs = c.replay(items)
    assert c.stalls > 0
    assert all(r.num_output == 64 for r in reqs) and len(reqs) == 400
    counters = c.replicas[0].core.counters
    assert counters.preemptions >= c.stalls  # each broken stall is a preemption
    assert sum(r.num_preemptions for r in reqs) == counters.preemptions
