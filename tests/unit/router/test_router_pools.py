"""spillway-router and GPU pools: a pool's pods find their own plan ConfigMap, and a
pool's replicas are weighed by the pool's measured rate (spillway_router.rates)."""

from __future__ import annotations

from collections import Counter

import pytest

from spillway_router.app import RouterConfig, RouterState
from spillway_router.backends import Backend, Profile
from spillway_router.kube import DeploymentInfo, backend_from_pod, workload_of
from spillway_router.rates import BOUND, PoolRates
from spillway_router.scoring import DEFAULT_BALANCE
from spillway_router.tokens import Prompt

PROFILE = Profile(tokens_per_hash=16, max_model_len=4096, host_bytes_per_token=1000.0)


def test_a_pools_pod_reads_its_pools_plan_and_carries_its_pool():
    labels = {"spillway.dev/inference-deployment": "chat", "spillway.dev/gpu-pool": "hopper"}
    assert workload_of(labels) == "chat-hopper"
    assert workload_of({"spillway.dev/inference-deployment": "chat"}) == "chat"
    pod = {"metadata": {"name": "chat-hopper-1", "namespace": "ns", "labels": labels},
           "status": {"phase": "Running", "podIP": "10.0.0.1",
                      "conditions": [{"type": "Ready", "status": "True"}]}}
    backend = backend_from_pod(pod, DeploymentInfo("m", PROFILE), None)
    assert backend is not None and backend.pool == "ns/chat/hopper"
    del labels["spillway.dev/gpu-pool"]
    assert backend_from_pod(pod, DeploymentInfo("m", PROFILE), None).pool is None


def test_rates_weigh_pools_against_their_mean_once_two_are_measured():
    rates = PoolRates()
    rates.observe("a", 3000, 1.0)
    assert rates.weights(["a", "b", None]) == {"a": 1.0, "b": 1.0, None: 1.0}
    rates.observe("b", 1000, 1.0)
    weights = rates.weights(["a", "b"])
    assert weights == pytest.approx({"a": 1.5, "b": 0.5})
    rates.observe("b", 1, 1000.0)  # one very slow answer: bounded, and averaged
    assert 1 / BOUND <= rates.weights(["a", "b"])["b"] < 0.5
    rates.observe("c", 0, 1.0)  # nothing to learn from
    assert "c" not in rates.rates


def state_of(*backends: Backend) -> RouterState:
    state = RouterState(RouterConfig(mode="approx"))
    for b in backends:
        state.upsert(b)
        state.set_healthy(b.name, True)
    return state


def spread(state: RouterState, requests: int) -> Counter[str]:
    """Cold requests that never finish: where they pile up under the load bound."""
    picks: Counter[str] = Counter()
    for i in range(requests):
        [first, *_], _ = state.route("m", Prompt(tokens=[i % 97 + 1, i, i + 7] * 40, text=None))
        state.inflight[first.name] += 1
        picks[first.name] += 1
    return picks


def test_a_faster_pools_replicas_carry_more_of_the_load():
    backends = [Backend(f"{pool}-{i}", "m", f"http://{pool}-{i}:8000", None, PROFILE,
                        pool=f"ns/chat/{pool}") for pool in ("fast", "slow") for i in range(2)]
    even = spread(state_of(*backends), 200)
    assert abs(sum(v for k, v in even.items() if k.startswith("fast")) - 100) <= 10
    state = state_of(*backends)
    state.rates.observe("ns/chat/fast", 3000, 1.0)  # three times the tokens a second
    state.rates.observe("ns/chat/slow", 1000, 1.0)
    weighed = spread(state, 200)
    fast = sum(v for k, v in weighed.items() if k.startswith("fast"))
    slow = sum(v for k, v in weighed.items() if k.startswith("slow"))
    # The slow pool's share is its weight's (0.5 of 2: a quarter of the requests),
    # with the bounded load's slack (DEFAULT_BALANCE, 1.25) on top.
    assert slow <= DEFAULT_BALANCE * 200 / 4 + 2 and fast >= 2 * slow, weighed
