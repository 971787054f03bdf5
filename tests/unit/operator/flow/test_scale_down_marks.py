"""Scale-down that knows the cache: which pods the operator marks for removal
(spillway_operator.flow.pressure, pure), and how spillway-router treats a marked pod and a
pod that is gone (RouterState, in process)."""

from __future__ import annotations

import math

import pytest

from spillway_engine.planner.plan import read_plan
from spillway_operator.flow.pressure import (
    DELETION_COST,
    DRAINING,
    Candidate,
    Sample,
    choose_removals,
    hot_host_tokens,
    parse_cost,
    removal_cost,
    stale_marks,
)
from spillway_router import kube as router_kube
from spillway_router.app import RouterConfig, RouterState
from spillway_router.backends import profile_from_plan
from spillway_router.index import GPU, HOST
from spillway_router.kube import DeploymentInfo, backend_from_pod
from spillway_router.tokens import Prompt
from tests.unit.simulator_support import LLAMA, PLANS

# ------------------------------------------------------------------ hot host cache


def s(t: float, hits: float, **more: float) -> Sample:
    return Sample(t, {"host_hit_tokens": hits, **more})


def test_hot_host_tokens_adds_new_hits_and_decays_old_ones() -> None:
    hot = hot_host_tokens(0.0, None, s(0, 500), tau=100)
    assert hot == 0.0  # one scrape: nothing known yet
    hot = hot_host_tokens(hot, s(0, 500), s(10, 1500), tau=100)
    assert hot == 1000
    # idle for one time constant: the record keeps e^-1 of itself
    hot = hot_host_tokens(hot, s(10, 1500), s(110, 1500), tau=100)
    assert hot == pytest.approx(1000 / math.e)
    assert hot > 0  # an idle pod that served from its host tier still ranks above a cold one


def test_hot_host_tokens_after_a_restart_and_on_bad_samples() -> None:
    # counter went backwards: the pod restarted, its old cache is gone
    assert hot_host_tokens(5000.0, s(0, 9000), s(10, 300), tau=100) == 300
    # no time passed, or a NaN: the record stays as it was
    assert hot_host_tokens(42.0, s(10, 0), s(10, 100), tau=100) == 42.0
    assert hot_host_tokens(42.0, s(0, 0), s(10, float("nan")), tau=100) == 42.0
    # no memory at all without a time constant
    assert hot_host_tokens(42.0, s(0, 0), s(10, 7), tau=0) == 7


# ------------------------------------------------------------------ which pods go


def c(name: str, hot: float = 0.0, **kw) -> Candidate:
    return Candidate(name, kw.pop("ready", True), hot, **kw)


def test_the_least_hot_host_cache_goes() -> None:
    pods = [c("a", 9000), c("b", 10), c("c", 4000)]
    assert choose_removals(pods, 1) == ["b"]
    assert choose_removals(pods, 2) == ["b", "c"]
    assert choose_removals(pods, 5) == ["b", "c", "a"]
    assert choose_removals(pods, 0) == [] and choose_removals(pods, -1) == []


def test_a_leader_worker_set_loses_its_highest_groups_whatever_they_cache() -> None:
    """LeaderWorkerSet removes the groups of the highest indices and reads no deletion
    cost: marking the coldest leader would drain a group that stays and leave the one
    that goes serving to the end."""
    pods = [c("g0", 10, group=0), c("g1", 9000, group=1), c("g2", 8000, group=2),
            c("g3", 20, group=3, ready=False)]
    # g3 (unready) and g2 go, the hottest caches or not; g3 is not marked (nothing to drain)
    assert choose_removals(pods, 2) == ["g2"]
    assert choose_removals(pods, 3) == ["g2", "g1"]
    assert choose_removals(pods, 0) == []
    from spillway_operator.flow.scaler import _group_index
    from spillway_operator.names import LWS_GROUP_INDEX
    assert _group_index({"labels": {LWS_GROUP_INDEX: "12"}}) == 12
    assert _group_index({"labels": {LWS_GROUP_INDEX: "x"}}) is None
    assert _group_index({"labels": {}}) is None and _group_index({}) is None


def test_ties_go_by_host_pool_fill_then_newest_then_name() -> None:
    pods = [c("a", host_tokens=5.0, created="2026-01-01T00:00:00Z"),
            c("b", host_tokens=1.0, created="2026-01-01T00:00:00Z"),
            c("c", host_tokens=1.0, created="2026-01-02T00:00:00Z")]
    assert choose_removals(pods, 1) == ["c"]  # same fill: the newer pod
    assert choose_removals(pods, 2) == ["c", "b"]
    same = [c("y"), c("x")]
    assert choose_removals(same, 1) == ["x"]


def test_unready_pods_go_first_and_are_not_marked() -> None:
    # The ReplicaSet controller removes an unready pod before it compares costs.
    pods = [c("a", 9000), c("b", 10), c("starting", ready=False)]
    assert choose_removals(pods, 1) == []
    assert choose_removals(pods, 2) == ["b"]


def test_a_pod_already_marked_stays_chosen() -> None:
    # A scale-down in flight: its pod is still going, whatever its cache looks like now.
    pods = [c("a", 9000, marked=True), c("b", 10)]
    assert choose_removals(pods, 1) == ["a"]
    assert choose_removals(pods, 2) == ["a", "b"]


def test_the_cost_is_below_every_kept_pod() -> None:
    assert removal_cost([]) == -1
    assert removal_cost([0, 0]) == -1
    assert removal_cost([10, 3]) == -1  # absent counts as 0: below that too
    assert removal_cost([0, -50]) == -51
    assert removal_cost([-(2**31)]) == -(2**31)  # int32, as the controller parses it
    assert parse_cost(None) == 0 and parse_cost(" 7 ") == 7
    assert parse_cost("cheap") == 0 and parse_cost(str(2**31)) == 0


def test_stale_marks_go_and_in_flight_ones_stay() -> None:
    # 3 live pods, replicas 2: one pod is still to go, its mark stays.
    assert stale_marks(["a"], live=3, replicas=2) == []
    # The scale write failed or was reversed: replicas back to the live count.
    assert stale_marks(["a"], live=3, replicas=3) == ["a"]
    # Someone scaled up past the live pods.
    assert stale_marks(["a", "b"], live=2, replicas=4) == ["a", "b"]
    # More marks than pods to go: those chosen now stay, the others go.
    assert stale_marks(["a", "b"], live=3, replicas=2, chosen=["b"]) == ["a"]
    assert stale_marks(["a", "b"], live=3, replicas=2) == ["b"]
    assert stale_marks([], live=1, replicas=5) == []


# ------------------------------------------------------------------ the router

PROFILE = profile_from_plan(read_plan((PLANS / LLAMA).read_bytes(), LLAMA))
INFO = DeploymentInfo("m", PROFILE)


IPS = {"a": "10.0.0.1", "b": "10.0.0.2"}


def pod(name: str, annotations: dict[str, str] | None = None) -> dict:
    return {
        "metadata": {"name": name, "annotations": annotations or {}},
        "status": {"phase": "Running", "podIP": IPS[name],
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


def router(*pods: dict) -> RouterState:
    state = RouterState(RouterConfig(mode="approx"))
    for p in pods:
        b = backend_from_pod(p, INFO, None)
        assert b is not None
        state.upsert(b)
        state.set_healthy(b.name, True)
    return state


def test_the_router_reads_the_operators_mark() -> None:
    assert router_kube.DRAINING == DRAINING
    marked = {DELETION_COST: "-1", DRAINING: "true"}
    assert backend_from_pod(pod("a", marked), INFO, None).draining
    assert not backend_from_pod(pod("a"), INFO, None).draining


def test_a_draining_pod_takes_no_new_request_even_when_it_holds_the_prefix() -> None:
    state = router(pod("a"), pod("b"))
    prompt = Prompt(tokens=list(range(1000, 1000 + 64 * PROFILE.tokens_per_hash)), text=None)
    order, keys = state.route("m", prompt)
    first = order[0].name
    state.served(first, prompt, keys)
    other = "b" if first == "a" else "a"
    # the prefix now lives on `first`: it keeps getting the prompt ...
    assert [b.name for b in state.route("m", prompt)[0]] == [first, other]
    # ... until the operator marks it (the pod watch delivers the new annotation)
    state.upsert(backend_from_pod(pod(first, {DRAINING: "true"}), INFO, None))
    for _ in range(20):
        order, _ = state.route("m", prompt)
        assert order[0].name == other
        assert order[-1].name == first  # a retry target of last resort only
    # in-flight requests on it are not touched: its load and index stay until it goes
    assert state.approx.index.match(keys, [first])[first].units > 0
    # A mark taken off again (the scale-down was reversed): back to the prefix holder.
    state.upsert(backend_from_pod(pod(first), INFO, None))
    assert state.route("m", prompt)[0][0].name == first


def test_a_draining_pod_alone_still_serves() -> None:
    # Better slow than a 503: the last pod of a model keeps serving until it goes.
    state = router(pod("a", {DRAINING: "true"}))
    prompt = Prompt(tokens=list(range(64)), text=None)
    assert [b.name for b in state.route("m", prompt)[0]] == ["a"]


def test_a_pod_that_goes_takes_its_index_entries_with_it() -> None:
    state = router(pod("a"), pod("b"))
    prompt = Prompt(tokens=list(range(5000, 5000 + 16 * PROFILE.tokens_per_hash)), text=None)
    _, keys = state.route("m", prompt)
    state.served("a", prompt, keys)  # what the router remembers without events
    state.index.store("a", GPU, keys[:4])  # and what a's KV events said
    state.index.store("a", HOST, keys)
    state.on_event_batch("a")
    state.index.store("b", GPU, keys[:2])
    assert state.approx.index.match(keys, ["a"])["a"].units == len(keys)
    # The pod watch's DELETED event (or the pod turning unready) calls remove().
    state.remove("a")
    assert "a" not in state.backends and "a" not in state.events_live
    for tier in (GPU, HOST):
        assert state.index.tier_size("a", tier) == 0
        assert state.approx.index.tier_size("a", tier) == 0
    assert state.index.match(keys, ["a"])["a"].units == 0
    assert state.index.tier_size("b", GPU) == 2  # the other pod's entries stay
    assert [b.name for b in state.route("m", prompt)[0]] == ["b"]
