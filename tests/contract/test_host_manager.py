"""Spillway's host-pool manager against vLLM 0.33.0's ``CPUOffloadingManager``.

For a single-group pool the two must be indistinguishable: the same operations give the
same lookups, the same keys stored, the same evictions, the same slot ids and the same
events. A random-sequence differential test (hypothesis) drives both side by side. For
multi-group pools, where a key takes its group's units, a second property test checks
the invariants the scheduler relies on: a refused store changes nothing, units in use
never exceed the pool, pinned keys are never evicted, events replay to the cached keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from spillway_engine.offloader.host_layout import GroupSlots, HostLayout
from spillway_engine.offloader.manager import make_manager_class

SpillwayHostManager = make_manager_class()
UNIT_BYTES = 4096


def key(n: int, group: int = 0) -> bytes:
    return make_offload_key(n.to_bytes(8, "big"), group)


def layout(num_units: int, units_per_group: tuple[int, ...] = (1,)) -> HostLayout:
    groups = tuple(
        GroupSlots(
            group_id=g,
            position=g,
            tokens_per_block=16,
            blocks_per_chunk=1,
            chunk_bytes=units * UNIT_BYTES,
            units=units,
        )
        for g, units in enumerate(units_per_group)
    )
    return HostLayout(
        chunk_tokens=16, unit_bytes=UNIT_BYTES, copies=1, num_units=num_units, groups=groups
    )


def both(num_chunks: int, **kwargs: Any) -> tuple[Any, Any]:
    """vLLM's manager and Spillway's, for the same single-group pool."""
    kwargs.setdefault("enable_events", True)
    return (
        CPUOffloadingManager(num_chunks=num_chunks, **kwargs),
        SpillwayHostManager(layout(num_chunks), **kwargs),
    )


def ids(spec: Any) -> list[int]:
    return [int(i) for i in spec.block_ids]


def events(manager: Any) -> list[tuple]:
    return [
        (tuple(e.keys), e.removed, e.metadata_only, e.medium.value) for e in manager.take_events()
    ]


def store(manager: Any, keys: list[bytes], req: ReqContext) -> Any:
    out = manager.prepare_store(keys, req)
    if out is not None:
        manager.complete_store(out.keys_to_store, req)
    return out


# ------------------------------------------------------------ the four reproductions


def test_refused_store_evicts_nothing():
    """Keys 2, 3 pinned by a load; a 3-key store cannot fit: nothing may be evicted."""
    for manager in both(4):
        req = ReqContext("r")
        store(manager, [key(i) for i in (1, 2, 3, 4)], req)
        events(manager)
        manager.prepare_load([key(2), key(3)], req)
        assert manager.prepare_store([key(5), key(6), key(7)], req) is None
        assert events(manager) == []
        for i in (1, 2, 3, 4):
            assert manager.lookup(key(i), req).name == "HIT", (type(manager).__name__, i)


def test_threshold_evicts_nothing_for_keys_it_does_not_store():
    """store_threshold=2: never-seen keys are not stored, so nothing is evicted for them."""
    for manager in both(2, store_threshold=2):
        req = ReqContext("r")
        assert manager.prepare_store([key(1), key(2)], req).keys_to_store == []
        assert store(manager, [key(1), key(2)], req).keys_to_store == [key(1), key(2)]
        events(manager)
        out = manager.prepare_store([key(3), key(4)], req)
        assert out.keys_to_store == [] and out.evicted_keys == []
        assert events(manager) == []
        assert [manager.lookup(key(i), req).name for i in (1, 2)] == ["HIT", "HIT"]


def test_prepare_store_reports_the_keys_it_evicted():
    vllm, spillway = both(2)
    for manager in (vllm, spillway):
        req = ReqContext("r")
        store(manager, [key(1), key(2)], req)
        out = manager.prepare_store([key(3)], req)
        assert out.evicted_keys == [key(1)], type(manager).__name__


def test_slot_ids_follow_vllm_fresh_first_then_freed():
    """A failed store frees its slot; the next store takes a never-used slot first."""
    got = []
    for manager in both(4):
        req = ReqContext("r")
        order = [ids(store(manager, [key(1), key(2)], req).store_spec)]
        out = manager.prepare_store([key(3)], req)
        order.append(ids(out.store_spec))
        manager.complete_store([key(3)], req, success=False)
        order.append(ids(store(manager, [key(4)], req).store_spec))
        got.append(order)
    assert got[0] == got[1] == [[0, 1], [2], [3]]


# ---------------------------------------------------- cases vLLM's own tests care about


def test_store_keeps_the_offer_and_evicts_lru_order():
    """Already-stored keys of the offer are protected; eviction follows recency."""
    for manager in both(3):
        req = ReqContext("r")
        store(manager, [key(1), key(2), key(3)], req)
        manager.touch([key(1)], req)
        out = manager.prepare_store([key(2), key(4)], req)
        assert out.keys_to_store == [key(4)]
        assert out.evicted_keys == [key(3)], type(manager).__name__


def test_store_refused_when_only_the_offer_is_evictable():
    for manager in both(2):
        req = ReqContext("r")
        store(manager, [key(1), key(2)], req)
        assert manager.prepare_store([key(1), key(2), key(3)], req) is None
        assert [manager.lookup(key(i), req).name for i in (1, 2)] == ["HIT", "HIT"]


def test_pending_store_is_hit_pending_and_not_evictable():
    for manager in both(2):
        req = ReqContext("r")
        out = manager.prepare_store([key(1), key(2)], req)
        assert manager.lookup(key(1), req).name == "HIT_PENDING"
        assert manager.prepare_store([key(3)], req) is None
        manager.complete_store(out.keys_to_store, req)
        assert manager.lookup(key(1), req).name == "HIT"


def test_failed_store_frees_its_slots_with_a_metadata_only_event():
    vllm, spillway = both(2)
    seen = []
    for manager in (vllm, spillway):
        req = ReqContext("r")
        out = manager.prepare_store([key(1), key(2)], req)
        manager.complete_store(out.keys_to_store, req, success=False)
        assert manager.lookup(key(1), req).name == "MISS"
        seen.append(events(manager))
        assert ids(store(manager, [key(3), key(4)], req).store_spec) == [1, 0]
    assert seen[0] == seen[1] and seen[0][0][2] is True  # metadata_only


def test_load_pins_until_complete_load():
    for manager in both(2):
        req = ReqContext("r")
        store(manager, [key(1), key(2)], req)
        manager.prepare_load([key(1), key(2)], req)
        assert manager.prepare_store([key(3)], req) is None
        manager.complete_load([key(1)], req)
        assert manager.prepare_store([key(3)], req).evicted_keys == [key(1)]


def test_reset_cache_forgets_everything_and_restarts_slot_ids():
    for manager in both(3):
        req = ReqContext("r")
        store(manager, [key(1), key(2)], req)
        manager.reset_cache()
        assert manager.lookup(key(1), ReqContext("s")).name == "MISS"
        assert ids(store(manager, [key(5)], ReqContext("s")).store_spec) == [0]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_usage_gauge_equals_vllm(policy):
    vllm, spillway = both(4, cache_policy=policy)
    for manager in (vllm, spillway):
        req = ReqContext("r")
        store(manager, [key(1), key(2)], req)
        manager.prepare_store([key(3)], req)
        manager.prepare_load([key(1)], req)
    gauges = [m.get_stats().data for m in (vllm, spillway)]
    for name in (
        CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC,
        CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC,
    ):
        values = [_gauge(data, name) for data in gauges]
        assert values[0] == pytest.approx(values[1]), name


def _gauge(data: dict, name: str) -> float:
    for section in data.values():
        if isinstance(section, dict) and name in section:
            value = section[name]
            return next(iter(value.values())) if isinstance(value, dict) else value
    raise KeyError(name)


# ------------------------------------------------------------ random operation sequences

#: one operation: (kind, a list of small integers to pick keys/requests/jobs with, a flag)
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "lookup",
                "store",
                "store",
                "complete",
                "load",
                "complete_load",
                "touch",
                "events",
                "finish",
                "reset",
            ]
        ),
        st.lists(st.integers(0, 11), min_size=1, max_size=5),
        st.booleans(),
    ),
    max_size=60,
)


@dataclass
class Driver:
    """Turns abstract operations into valid calls, from the state of the reference."""

    managers: list[Any]
    keys: list[bytes]
    #: in-flight jobs: (keys, request index)
    stores: list[tuple[list[bytes], int]] = field(default_factory=list)
    loads: list[tuple[list[bytes], int]] = field(default_factory=list)
    #: each request has one ReqContext per manager (contexts hold per-manager state)
    requests: list[list[ReqContext]] = field(default_factory=list)
    started: int = 0

    def req(self, n: int) -> list[ReqContext]:
        n %= 4
        while len(self.requests) <= n:
            self.requests.append(self._contexts())
        return self.requests[n]

    def _contexts(self) -> list[ReqContext]:
        contexts = [ReqContext(f"req-{self.started}") for _ in self.managers]
        self.started += 1
        for ctx in contexts:  # prefix positions, as vLLM's scheduler records them
            for i, k in enumerate(self.keys):
                ctx.set_offload_key_position(k, 16 * (i + 1))
        return contexts

    def ready(self, keys: list[bytes]) -> list[bytes]:
        ref = self.managers[0]
        return [k for k in dict.fromkeys(keys) if ref.lookup(k, ReqContext("probe")).name == "HIT"]

    def step(self, op: str, picks: list[int], flag: bool) -> list[Any]:
        """Apply one operation to every manager; return each one's observable result."""
        chosen = [self.keys[p % len(self.keys)] for p in picks]
        ctxs = self.req(picks[0])
        if op == "lookup":
            return [m.lookup(chosen[0], c).name for m, c in zip(self.managers, ctxs, strict=True)]
        if op == "store":
            offer = list(dict.fromkeys(chosen))
            outs = [m.prepare_store(offer, c) for m, c in zip(self.managers, ctxs, strict=True)]
            if outs[0] is not None and outs[0].keys_to_store:
                self.stores.append((outs[0].keys_to_store, picks[0]))
            return [
                None if o is None else (o.keys_to_store, o.evicted_keys, ids(o.store_spec))
                for o in outs
            ]
        if op == "complete" and self.stores:
            keys, r = self.stores.pop(picks[-1] % len(self.stores))
            for m, c in zip(self.managers, self.req(r), strict=True):
                m.complete_store(keys, c, success=flag)
            return [None for _ in self.managers]
        if op == "load":
            keys = self.ready(chosen)
            if not keys:
                return [None for _ in self.managers]
            self.loads.append((keys, picks[0]))
            return [ids(m.prepare_load(keys, c)) for m, c in zip(self.managers, ctxs, strict=True)]
        if op == "complete_load" and self.loads:
            keys, r = self.loads.pop(picks[-1] % len(self.loads))
            for m, c in zip(self.managers, self.req(r), strict=True):
                m.complete_load(keys, c)
            return [None for _ in self.managers]
        if op == "touch":
            for m, c in zip(self.managers, ctxs, strict=True):
                m.touch(chosen, c)
            return [None for _ in self.managers]
        if op == "events":
            return [events(m) for m in self.managers]
        if op == "finish":
            for m, c in zip(self.managers, ctxs, strict=True):
                m.on_request_finished(c)
            self.requests[picks[0] % 4] = self._contexts()
            return [None for _ in self.managers]
        if op == "reset" and flag and not self.stores and not self.loads:
            for m in self.managers:
                m.reset_cache()
            return [None for _ in self.managers]
        return [None for _ in self.managers]


def used_slots(manager: Any) -> int:
    if isinstance(manager, SpillwayHostManager):
        return manager.used_units
    return manager._num_allocated_chunks - len(manager._free_list)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    num_chunks=st.integers(1, 8),
    threshold=st.integers(1, 3),
    tracker=st.integers(2, 64),
    policy=st.sampled_from(["lru", "arc"]),
)
def test_single_group_pool_is_indistinguishable_from_vllm(
    ops, num_chunks, threshold, tracker, policy
):
    managers = list(
        both(num_chunks, store_threshold=threshold, max_tracker_size=tracker, cache_policy=policy)
    )
    driver = Driver(managers, [key(i) for i in range(12)])
    for step, (op, picks, flag) in enumerate(ops):
        vllm, spillway = driver.step(op, picks, flag)
        assert vllm == spillway, f"step {step}: {op} {picks} {flag}"
        assert used_slots(managers[0]) == used_slots(managers[1]), f"step {step}"
        # one unit a key: the evictable units are vLLM's count of evictable chunks
        assert managers[1].evictable_units == managers[0]._num_evictable_cache_chunks, step
    assert events(managers[0]) == events(managers[1])


# --------------------------------------------------- multi-group pools: the invariants


def cached(manager: Any) -> dict[bytes, bool]:
    """Every key the pool holds -> whether it is ready (probed without side effects)."""
    probe = ReqContext("probe")
    out = {}
    for k in manager._probe_keys:
        result = manager.lookup(k, probe).name
        if result != "MISS":
            out[k] = result == "HIT"
    return out


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    num_units=st.integers(3, 24),
    units=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    threshold=st.integers(1, 2),
    policy=st.sampled_from(["lru", "arc"]),
)
def test_multi_group_pool_invariants(ops, num_units, units, threshold, policy):
    units_per_group = tuple(units)
    num_units = max(num_units, max(units_per_group))
    manager = SpillwayHostManager(
        layout(num_units, units_per_group),
        store_threshold=threshold,
        cache_policy=policy,
        enable_events=True,
    )
    universe = [key(i, g) for i in range(4) for g in range(len(units_per_group))]
    manager._probe_keys = universe
    driver = Driver([manager], universe)
    announced: set[bytes] = set()

    def replay() -> None:
        for e in manager.take_events():
            if e.removed:
                announced.difference_update(e.keys)
            else:
                announced.update(e.keys)

    for step, (op, picks, flag) in enumerate(ops):
        before = cached(manager)
        pinned = {k for keys, _ in driver.stores + driver.loads for k in keys}
        offer = {universe[p % len(universe)] for p in picks}
        (result,) = driver.step(op, picks, flag)
        after = cached(manager)
        where = f"step {step}: {op} {picks} {flag}"
        if op == "store" and result is None:
            assert after == before, where
            assert not manager.events, where
        if op == "store" and result is not None:
            to_store, evicted, slots = result
            assert not set(evicted) & (pinned | offer), where
            assert len(slots) == sum(manager.units_of(k) for k in to_store), where
            assert len(set(slots)) == len(slots), where
        assert manager.used_units == sum(manager.units_of(k) for k in after), where
        assert 0 <= manager.used_units <= num_units, where
        if op == "reset" and not after:
            announced.clear()  # vLLM announces a reset as "all blocks cleared", not per key
        replay()
        assert announced == {k for k, ready in after.items() if ready}, where
        assert manager.evictable_units == sum(
            manager.units_of(k)
            for k in after
            if after[k] and k not in {p for keys, _ in driver.loads for p in keys}
        ), where
