"""The bounded disk tier (issue 31): budget, LRU, crash safety, plan namespaces, failures.

The tier is driven the way vLLM's TieringOffloadingManager drives a secondary tier:
TransferJobs whose chunk ids index rows of the primary memoryview, completion polled
through get_finished_jobs().
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector
from vllm.v1.kv_offload.tiering.base import TransferJob

from spillway_engine.offloader import disk_tier
from spillway_engine.offloader.disk_tier import (
    CHUNK_SUFFIX,
    ChunkDir,
    SpillwayDiskTier,
    plan_namespace,
)

CHUNK = 8192  # bytes per primary row (a multiple of the 4 KiB allocation unit)
ROWS = 16
REQ = ReqContext(req_id="r0")


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(16, "big"), group)


def disk_usage(directory) -> tuple[int, int, int]:
    """(files, sum of st_size, sum of allocated bytes), measured with os.stat."""
    n = size = alloc = 0
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            n += 1
            size += st.st_size
            alloc += st.st_blocks * 512
    return n, size, alloc


class Harness:
    """A primary memoryview plus a tier, driven like vLLM's tiering manager."""

    def __init__(self, root, budget_chunks=4, plan_key="plan-a", **kw):
        self.primary = np.zeros((ROWS, CHUNK), dtype=np.uint8)
        self.tier = SpillwayDiskTier(
            None,
            memoryview(self.primary),
            "SpillwayDiskTier",
            root_dir=str(root),
            budget_bytes=budget_chunks * CHUNK,
            plan_key=plan_key,
            n_read_threads=1,
            n_write_threads=1,
            **kw,
        )
        self.job = 0

    def fill(self, row: int, seed: int) -> bytes:
        data = np.random.default_rng(seed).integers(0, 256, CHUNK, dtype=np.uint8)
        self.primary[row] = data
        return data.tobytes()

    def _run(self, keys, rows, promotion):
        self.job += 1
        job = TransferJob(
            job_id=self.job,
            keys=list(keys),
            chunk_ids=np.array(rows, dtype=np.int32),
            is_promotion=promotion,
            req_context=REQ,
        )
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for res in self.tier.get_finished_jobs():
                assert res.job_id == job.job_id
                return res
            time.sleep(0.002)
        raise AssertionError("job never finished")

    def store(self, keys, rows):
        return self._run(keys, rows, False)

    def load(self, keys, rows):
        return self._run(keys, rows, True)

    def close(self):
        self.tier.shutdown()


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(**kw):
        h = Harness(tmp_path / "kv", **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_stored_chunk_loads_back_byte_exact(harness):
    h = harness()
    want = h.fill(3, seed=1)
    assert h.store([key(1)], [3]).success
    assert h.tier.lookup(key(1), REQ) is LookupResult.HIT
    h.primary[7] = 0
    res = h.load([key(1)], [7])
    assert res.success
    assert h.primary[7].tobytes() == want
    snap = h.tier.snapshot()
    assert (snap["stores"], snap["loads"], snap["hits"], snap["chunks_held"]) == (1, 1, 1, 1)
    assert h.tier.lookup(key(2), REQ) is LookupResult.MISS
    assert h.tier.snapshot()["misses"] == 1


def test_lru_evicts_least_recently_used_first(harness):
    h = harness(budget_chunks=3)
    for i in range(3):
        h.fill(i, seed=i)
        assert h.store([key(i)], [i]).success
    # Refresh 0 by a lookup hit and 1 by a load: 2 is now the oldest.
    assert h.tier.lookup(key(0), REQ) is LookupResult.HIT
    assert h.load([key(1)], [8]).success
    h.fill(3, seed=3)
    assert h.store([key(3)], [3]).success
    held = {i for i in range(4) if h.tier.chunks.contains(key(i), refresh=False)}
    assert held == {0, 1, 3}
    assert not os.path.exists(h.tier.chunks.path_of(key(2)))
    # A store of a chunk already held refreshes it too: 0 is now newest, 1 oldest.
    h.tier.touch([key(3)], REQ)
    assert h.store([key(0)], [0]).success
    h.fill(4, seed=4)
    assert h.store([key(4)], [4]).success
    held = {i for i in range(5) if h.tier.chunks.contains(key(i), refresh=False)}
    assert held == {0, 3, 4}
    assert h.tier.snapshot()["evictions"] == 2


def test_budget_never_exceeded_mixed_sizes_soak(tmp_path, monkeypatch):
    budget = 256 * 1024
    d = ChunkDir(str(tmp_path / "soak"), budget, fsync=False)
    peaks = []
    real_replace = os.replace

    def measure_then_replace(src, dst):
        # The complete temp file is on disk here: eviction must already be done.
        peaks.append(disk_usage(d.directory)[1:])
        real_replace(src, dst)

    monkeypatch.setattr(disk_tier.os, "replace", measure_then_replace)
    rng = random.Random(7)
    written = 0
    i = 0
    while written < 5 * budget:
        n = rng.choice([1, 700, 4096, 5000, 12_288, 40_000, 65_536, 100_000])
        data = rng.randbytes(n)
        assert d.put(key(i), data)
        written += n
        files, size, alloc = disk_usage(d.directory)
        assert size <= budget, (i, size)
        assert alloc <= budget, (i, alloc)
        assert d.snapshot()["bytes_used"] <= budget
        assert files == d.snapshot()["chunks_held"]
        if rng.random() < 0.3:  # reread a random recent chunk: a hit refreshes it
            j = rng.randrange(max(0, i - 5), i + 1)
            got = d.get(key(j))
            assert got is None or len(got) > 0
        i += 1
    assert len(peaks) == i
    assert max(size for size, _ in peaks) <= budget
    assert max(alloc for _, alloc in peaks) <= budget
    snap = d.snapshot()
    assert snap["evictions"] > 0
    assert snap["stores"] == i
    # A chunk larger than the whole budget is refused, never written.
    assert not d.put(key(10**6), b"x" * (budget + 1))
    assert disk_usage(d.directory)[1] <= budget


def test_tier_soak_through_jobs_keeps_budget(harness):
    h = harness(budget_chunks=5)
    rng = random.Random(3)
    for i in range(25):  # 5x the budget
        rows = rng.sample(range(ROWS), 2)
        for r in rows:
            h.fill(r, seed=i * 100 + r)
        assert h.store([key(2 * i), key(2 * i + 1)], rows).success
        _files, size, alloc = disk_usage(h.tier.chunks.directory)
        assert size <= 5 * CHUNK and alloc <= 5 * CHUNK
    assert h.tier.snapshot()["chunks_held"] == 5


def test_partial_temp_files_are_removed_at_start_and_never_read(harness, tmp_path):
    h = harness()
    h.fill(0, seed=9)
    assert h.store([key(1)], [0]).success
    d = h.tier.chunks.directory
    h.close()
    # A crash mid-write leaves a temp file; a torn file under a final name is
    # also possible on filesystems without atomic rename semantics.
    sub = os.path.join(d, key(2).hex()[:2])
    os.makedirs(sub, exist_ok=True)
    tmp = os.path.join(sub, f".{key(2).hex()}.123.456.tmp")
    with open(tmp, "wb") as f:
        f.write(b"partial")
    torn = os.path.join(os.path.dirname(h.tier.chunks.path_of(key(3))), key(3).hex() + CHUNK_SUFFIX)
    os.makedirs(os.path.dirname(torn), exist_ok=True)
    with open(torn, "wb") as f:
        f.write(b"y" * (CHUNK // 2))
    h2 = harness()
    assert not os.path.exists(tmp)
    assert not os.path.exists(torn)
    assert h2.tier.lookup(key(2), REQ) is LookupResult.MISS
    assert h2.tier.lookup(key(3), REQ) is LookupResult.MISS
    assert h2.tier.lookup(key(1), REQ) is LookupResult.HIT
    assert h2.tier.snapshot()["temp_files_removed"] == 2


def test_write_goes_through_a_temp_name(harness, monkeypatch):
    h = harness()
    h.fill(0, seed=5)
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((src, dst, os.path.getsize(src)))
        real_replace(src, dst)

    monkeypatch.setattr(disk_tier.os, "replace", spy)
    assert h.store([key(1)], [0]).success
    [(src, dst, size)] = seen
    assert src.endswith(".tmp") and os.path.basename(src).startswith(".")
    assert dst == h.tier.chunks.path_of(key(1)) and size == CHUNK


def test_restart_rebuilds_index_bytes_and_lru_order(harness):
    h = harness(budget_chunks=3)
    wants = {}
    for i in range(3):
        wants[i] = h.fill(i, seed=20 + i)
        assert h.store([key(i)], [i]).success
        time.sleep(0.02)  # distinct mtimes
    assert h.load([key(0)], [9]).success  # 0 becomes newest (mtime refreshed)
    used = h.tier.snapshot()["bytes_used"]
    h.close()
    h2 = harness(budget_chunks=3)
    snap = h2.tier.snapshot()
    assert snap["chunks_held"] == 3 and snap["bytes_used"] == used
    h2.fill(5, seed=99)
    assert h2.store([key(5)], [5]).success
    held = {i for i in (0, 1, 2, 5) if h2.tier.chunks.contains(key(i), refresh=False)}
    assert held == {0, 2, 5}  # 1 was least recently used before the restart
    assert h2.load([key(2)], [10]).success
    assert h2.primary[10].tobytes() == wants[2]


def test_restart_with_smaller_budget_trims(harness):
    h = harness(budget_chunks=4)
    for i in range(4):
        h.fill(i, seed=i)
        assert h.store([key(i)], [i]).success
    h.close()
    h2 = harness(budget_chunks=2)
    assert h2.tier.snapshot()["chunks_held"] == 2
    assert disk_usage(h2.tier.chunks.directory)[1] <= 2 * CHUNK


def test_second_instance_same_plan_finds_chunks_other_plan_does_not(harness):
    a = harness(plan_key="plan-a")
    want = a.fill(0, seed=42)
    assert a.store([key(7)], [0]).success
    same = harness(plan_key="plan-a")
    other = harness(plan_key="plan-b")
    assert same.tier.lookup(key(7), REQ) is LookupResult.HIT
    assert same.load([key(7)], [4]).success
    assert same.primary[4].tobytes() == want
    assert other.tier.lookup(key(7), REQ) is LookupResult.MISS
    assert other.tier.chunks.directory != a.tier.chunks.directory
    assert plan_namespace("plan-a", CHUNK) != plan_namespace("plan-a", 2 * CHUNK)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO])
def test_disk_refusing_writes_counts_failure_and_never_raises(harness, monkeypatch, caplog, code):
    detector = EMABackpressureDetector(
        **EMABackpressureDetector.default_config("fs"),
    )
    h = harness(backpressure_detector=detector, failure_backoff_s=0.0)
    h.fill(0, seed=1)

    def refuse(fd, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_tier.os, "write", refuse)
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        for i in range(4):
            res = h.store([key(i)], [0])
            assert res.success is False
            # vLLM's manager feeds a failed cascade to the tier's detector.
            detector.on_store_failed()
    assert h.tier.snapshot()["write_failures"] == 4
    assert detector.is_under_pressure()
    episode_lines = [r for r in caplog.records if "stores fail" in r.getMessage()]
    assert len(episode_lines) == 1  # once per episode
    # Nothing partial was left or indexed.
    assert disk_usage(h.tier.chunks.directory)[0] == 0
    assert h.tier.lookup(key(0), REQ) is LookupResult.MISS
    # The disk comes back: the next store succeeds and closes the episode.
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        assert h.store([key(9)], [0]).success
    assert any("recovered" in r.getMessage() for r in caplog.records)


def test_failure_backoff_drops_stores_without_touching_disk(harness, monkeypatch):
    h = harness(failure_backoff_s=60.0)
    h.fill(0, seed=1)
    calls = []

    def refuse(fd, data):
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier.os, "write", refuse)
    assert h.store([key(1)], [0]).success is False
    assert h.store([key(2)], [0]).success is False  # dropped during backoff
    assert len(calls) == 1
    snap = h.tier.snapshot()
    assert snap["write_failures"] == 1 and snap["stores_dropped"] == 1


def test_unwritable_directory_at_start_does_not_raise(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(disk_tier.os, "makedirs", refuse)
    primary = np.zeros((2, CHUNK), dtype=np.uint8)
    tier = SpillwayDiskTier(
        None,
        memoryview(primary),
        "SpillwayDiskTier",
        root_dir=str(tmp_path),
        budget_bytes=4 * CHUNK,
        plan_key="p",
        n_read_threads=1,
        n_write_threads=1,
    )
    try:
        assert not tier.chunks.usable
        job = TransferJob(1, [key(1)], np.array([0], dtype=np.int32), False, REQ)
        tier.submit_store(job)
        [res] = list(tier.get_finished_jobs())
        assert res.success is False
        assert tier.lookup(key(1), REQ) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_load_of_a_chunk_deleted_underneath_fails_cleanly(harness):
    h = harness()
    for i in range(2):
        h.fill(i, seed=i)
    assert h.store([key(0), key(1)], [0, 1]).success
    os.remove(h.tier.chunks.path_of(key(1)))  # e.g. another replica evicted it
    res = h.load([key(0), key(1)], [5, 6])
    assert res.success is False
    assert list(res.successful_keys) == [key(0)]
    assert h.tier.lookup(key(1), REQ) is LookupResult.MISS
    assert h.tier.snapshot()["load_failures"] == 1


def test_pinned_chunk_is_not_evicted_while_loading(tmp_path):
    d = ChunkDir(str(tmp_path / "pin"), 2 * 4096, fsync=False)
    assert d.put(key(0), b"a" * 4096) and d.put(key(1), b"b" * 4096)
    assert d.pin(key(0))
    d.touch([key(0)])
    d.touch([key(1)])  # 0 is the LRU one, but pinned
    assert d.put(key(2), b"c" * 4096)
    assert d.contains(key(0), refresh=False) and not d.contains(key(1), refresh=False)
    d.unpin(key(0))
    assert d.get(key(0)) == b"a" * 4096


def test_factory_builds_the_tier_from_module_path(tmp_path):
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    primary = np.zeros((4, CHUNK), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "SpillwayDiskTier",
            "module_path": "spillway_engine.offloader.disk_tier",
            "root_dir": str(tmp_path),
            "budget_bytes": 4 * CHUNK,
            "plan_key": "plan-a",
            "n_read_threads": 1,
            "n_write_threads": 1,
            "backpressure": {
                "backpressure_cls": "EMABackpressureDetector",
                "failure_threshold": 3,
            },
        },
        memoryview(primary),
        None,
    )
    try:
        assert isinstance(tier, SpillwayDiskTier)
        assert tier.tier_type == "SpillwayDiskTier"
        assert isinstance(tier.bp_detector, EMABackpressureDetector)
        assert tier.block_size_bytes == CHUNK
    finally:
        tier.shutdown()


def test_young_temp_files_of_a_live_replica_survive_start_when_asked(tmp_path):
    d = str(tmp_path / "shared")
    os.makedirs(os.path.join(d, "ab"))
    young = os.path.join(d, "ab", ".abcd.1.2.tmp")
    old = os.path.join(d, "ab", ".abce.1.2.tmp")
    for path in (young, old):
        with open(path, "wb") as f:
            f.write(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    c = ChunkDir(d, 1 << 20, stale_temp_s=600)
    assert os.path.exists(young) and not os.path.exists(old)
    assert c.snapshot()["chunks_held"] == 0  # a temp file is never indexed


def test_stats_for_vllm_metrics_are_deltas_and_gauges(harness):
    h = harness(budget_chunks=2)
    defs = SpillwayDiskTier.build_metric_definitions({})
    assert set(defs) == set(disk_tier.DISK_METRICS)
    assert all(name.startswith("spillway_disk_tier_") for name in defs)
    for i in range(3):
        h.fill(i, seed=i)
        assert h.store([key(i)], [i]).success
    h.tier.lookup(key(0), REQ)
    h.tier.lookup(key(2), REQ)

    def values(stats):
        return {name: v[()] for name, v in stats.data["data"].items()}

    first = values(h.tier.get_stats())
    assert first["spillway_disk_tier_stores"] == 3
    assert first["spillway_disk_tier_evictions"] == 1
    assert first["spillway_disk_tier_hits"] == 1 and first["spillway_disk_tier_misses"] == 1
    assert first["spillway_disk_tier_used_bytes"] == 2 * CHUNK
    assert first["spillway_disk_tier_budget_bytes"] == 2 * CHUNK
    assert first["spillway_disk_tier_chunks"] == 2
    h.fill(3, seed=3)
    assert h.store([key(3)], [3]).success
    second = values(h.tier.get_stats())
    assert second["spillway_disk_tier_stores"] == 1  # only what happened since
    assert second["spillway_disk_tier_evictions"] == 1
    assert second["spillway_disk_tier_chunks"] == 2


def test_unit_pool_keys_span_several_rows_and_load_back_exact(harness):
    """Spillway's unit pool gives a key of group g ``units_g`` rows: a job's chunk ids
    are the keys' rows back to back, and each key's file holds all of its rows."""
    h = harness(budget_chunks=8, group_units={0: 2, 1: 1})
    a, b = make_offload_key(b"a" * 16, 0), make_offload_key(b"b" * 16, 1)
    rows = {r: h.fill(r, seed=r) for r in (5, 2, 7)}
    assert h.store([a, b], [5, 2, 7]).success
    assert os.path.getsize(h.tier.chunks.path_of(a)) == 2 * CHUNK
    assert os.path.getsize(h.tier.chunks.path_of(b)) == CHUNK
    h.primary[:] = 0
    res = h.load([b, a], [4, 1, 3])
    assert res.success
    assert h.primary[4].tobytes() == rows[7]
    assert (h.primary[1].tobytes(), h.primary[3].tobytes()) == (rows[5], rows[2])
    # A restart keeps them (sizes checked per group) and another unit split does not
    # share the namespace.
    h.close()
    again = harness(budget_chunks=8, group_units={0: 2, 1: 1})
    assert again.tier.snapshot()["chunks_held"] == 2
    other = harness(budget_chunks=8, group_units={0: 1, 1: 1})
    assert other.tier.lookup(a, REQ) is LookupResult.MISS


def test_a_job_whose_rows_do_not_add_up_fails_whole_and_writes_nothing(harness, caplog):
    h = harness(budget_chunks=8)  # vLLM's contract: one row per key
    h.fill(0, seed=0)
    with caplog.at_level(logging.ERROR, logger=disk_tier.__name__):
        res1 = h.store([key(1), key(2)], [0, 1, 2])  # three unit rows for two keys
        res2 = h.load([key(1)], [0, 1])
    assert res1.success is False and res2.success is False
    assert disk_usage(h.tier.chunks.directory)[0] == 0
    assert len([r for r in caplog.records if "primary rows" in r.getMessage()]) == 1
    u = harness(budget_chunks=8, group_units={0: 2}, plan_key="units")
    assert u.store([key(3)], [0]).success is False  # a group-0 key needs two rows
    assert u.store([make_offload_key(b"z" * 16, 5)], [0]).success is False  # unknown group


# ---- a cache shared by replicas on one volume (one plan key, one namespace) ----


def test_replica_serves_a_chunk_another_wrote_after_it_started(harness):
    b = harness(plan_key="plan-a")  # starts first: sees nothing at start
    a = harness(plan_key="plan-a")
    assert a.tier.chunks.directory == b.tier.chunks.directory
    want = a.fill(0, seed=42)
    assert a.store([key(7)], [0]).success
    assert b.tier.lookup(key(7), REQ) is LookupResult.HIT
    snap = b.tier.snapshot()
    assert (snap["hits"], snap["shared_hits"], snap["misses"]) == (1, 1, 0)
    assert b.tier.chunks.is_shared(key(7))
    res = b.load([key(7)], [4])
    assert res.success and b.primary[4].tobytes() == want
    # Not counted against B's budget, and B's own stores never evict it.
    snap = b.tier.snapshot()
    assert (snap["chunks_held"], snap["bytes_used"], snap["loads"]) == (0, 0, 1)
    for i in range(6):  # B's budget is 4 chunks
        b.fill(i + 1, seed=100 + i)
        assert b.store([key(100 + i)], [i + 1]).success
    snap = b.tier.snapshot()
    assert snap["chunks_held"] == 4 and snap["bytes_used"] == 4 * CHUNK
    assert snap["evictions"] == 2
    assert os.path.exists(a.tier.chunks.path_of(key(7)))
    # A stored it, so A counts it; a lookup of B's own chunk by A is shared for A.
    assert a.tier.snapshot()["chunks_held"] == 1
    assert a.tier.lookup(key(105), REQ) is LookupResult.HIT
    assert a.tier.snapshot()["shared_hits"] == 1


def test_a_shared_chunk_its_writer_evicted_fails_cleanly_and_is_forgotten(harness):
    b = harness(plan_key="plan-a")
    a = harness(plan_key="plan-a", budget_chunks=2)
    a.fill(0, seed=1)
    assert a.store([key(1)], [0]).success
    assert b.tier.lookup(key(1), REQ) is LookupResult.HIT
    for i in range(2, 4):  # A evicts key 1 to make room
        a.fill(0, seed=i)
        assert a.store([key(i)], [0]).success
    assert not os.path.exists(a.tier.chunks.path_of(key(1)))
    # B trusts a known shared key (no stat) until a load of it fails.
    assert b.tier.lookup(key(1), REQ) is LookupResult.HIT
    b.fill(5, seed=5)
    before = b.primary[5].tobytes()
    res = b.load([key(1)], [5])
    assert res.success is False and not res.successful_keys
    assert b.primary[5].tobytes() == before
    assert not b.tier.chunks.is_shared(key(1))
    assert b.tier.snapshot()["load_failures"] == 1
    assert b.tier.lookup(key(1), REQ) is LookupResult.MISS
    # A's other chunks are still served; a store by B of a chunk A holds writes nothing.
    assert b.tier.lookup(key(3), REQ) is LookupResult.HIT
    ino = os.stat(a.tier.chunks.path_of(key(3))).st_ino
    a.fill(0, seed=3)
    b.primary[0] = a.primary[0]
    assert b.store([key(3)], [0]).success
    assert os.stat(a.tier.chunks.path_of(key(3))).st_ino == ino
    snap = b.tier.snapshot()
    assert (snap["stores"], snap["chunks_held"], snap["bytes_used"]) == (0, 0, 0)
    # A shared key whose writer evicted it before B's load noticed: B's store writes it.
    assert b.tier.chunks.is_shared(key(3))
    os.remove(a.tier.chunks.path_of(key(3)))
    assert b.store([key(3)], [0]).success
    assert not b.tier.chunks.is_shared(key(3))
    assert b.tier.chunks.contains(key(3), refresh=False)
    snap = b.tier.snapshot()
    assert (snap["stores"], snap["chunks_held"], snap["bytes_used"]) == (1, 1, CHUNK)


def test_a_chunk_of_the_wrong_size_or_a_temp_file_is_not_a_shared_hit(harness):
    b = harness(plan_key="plan-a")
    path = b.tier.chunks.path_of(key(1))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x" * (CHUNK - 1))  # not what this plan writes
    tmp = os.path.join(os.path.dirname(path), f".{key(2).hex()}.1.2.tmp")
    with open(tmp, "wb") as f:
        f.write(b"x" * CHUNK)
    assert b.tier.lookup(key(1), REQ) is LookupResult.MISS
    assert b.tier.lookup(key(2), REQ) is LookupResult.MISS
    assert b.tier.snapshot()["shared_hits"] == 0


def test_shared_lookups_can_be_turned_off_and_known_keys_are_bounded(harness):
    private = harness(plan_key="plan-a", shared=False)
    few = harness(plan_key="plan-a", max_shared_keys=2)
    a = harness(plan_key="plan-a", budget_chunks=8)
    for i in range(3):
        a.fill(i, seed=i)
        assert a.store([key(i)], [i]).success
    assert private.tier.lookup(key(0), REQ) is LookupResult.MISS
    for i in range(3):
        assert few.tier.lookup(key(i), REQ) is LookupResult.HIT
    assert few.tier.snapshot()["shared_known"] == 2
    assert not few.tier.chunks.is_shared(key(0))  # the oldest was dropped (still findable)
    assert few.tier.lookup(key(0), REQ) is LookupResult.HIT


def test_two_replicas_writing_interleaved_stay_within_both_budgets(tmp_path, monkeypatch):
    d = str(tmp_path / "shared")
    budget_a, budget_b = 128 * 1024, 192 * 1024
    a = ChunkDir(d, budget_a, fsync=False)
    rng = random.Random(11)
    sizes = [1, 700, 4096, 5000, 12_288, 40_000]
    # A writes a little before B starts: B adopts (counts) those files.
    datas: dict[bytes, bytes] = {}

    def put(inst, k):
        data = datas.setdefault(k, rng.randbytes(rng.choice(sizes)))
        assert inst.put(k, data)

    for i in range(4):
        put(a, key(i, 1))
    b = ChunkDir(d, budget_b, fsync=False)
    assert b.snapshot()["chunks_held"] == 4
    peaks = []
    real_replace = os.replace

    def measure_then_replace(src, dst):
        peaks.append(disk_usage(d)[2])
        real_replace(src, dst)

    monkeypatch.setattr(disk_tier.os, "replace", measure_then_replace)
    written = {id(a): 0, id(b): 0}
    served = 0
    i = 0
    while written[id(a)] < 5 * budget_a or written[id(b)] < 5 * budget_b:
        inst, other = (a, b) if i % 2 else (b, a)
        common = rng.random() < 0.2  # a chunk of the common key space (either may hold it)
        k = key(rng.randrange(40), 2) if common else key(i, 0 if inst is a else 3)
        before = inst.snapshot()["stores"]
        put(inst, k)
        if inst.snapshot()["stores"] > before:
            written[id(inst)] += len(datas[k])
        if rng.random() < 0.3:  # read one the other wrote recently
            j = rng.randrange(max(0, i - 6), i + 1)
            ok = key(j, 0 if other is a else 3)
            if other.locate(ok, refresh=False) == "own" and inst.locate(ok) is not None:
                got = inst.get(ok)
                if got is not None:
                    assert got == datas[ok]
                    served += 1
        _n, _size, alloc = disk_usage(d)
        assert alloc <= budget_a + budget_b, (i, alloc)
        for x in (a, b):
            assert x.snapshot()["bytes_used"] <= x.budget_bytes
        i += 1
    assert max(peaks) <= budget_a + budget_b
    assert served > 0
    assert a.snapshot()["evictions"] > 0 and b.snapshot()["evictions"] > 0
    assert a.snapshot()["shared_known"] > 0 and b.snapshot()["shared_known"] > 0


def test_disk_metrics_come_from_the_catalogue(harness):
    from spillway_engine.metrics import CATALOGUE, DISK_TIER_METRICS

    defs = SpillwayDiskTier.build_metric_definitions({})
    assert list(defs) == [m.name for m in DISK_TIER_METRICS]
    for name, meta in defs.items():
        assert meta.documentation == CATALOGUE[name].help
        assert type(meta).__name__.lower().startswith(f"offloading{CATALOGUE[name].kind}")
    assert "spillway_disk_tier_shared_hits" in defs
    b = harness(plan_key="plan-a")
    a = harness(plan_key="plan-a")
    a.fill(0, seed=0)
    assert a.store([key(1)], [0]).success
    assert b.tier.lookup(key(1), REQ) is LookupResult.HIT
    data = {n: v[()] for n, v in b.tier.get_stats().data["data"].items()}
    assert data["spillway_disk_tier_shared_hits"] == 1 and data["spillway_disk_tier_hits"] == 1
    assert data["spillway_disk_tier_chunks"] == 0


# ---- KV events (medium STORAGE) for the router -------------------------------


def events_of(tier) -> list[tuple[bool, list[bytes]]]:
    out = []
    for ev in tier.take_events():
        assert ev.medium is Medium.STORAGE
        assert ev.removal_expected is (not ev.removed)
        out.append((ev.removed, list(ev.keys)))
    return out


def spec_with_events(on: bool):
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    return SimpleNamespace(
        kv_events_config=OffloadingKVEventsConfig(
            enable_kv_cache_events=on, self_describing_kv_events=False
        )
    )


def test_no_kv_events_unless_enabled(harness):
    h = harness()
    h.fill(0, seed=0)
    assert h.store([key(0)], [0]).success
    assert not h.tier.kv_events_enabled and events_of(h.tier) == []


@pytest.mark.parametrize(
    ("global_on", "flag", "want"),
    [(True, None, True), (True, True, True), (True, False, False), (False, None, False),
     (False, True, False)],
)
def test_kv_events_follow_vllms_kv_events_config(tmp_path, caplog, global_on, flag, want):
    primary = np.zeros((2, CHUNK), dtype=np.uint8)
    kw = {} if flag is None else {"enable_kv_events": flag}
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        tier = SpillwayDiskTier(
            spec_with_events(global_on), memoryview(primary), "SpillwayDiskTier",
            root_dir=str(tmp_path), budget_bytes=4 * CHUNK, plan_key="p",
            n_read_threads=1, n_write_threads=1, **kw,
        )
    try:
        assert tier.kv_events_enabled is want
        assert ("KV cache events are off" in caplog.text) is (flag is True and not global_on)
    finally:
        tier.shutdown()


def test_stores_and_evictions_publish_storage_events_in_order(harness):
    h = harness(budget_chunks=2, enable_kv_events=True, locality="local")
    for i in range(2):
        h.fill(i, seed=i)
    assert h.store([key(0), key(1)], [0, 1]).success
    evs = list(h.tier.take_events())
    assert len(evs) == 1 and evs[0].removed is False and evs[0].medium is Medium.STORAGE
    assert evs[0].locality is Locality.LOCAL and list(evs[0].keys) == [key(0), key(1)]
    assert events_of(h.tier) == []  # taken once
    # A store of a chunk already on disk writes nothing and says nothing.
    assert h.store([key(1)], [1]).success
    assert events_of(h.tier) == []
    h.fill(2, seed=2)
    assert h.store([key(2)], [2]).success  # evicts key 0, the least recently used
    assert events_of(h.tier) == [(True, [key(0)]), (False, [key(2)])]
    # Evicted and stored again: the router sees the removal before the new store.
    h.fill(3, seed=3)
    assert h.store([key(3)], [3]).success
    h.fill(0, seed=0)
    assert h.store([key(0)], [0]).success
    assert events_of(h.tier) == [
        (True, [key(1)]), (False, [key(3)]), (True, [key(2)]), (False, [key(0)])
    ]


def test_a_failed_store_announces_only_the_chunks_it_wrote(harness, monkeypatch):
    h = harness(enable_kv_events=True, failure_backoff_s=0.0)
    for i in range(2):
        h.fill(i, seed=i)
    real = disk_tier.os.replace
    calls = []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(disk_tier.os, "replace", second_fails)
    assert h.store([key(0), key(1)], [0, 1]).success is False
    assert events_of(h.tier) == [(False, [key(0)])]


def test_a_broken_own_file_found_on_load_is_announced_removed(harness):
    h = harness(enable_kv_events=True)
    for i in range(2):
        h.fill(i, seed=i)
    assert h.store([key(0), key(1)], [0, 1]).success
    events_of(h.tier)
    os.remove(h.tier.chunks.path_of(key(1)))
    assert h.load([key(0), key(1)], [5, 6]).success is False
    assert events_of(h.tier) == [(True, [key(1)])]


def test_shared_folder_only_the_writer_announces_a_chunk(harness):
    b = harness(plan_key="plan-a", enable_kv_events=True)
    a = harness(plan_key="plan-a", budget_chunks=2, enable_kv_events=True)
    a.fill(0, seed=1)
    assert a.store([key(1)], [0]).success
    assert events_of(a.tier) == [(False, [key(1)])]
    # B finds A's chunk: a hit, a load, a store of the same chunk: never announced by B.
    assert b.tier.lookup(key(1), REQ) is LookupResult.HIT
    assert b.load([key(1)], [4]).success
    b.primary[0] = a.primary[0]
    assert b.store([key(1)], [0]).success
    assert events_of(b.tier) == []
    # B's own stores evict B's own files only, and B announces only those.
    for i in range(5):
        b.fill(i + 1, seed=100 + i)
        assert b.store([key(100 + i)], [i + 1]).success
    assert events_of(b.tier) == [
        (False, [key(100), key(101), key(102), key(103)]),
        (True, [key(100)]), (False, [key(104)]),
    ]
    # A evicts its chunk: A announces the removal; B, whose load of it then fails,
    # forgets it silently (it was never B's).
    for i in range(2, 4):
        a.fill(0, seed=i)
        assert a.store([key(i)], [0]).success
    assert events_of(a.tier) == [(False, [key(2)]), (True, [key(1)]), (False, [key(3)])]
    assert b.load([key(1)], [4]).success is False
    assert events_of(b.tier) == []


def test_a_restarted_replica_announces_evicting_files_it_adopted(harness):
    a = harness(budget_chunks=3, enable_kv_events=True)
    for i in range(3):
        a.fill(i, seed=i)
        assert a.store([key(i)], [i]).success
    a.close()
    events_of(a.tier)
    # The replacement adopts them (no store events: it did not write them) and trims
    # them to its smaller budget, announcing each removal.
    c = harness(budget_chunks=2, enable_kv_events=True)
    assert events_of(c.tier) == [(True, [key(0)])]
    c.fill(0, seed=9)
    assert c.store([key(9)], [0]).success
    assert events_of(c.tier) == [(True, [key(1)]), (False, [key(9)])]


def test_storage_events_become_vllm_kv_events_of_medium_storage(harness):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    h = harness(budget_chunks=1, enable_kv_events=True)
    for i in range(2):
        h.fill(i, seed=i)
        assert h.store([key(i)], [i]).success
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    out = list(tracker.take_events(h.tier.take_events()))
    assert [type(e) for e in out] == [BlockStored, BlockRemoved, BlockStored]
    assert {e.medium for e in out} == {"STORAGE"}
    assert out[0].block_hashes == out[1].block_hashes != out[2].block_hashes


def test_an_evicted_chunk_asked_for_again_is_thrash_once(harness):
    """The autoscaler's recompute signal under a disk tier: a miss on a key this tier
    evicted (its anchor group's only), counted once per eviction."""
    h = harness(budget_chunks=2)
    for i in range(3):  # 0 goes
        h.fill(i, seed=i)
        assert h.store([key(i)], [i]).success
    assert h.tier.lookup(key(0), REQ) is LookupResult.MISS
    assert h.tier.lookup(key(0), REQ) is LookupResult.MISS  # remembered once
    assert h.tier.lookup(key(9), REQ) is LookupResult.MISS  # never held: not thrash
    assert h.tier.snapshot()["thrash"] == 1
    other = harness(budget_chunks=2, anchor_group=1)  # key() is group 0: not the anchor
    for i in range(3):
        other.fill(i, seed=i)
        assert other.store([key(10 + i)], [i]).success
    assert other.tier.lookup(key(10), REQ) is LookupResult.MISS
    assert other.tier.snapshot()["thrash"] == 0
