"""The Spillway disk tier under vLLM 0.33.0's own tiering, on the CPU.

Built the way vLLM builds it: an ``OffloadingConfig`` whose extra config names
``TieringOffloadingSpec`` and a ``secondary_tiers`` entry with our ``module_path``,
``OffloadingSpecFactory.create_spec`` -> ``TieringOffloadingSpec.get_manager()``
(which makes the scheduler-side shared region, vLLM's
``CPUPrimaryTierOffloadingManager`` and, through ``SecondaryTierFactory``, our tier)
-> ``TieringOffloadingManager``. Nothing of vLLM is mocked. The only stand-in is the
GPU worker's copy into the primary rows, which the test does with numpy between
``prepare_store`` and ``complete_store``.
"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from spillway_engine.offloader.disk_tier import SpillwayDiskTier

BLOCK_BYTES = 64 * 1024  # one worker, one block per chunk: a 64 KiB primary row
PRIMARY_CHUNKS = 4
DISK_CHUNKS = 8
MODULE = "spillway_engine.offloader.disk_tier"
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def key(i: int):
    return make_offload_key(i.to_bytes(16, "big"), 0)


def build(root: str, plan_key: str = "plan-a") -> TieringOffloadingManager:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": PRIMARY_CHUNKS * BLOCK_BYTES,
        "tier_poll_interval_s": 0,
        "secondary_tiers": [
            {
                "type": "SpillwayDiskTier",
                "module_path": MODULE,
                "root_dir": root,
                "budget_bytes": DISK_CHUNKS * BLOCK_BYTES,
                "plan_key": plan_key,
                "n_read_threads": 1,
                "n_write_threads": 1,
                # vLLM's detector, with water marks this tiny test cannot trip: an
                # fsynced 64 KiB chunk on a CI disk is slower per MiB than the
                # NVMe defaults, and a dropped cascade would make the test flaky.
                "backpressure": {
                    "backpressure_cls": "EMABackpressureDetector",
                    "high_water_s": 1e6,
                    "low_water_s": 1e5,
                    "failure_threshold": 3,
                },
            }
        ],
    }
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"spillway-disk-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="spillway/test", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, TieringOffloadingSpec)
    assert spec.num_chunks == PRIMARY_CHUNKS
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    return manager


def disk_tier(manager: TieringOffloadingManager) -> SpillwayDiskTier:
    [tier] = manager.secondary_tiers
    assert isinstance(tier, SpillwayDiskTier)
    return tier


def wait_until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def on_disk(tier: SpillwayDiskTier) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(tier.chunks.directory):
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            total += max(st.st_size, st.st_blocks * 512)
    return total


def offload(manager: TieringOffloadingManager, n: int, rng) -> dict:
    """Store ``n`` chunks GPU->primary, as the scheduler and worker do; vLLM then
    cascades each to the disk tier, and the primary's LRU spills the older ones."""
    tier = disk_tier(manager)
    rows = manager.primary_tier.get_kv_memoryview()
    width = rows.strides[0]
    flat = rows.cast("B")
    want: dict = {}
    req = ReqContext(req_id="writer")
    try:
        with manager.lock:
            manager.on_new_request(req)
        for i in range(n):
            with manager.lock:
                out = manager.prepare_store([key(i)], req)
            assert out is not None and out.keys_to_store == [key(i)]
            [row] = out.store_spec.chunk_ids
            data = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
            flat[int(row) * width : (int(row) + 1) * width] = data  # the worker's copy
            want[key(i)] = data
            with manager.lock:
                manager.complete_store(out.keys_to_store, req, True)
                manager.on_schedule_end(STEP)
            wait_until(
                lambda i=i: tier.chunks.contains(key(i), refresh=False),
                f"the cascade of chunk {i} (a store dropped by back-pressure never lands)",
            )
            assert on_disk(tier) <= DISK_CHUNKS * BLOCK_BYTES
        with manager.lock:
            manager.on_request_finished(req)
            manager.on_schedule_end(STEP)
    finally:
        flat.release()
    return want


def load_back(manager: TieringOffloadingManager, k, req: ReqContext) -> bytes | None:
    """Look a chunk up until vLLM has promoted it into the primary; return its row."""
    with manager.lock:
        first = manager.lookup(k, req)
    if first is LookupResult.MISS:
        return None
    result = first
    deadline = time.monotonic() + 10
    while result is not LookupResult.HIT:
        assert result in (LookupResult.HIT_PENDING, LookupResult.RETRY), result
        assert time.monotonic() < deadline, "promotion never finished"
        time.sleep(0.005)
        with manager.lock:
            manager.on_schedule_end(STEP)  # flushes the batched submit_load
            result = manager.lookup(k, req)
    with manager.lock:
        spec = manager.prepare_load([k], req)
    rows = manager.primary_tier.get_kv_memoryview()
    width = rows.strides[0]
    [row] = spec.chunk_ids
    with rows.cast("B") as flat:
        data = bytes(flat[int(row) * width : (int(row) + 1) * width])
    with manager.lock:
        manager.complete_load([k], req)
    return data


@pytest.fixture
def managers():
    made: list[TieringOffloadingManager] = []
    yield made
    for m in made:
        m.shutdown()


def test_chunks_spill_from_the_primary_to_disk_and_promote_back_byte_exact(tmp_path, managers):
    manager = build(str(tmp_path))
    managers.append(manager)
    tier = disk_tier(manager)
    want = offload(manager, 12, np.random.default_rng(1))
    snap = tier.snapshot()
    # 12 chunks through a 4-chunk primary and an 8-chunk disk budget.
    assert snap["stores"] == 12 and snap["chunks_held"] == DISK_CHUNKS
    assert snap["evictions"] == 12 - DISK_CHUNKS
    assert on_disk(tier) <= DISK_CHUNKS * BLOCK_BYTES

    req = ReqContext(req_id="reader")
    with manager.lock:
        manager.on_new_request(req)
    # 0..3 were evicted from both tiers (the disk tier's LRU); 4..7 live only on
    # disk (the primary holds 8..11); each is promoted by vLLM and read back exact.
    for i in range(4):
        assert load_back(manager, key(i), req) is None
    for i in range(4, 8):
        assert load_back(manager, key(i), req) == want[key(i)], i
    assert disk_tier(manager).snapshot()["loads"] == 4
    with manager.lock:
        manager.on_request_finished(req)
        manager.on_schedule_end(STEP)
        stats = manager.get_stats()
    # The tier's series ride vLLM's own stats pull and metric registration.
    data = stats.data["data"]
    assert data["spillway_disk_tier_stores"][()] == 12
    assert data["spillway_disk_tier_loads"][()] == 4
    assert data["spillway_disk_tier_chunks"][()] == DISK_CHUNKS
    extra = {"secondary_tiers": [{"type": "SpillwayDiskTier", "module_path": MODULE}]}
    defs = TieringOffloadingSpec.build_metric_definitions(extra)
    assert "spillway_disk_tier_used_bytes" in defs


def test_a_restarted_engine_finds_the_chunks_a_different_plan_does_not(tmp_path, managers):
    first = build(str(tmp_path))
    managers.append(first)
    want = offload(first, 6, np.random.default_rng(2))
    with first.lock:
        first.on_schedule_end(STEP)
    disk_tier(first).drain_jobs()

    again = build(str(tmp_path))  # a new engine (new shared region) on the same disk
    managers.append(again)
    assert disk_tier(again).snapshot()["chunks_held"] == 6
    req = ReqContext(req_id="after-restart")
    with again.lock:
        again.on_new_request(req)
    for i in range(6):
        assert load_back(again, key(i), req) == want[key(i)], i

    other = build(str(tmp_path), plan_key="plan-b")
    managers.append(other)
    req_b = ReqContext(req_id="other-plan")
    with other.lock:
        other.on_new_request(req_b)
    assert load_back(other, key(0), req_b) is None


def test_spillways_unit_pool_as_the_primary_tier_a_prototype(tmp_path):
    """Spillway's host manager (per-group units, one LRU) under vLLM's own
    TieringOffloadingManager, with the read/write aliases vLLM's
    CPUPrimaryTierOffloadingManager adds (defined here, as the adapter would be),
    and the disk tier told the units per group. Chunks of two groups of different
    sizes spill from the unit pool and promote back byte-exact."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from spillway_engine.offloader.host_layout import GroupSlots, HostLayout
    from spillway_engine.offloader.manager import make_manager_class

    unit = 4096
    layout = HostLayout(
        chunk_tokens=16,
        unit_bytes=unit,
        copies=1,
        num_units=6,
        groups=(
            GroupSlots(0, 0, 16, 1, chunk_bytes=2 * unit, units=2),
            GroupSlots(1, 1, 16, 1, chunk_bytes=unit, units=1),
        ),
    )

    class UnitPoolPrimary(make_manager_class()):
        def __init__(self, layout: HostLayout):
            super().__init__(layout, cache_policy="lru", enable_events=False)
            self.rows = np.zeros((layout.num_units, layout.unit_bytes), dtype=np.uint8)
            self.complete_read = self.complete_load
            self.prepare_write = self.prepare_store
            self.complete_write = self.complete_store

        def prepare_read(self, keys, req_context):
            return self._prepare_load(keys, req_context, record_access=False)

        def get_kv_memoryview(self) -> memoryview:
            return memoryview(self.rows)

    primary = UnitPoolPrimary(layout)
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "SpillwayDiskTier",
            "module_path": MODULE,
            "root_dir": str(tmp_path),
            "budget_bytes": 64 * unit,
            "plan_key": "units",
            "group_units": {"0": 2, "1": 1},  # JSON keys arrive as strings
            "n_read_threads": 1,
            "n_write_threads": 1,
        },
        primary.get_kv_memoryview(),
        None,
    )
    manager = TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0)
    try:
        rng = np.random.default_rng(5)
        want: dict = {}
        req = ReqContext(req_id="writer")
        with manager.lock:
            manager.on_new_request(req)
        pairs = [
            (make_offload_key(bytes([i]) * 16, 0), make_offload_key(bytes([i]) * 16, 1))
            for i in range(5)
        ]
        for pair in pairs:  # 3 units a pair, 6 units in the pool
            with manager.lock:
                out = manager.prepare_store(list(pair), req)
            assert out is not None and out.keys_to_store == list(pair)
            ids = [int(c) for c in out.store_spec.chunk_ids]
            assert len(ids) == 3  # unit ids, key after key: not one row per key
            for k, units in zip(pair, (ids[:2], ids[2:]), strict=True):
                data = rng.integers(0, 256, (len(units), unit), dtype=np.uint8)
                primary.rows[units] = data
                want[k] = data.tobytes()
            with manager.lock:
                manager.complete_store(out.keys_to_store, req, True)
                manager.on_schedule_end(STEP)
            wait_until(lambda p=pair: all(tier.chunks.contains(k, False) for k in p), "cascade")
        with manager.lock:
            manager.on_request_finished(req)
            manager.on_schedule_end(STEP)
        assert tier.snapshot()["stores"] == 10

        reader = ReqContext(req_id="reader")
        with manager.lock:
            manager.on_new_request(reader)
        for k in pairs[0]:  # long evicted from the 6-unit pool
            with manager.lock:
                assert manager.primary_tier.lookup(k, reader) is LookupResult.MISS
                result = manager.lookup(k, reader)
            deadline = time.monotonic() + 10
            while result is not LookupResult.HIT:
                assert result is LookupResult.HIT_PENDING, result
                assert time.monotonic() < deadline
                time.sleep(0.005)
                with manager.lock:
                    manager.on_schedule_end(STEP)
                    result = manager.lookup(k, reader)
            with manager.lock:
                spec = manager.prepare_load([k], reader)
            units = [int(c) for c in spec.chunk_ids]
            assert len(units) == (2 if k == pairs[0][0] else 1)
            assert primary.rows[units].tobytes() == want[k]
            with manager.lock:
                manager.complete_load([k], reader)
        with manager.lock:
            manager.on_request_finished(reader)
            manager.on_schedule_end(STEP)
    finally:
        manager.shutdown()
