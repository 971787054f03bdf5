"""The host manager's cache policy is vLLM's own object, and vLLM's manager tests hold.

vLLM's own tests of ``CPUOffloadingManager`` (LRU and ARC) read and write the policy
object directly: ``isinstance(manager._policy, ARCCachePolicy)``, its T1/T2/B1/B2 lists,
and ``target_t1_size`` set by hand to steer which list is evicted from. Those tests are
not shipped in the wheel; their scenarios are restated here (the facts, not the code)
and each one runs on vLLM 0.33.0's manager and on Spillway's side by side: both must
meet vLLM's expectations, and give the same observations step for step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from tests.contract.test_host_manager import SpillwayHostManager, both, events, ids, key, layout

POLICIES = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


def keys(*ns: int) -> list[bytes]:
    return [key(n) for n in ns]


def differential(num_chunks: int, policy: str, scenario: Callable[[Any, Any], list]) -> None:
    """Run ``scenario(manager, its policy)`` on vLLM's manager and on Spillway's."""
    traces = []
    for manager in both(num_chunks, cache_policy=policy):
        traces.append(scenario(manager, manager._policy))
        assert type(manager._policy) is POLICIES[policy], type(manager).__name__
    assert traces[0] == traces[1]


def lookups(manager: Any, *ns: int) -> list[str]:
    return [manager.lookup(key(n), ReqContext("probe")).name for n in ns]


def stored(manager: Any, ns: list[int], req: ReqContext) -> tuple[list, list, list]:
    out = manager.prepare_store(keys(*ns), req)
    assert out is not None
    manager.complete_store(keys(*ns), req)
    return out.keys_to_store, out.evicted_keys, ids(out.store_spec)


# ------------------------------------------------------------- the policy is vLLM's own


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_policy_is_vllms_own_object(policy):
    """Not a wrapper: same class, and attributes written on it are the policy's own."""
    manager = SpillwayHostManager(layout(6, (1, 2)), cache_policy=policy)
    assert type(manager._policy) is POLICIES[policy]
    manager._policy.spillway_probe = 7
    assert vars(manager._policy)["spillway_probe"] == 7


@pytest.mark.parametrize(("target", "victim"), [(0.0, 1), (4.0, 4)])
def test_target_t1_size_written_on_the_policy_steers_arc_eviction(target, victim):
    """T1 = [1, 2], T2 = [4, 3] (touch walks its keys tail first). With target_t1_size
    at 0 ARC evicts T1's LRU (1); set to the capacity, |T1| < target and it evicts T2's
    LRU (4). The write must reach the policy the manager evicts with."""

    def scenario(manager: Any, arc: Any) -> list:
        req = ReqContext("r")
        stored(manager, [1, 2, 3, 4], req)
        manager.touch(keys(3, 4), req)
        assert (list(arc.t1), list(arc.t2)) == (keys(1, 2), keys(4, 3))
        arc.target_t1_size = target
        out = manager.prepare_store(keys(5), req)
        assert out.evicted_keys == keys(victim), type(manager).__name__
        return [out.evicted_keys, list(arc.b1), list(arc.b2)]

    differential(4, "arc", scenario)


# ------------------------------------------------ vLLM's manager tests, on both managers


def test_lru_manager_scenario():
    """vLLM's ``test_cpu_manager``: stores, a full pool, loads pinning, touch order, a
    failed store; slot ids, evictions, lookups and events."""

    def scenario(manager: Any, lru: Any) -> list:
        req = ReqContext("r")
        trace = []
        out = manager.prepare_store(keys(1, 2), req)
        assert (out.keys_to_store, ids(out.store_spec)) == (keys(1, 2), [0, 1])
        assert lookups(manager, 1, 2) == ["HIT_PENDING"] * 2
        assert events(manager) == []
        manager.complete_store(keys(1, 2), req)
        trace.append(events(manager))
        assert lookups(manager, 1, 2, 3) == ["HIT", "HIT", "MISS"]
        # an already-stored key of the offer is kept; the oldest other key makes room
        out = manager.prepare_store(keys(2, 3, 4, 5), req)
        assert out.keys_to_store == keys(3, 4, 5) and out.evicted_keys == keys(1)
        assert ids(out.store_spec) == [2, 3, 0]
        trace.append(events(manager))
        assert manager.prepare_store(keys(1, 6), req) is None  # nothing evictable
        manager.complete_store(keys(2, 3, 4, 5), req)
        assert lookups(manager, 1, 2, 3, 4, 5, 0) == ["MISS"] + ["HIT"] * 4 + ["MISS"]
        assert ids(manager.prepare_load(keys(2, 3), req)) == [1, 2]
        assert manager.prepare_store(keys(6, 7, 8), req) is None  # 2, 3 pinned
        manager.complete_load(keys(2, 3), req)
        trace.append(stored(manager, [6, 7, 8], req))
        manager.touch(keys(3, 6, 7), req)
        out = manager.prepare_store(keys(9), req)
        trace.append((out.evicted_keys, ids(out.store_spec)))
        manager.complete_store(keys(7, 9), req, success=False)
        assert lookups(manager, 7, 9) == ["HIT", "MISS"]
        trace.append(events(manager))
        return trace

    differential(4, "lru", scenario)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_already_stored_key_not_evicted_during_prepare_store(policy):
    def scenario(manager: Any, _: Any) -> list:
        req = ReqContext("r")
        stored(manager, [1, 2], req)
        manager.touch(keys(1), req)
        out = manager.prepare_store(keys(2, 3, 4, 5), req)
        assert out.keys_to_store == keys(3, 4, 5) and out.evicted_keys == keys(1)
        assert ids(out.store_spec) == [2, 3, 0]
        manager.complete_store(keys(2, 3, 4, 5), req)
        assert lookups(manager, 2) == ["HIT"]
        return [events(manager)]

    differential(4, policy, scenario)


def test_arc_basic_and_t1_to_t2_promotion():
    def scenario(manager: Any, arc: Any) -> list:
        req = ReqContext("r")
        out = manager.prepare_store(keys(1, 2), req)
        assert ids(out.store_spec) == [0, 1]
        assert lookups(manager, 1, 2) == ["HIT_PENDING"] * 2
        manager.touch(keys(1), req)  # a pending key is not promoted
        assert (len(arc.t1), len(arc.t2)) == (2, 0)
        manager.complete_store(keys(1, 2), req)
        assert lookups(manager, 1, 2, 3) == ["HIT", "HIT", "MISS"]
        assert (len(arc.t1), len(arc.t2)) == (2, 0)
        manager.touch(keys(1), req)  # a second access of a ready key: T1 -> T2
        assert key(1) in arc.t2 and key(1) not in arc.t1
        return [list(arc.t1), list(arc.t2), events(manager)]

    differential(4, "arc", scenario)


def test_arc_eviction_with_load():
    """Keys being loaded cannot be evicted; once loaded they can."""

    def scenario(manager: Any, arc: Any) -> list:
        req = ReqContext("r")
        assert stored(manager, [1, 2, 3, 4], req)[2] == [0, 1, 2, 3]
        assert ids(manager.prepare_load(keys(2, 3), req)) == [1, 2]
        assert manager.prepare_store(keys(5, 6, 7), req) is None
        manager.complete_load(keys(2, 3), req)
        out = manager.prepare_store(keys(5, 6, 7), req)
        assert out is not None and len(out.evicted_keys) == 3
        return [out.evicted_keys, ids(out.store_spec), list(arc.b1), list(arc.b2)]

    differential(4, "arc", scenario)


def test_arc_adaptive_target_and_ghost_lists():
    """An evicted key goes to B1; a store miss on it raises target_t1_size; the ghost
    lists stay within the capacity."""

    def scenario(manager: Any, arc: Any) -> list:
        req = ReqContext("r")
        stored(manager, [1, 2], req)
        initial = arc.target_t1_size
        stored(manager, [3], req)
        assert key(1) in arc.b1
        manager.prepare_store(keys(1), ReqContext("s"))  # B1 hit: favour recency
        assert arc.target_t1_size > initial
        trace = [arc.target_t1_size]
        for n in range(4, 20):
            stored(manager, [n], ReqContext(f"q{n}"))
            assert len(arc.b1) <= arc.cache_capacity and len(arc.b2) <= arc.cache_capacity
        return [*trace, list(arc.b1), list(arc.b2), arc.target_t1_size]

    differential(2, "arc", scenario)


def test_arc_touch_ordering():
    """Touch moves keys within T2 and promotes T1 keys; eviction follows that order."""

    def scenario(manager: Any, arc: Any) -> list:
        req = ReqContext("r")
        stored(manager, [1, 2, 3, 4], req)
        manager.touch(keys(3, 4), req)
        manager.touch(keys(1, 3, 4), req)
        assert key(1) in arc.t2 and list(arc.t1) == keys(2)
        out = manager.prepare_store(keys(5), req)
        return [list(arc.t1), list(arc.t2), out.evicted_keys, ids(out.store_spec)]

    differential(4, "arc", scenario)


def test_both_managers_are_cpu_offloading_managers():
    for manager in both(2):
        assert isinstance(manager, CPUOffloadingManager)
