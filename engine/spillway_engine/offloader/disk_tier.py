"""A bounded disk tier under the host pool (issue 31), for vLLM 0.33's tiering.

vLLM 0.33 ships multi-tier offloading (``vllm/v1/kv_offload/tiering``): the CPU
pool is the primary tier and secondary tiers hang under it. Its ``fs`` tier
writes one file per chunk and never evicts, so nothing bounds it. This module
adds a secondary tier that does:

* a byte budget: least recently used chunk files are deleted *before* a store
  would go over it, so the files of the tier never hold more than the budget
  (counted as the bytes the filesystem allocates for them, page rounded);
* crash safety: a chunk is written to a hidden temporary name, fsynced and
  renamed into place; at start leftover temporaries (and complete-looking files
  of the wrong size) are deleted and the LRU index and byte count are rebuilt
  from the complete files already there, so a restarted pod, or a second
  replica on a shared volume, finds them;
* a namespace directory derived from a plan key (and from the chunk size and,
  where vLLM's spec says so, the model's storage identity), so files written
  under another plan are never read;
* clean failure: ENOSPC, EROFS, EACCES or any other ``OSError`` fails the
  store job (``success=False``, which feeds vLLM's back-pressure detector
  through ``TieringOffloadingManager._update_backpressure``), is counted, is
  logged once per episode, and starts a short backoff during which stores are
  dropped without touching the disk. Nothing raises into a request.

Use it from ``kv_connector_extra_config`` of ``TieringOffloadingSpec``::

    "secondary_tiers": [{
        "type": "SpillwayDiskTier",
        "module_path": "spillway_engine.offloader.disk_tier",
        "root_dir": "/var/cache/spillway/kv",
        "budget_bytes": 200 * 2**30,
        "plan_key": "<the plan hash>",
        "backpressure": {"backpressure_cls": "EMABackpressureDetector",
                         "failure_threshold": 3}
    }]

(vLLM gives ``failure_threshold`` by default only to its own ``fs``/``obj``
tier types, so it is named here; its LOCAL water marks assume NVMe, and an
fsynced small chunk on a slow disk can trip them, which drops cascades.)

A cache shared by replicas (a ReadWriteMany volume mounted by every replica,
one plan key, so one namespace directory): the budget is per instance. Each
counts, and evicts, the files it saw at start (so a replacement pod adopts a
dead pod's files and the total stays bounded) plus the files it wrote itself.
A chunk another replica wrote later is found on an index miss by a ``stat`` of
its path (a complete file of the right size; temporaries have other names),
served as a hit (``shared_hits``) and remembered in a bounded LRU of shared
keys (``max_shared_keys``), but never counted against this budget nor evicted
here: its writer bounds it. So the files on the volume take no more than the
replicas' budgets together (a replica that goes away leaves its files, which
replicas already running do not count, until a replica that starts adopts
them). A store of a chunk whose file is already
there writes nothing. A replica may delete a file another one knows of: the
load fails cleanly and the key is forgotten. ``shared=False`` turns the
``stat`` off (a private disk). On a shared volume set ``stale_temp_s`` so that
start-up cleanup spares another replica's write in flight.

KV events: when vLLM's KV cache events are on (``kv_events_config`` of the
offloading spec; ``enable_kv_events`` turns the tier's off, or on where no spec is
given), :meth:`SpillwayDiskTier.take_events` yields ``OffloadingEvent`` s of medium
``STORAGE``: a store for each chunk file this instance wrote, a removal for each of
its own files it deleted, in order. Chunks of other replicas it finds on a shared
directory are never announced by it (their writer does), so a router that counts a
shared folder's chunks once for all its replicas stays exact.

Counters: :meth:`SpillwayDiskTier.snapshot` (a dict), and the
``spillway_disk_tier_*`` series of Spillway's metric catalogue
(``spillway_engine.metrics.DISK_TIER_METRICS``), reported through vLLM's tier
``get_stats``/``build_metric_definitions`` hooks.

vLLM's primary gives a tier one row per key. Under Spillway's unit pool as the
primary (a key of group g takes ``units_g`` rows), pass ``group_units`` ({group:
units}); a job whose rows do not add up fails whole rather than store bytes
under the wrong key.

This module is the vLLM side (jobs, lookups, events, metrics); the files, their
budget, LRU index and crash-safe writes are :class:`ChunkDir` in ``disk_tier_files.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

from spillway_engine.metrics import (
    DISK_TIER_BUDGET_BYTES,
    DISK_TIER_CHUNKS,
    DISK_TIER_METRICS,
    DISK_TIER_USED_BYTES,
)

# The tier's files and their names, re-exported: tools, tests and the plan's
# module_path know the tier by this module.
from spillway_engine.offloader.disk_tier_files import (  # noqa: F401
    CHUNK_SUFFIX,
    EVICTED_MEMORY,
    NAMESPACE_PREFIX,
    OWN,
    SHARED,
    TMP_PREFIX,
    TMP_SUFFIX,
    Buffer,
    ChunkDir,
    DiskTierStats,
    _describe,
    plan_namespace,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)

#: Prometheus series the tier exports through vLLM's offloading stats (name: kind,
#: help), from Spillway's metric catalogue (:data:`~spillway_engine.metrics.DISK_TIER_METRICS`);
#: vLLM registers them from ``build_metric_definitions``.
DISK_METRICS: dict[str, tuple[str, str]] = {m.name: (m.kind, m.help) for m in DISK_TIER_METRICS}
#: series -> the :class:`DiskTierStats` field it reports.
_STAT_FIELDS: dict[str, str] = {
    DISK_TIER_BUDGET_BYTES.name: "budget_bytes",
    DISK_TIER_USED_BYTES.name: "bytes_used",
    DISK_TIER_CHUNKS.name: "chunks_held",
    **{
        m.name: m.name.removeprefix("spillway_disk_tier_")
        for m in DISK_TIER_METRICS
        if m.kind == "counter"
    },
}


class SpillwayDiskTier(SecondaryTierManager):
    """vLLM 0.33 ``SecondaryTierManager`` over a bounded :class:`ChunkDir`.

    Every vLLM chunk is one primary-tier row of ``block_size_bytes``; a store
    copies rows out of the primary memoryview, a load copies a file back into
    the row the tiering manager allocated. The I/O runs on vLLM's fs tier
    thread pool; the scheduler-thread methods only touch the in-memory index.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec | None,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        budget_bytes: int,
        plan_key: str,
        n_read_threads: int = 4,
        n_write_threads: int = 4,
        fsync: bool = True,
        stale_temp_s: float = 0.0,
        failure_backoff_s: float = 1.0,
        max_failure_backoff_s: float = 30.0,
        group_units: dict[int, int] | None = None,
        anchor_group: int | None = None,
        locality: str | None = None,
        shared: bool = True,
        max_shared_keys: int = 1 << 16,
        enable_kv_events: bool | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality.upper()) if locality else None
        # KV events of this tier's own files (medium STORAGE), in the order they happened;
        # None when events are off. Written from the I/O threads, drained by take_events.
        self._events_lock = threading.Lock()
        self._events: list[tuple[bytes, bool]] | None = (
            [] if _kv_events_on(offloading_spec, enable_kv_events, tier_type) else None
        )
        # vLLM's contract is one primary row per key. Spillway's unit pool gives a
        # key of group g ``group_units[g]`` rows (its units, in order), so a job's
        # chunk_ids are the keys' rows back to back; each key's file holds them all.
        self.group_units = {int(g): int(n) for g, n in group_units.items()} if group_units else None
        if not plan_key:
            raise ValueError("SpillwayDiskTier needs a non-empty plan_key")
        units = "" if self.group_units is None else f"units={sorted(self.group_units.items())}"
        self.namespace = plan_namespace(
            plan_key, self.block_size_bytes, _spec_identity(offloading_spec) + units
        )
        self.chunks = ChunkDir(
            os.path.join(root_dir, self.namespace),
            budget_bytes,
            chunk_bytes=self.block_size_bytes,
            fsync=fsync,
            stale_temp_s=stale_temp_s,
            size_of=None if self.group_units is None else self._key_bytes,
            shared=shared,
            max_shared_keys=max_shared_keys,
            on_change=None if self._events is None else self._record_event,
        )
        # thrash counts one key per chunk of prefix: the anchor group's (all keys when
        # None, as with one group)
        self.anchor_group = anchor_group
        self._mismatch_logged = False
        self.stats = self.chunks.stats
        self._reported: dict[str, int] = {}
        self._failure_backoff_s = failure_backoff_s
        self._max_failure_backoff_s = max_failure_backoff_s
        self._backoff = 0.0
        self._backoff_until = 0.0
        self._failing = False  # inside a write-failure episode
        self._episode_failures = 0
        self._state_lock = threading.Lock()
        self._results: dict[JobId, JobResult] = {}
        self._immediate: list[JobResult] = []
        self._pool = DualQueueThreadPool(
            n_read_threads, n_write_threads, thread_name_prefix="spillway_disk"
        )

    # ---- scheduler-thread interface ----------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        where = self.chunks.locate(key)
        if where is None:
            self.chunks.count("misses")
            anchor = self.anchor_group is None or get_offload_group_idx(key) == self.anchor_group
            if anchor and self.chunks.evicted_lately(key):
                self.chunks.count("thrash")
            return LookupResult.MISS
        self.chunks.count("hits")
        if where == SHARED:
            self.chunks.count("shared_hits")
        return LookupResult.HIT

    def touch(self, keys, req_context: ReqContext) -> None:
        self.chunks.touch(keys)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job_id = job_metadata.job_id
        if not self.chunks.usable or time.monotonic() < self._backoff_until:
            self.chunks.count("stores_dropped", len(keys))
            self._immediate.append(JobResult(job_id=job_id, success=False))
            return
        offsets = self._key_offsets(keys, job_metadata.chunk_ids)
        if offsets is None:
            self._immediate.append(JobResult(job_id=job_id, success=False))
            return
        self._pool.enqueue_store(job_id, 1, [lambda: self._store_task(job_id, keys, offsets)])

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job_id = job_metadata.job_id
        offsets = self._key_offsets(keys, job_metadata.chunk_ids)
        if offsets is None:
            self._immediate.append(JobResult(job_id=job_id, success=False))
            return
        pinned = [self.chunks.pin(k) for k in keys]
        self._pool.enqueue_load(job_id, 1, [lambda: self._load_task(job_id, keys, offsets, pinned)])

    # ---- rows of a key ------------------------------------------------
    def _rows_of(self, key: bytes) -> int | None:
        if self.group_units is None:
            return 1
        return self.group_units.get(get_offload_group_idx(key))

    def _key_bytes(self, key: bytes) -> int | None:
        rows = self._rows_of(key)
        return None if rows is None else rows * self.block_size_bytes

    def _key_offsets(self, keys: list, chunk_ids: Iterable[int]) -> list[list[int]] | None:
        """Byte offsets of each key's rows in the primary view, or None when the job's
        chunk ids do not add up (then it fails whole, rather than store misaligned
        bytes under the wrong keys)."""
        ids = [int(c) for c in chunk_ids]
        out: list[list[int]] = []
        pos = 0
        for key in keys:
            rows = self._rows_of(key)
            if rows is None or pos + rows > len(ids):
                break
            out.append([c * self.block_size_bytes for c in ids[pos : pos + rows]])
            pos += rows
        else:
            if pos == len(ids):
                return out
        if not self._mismatch_logged:
            self._mismatch_logged = True
            logger.error(
                "spillway disk tier: a job of %d keys came with %d primary rows (%s); "
                "set group_units to the primary's units per group",
                len(keys),
                len(ids),
                "one row per key" if self.group_units is None else self.group_units,
            )
        return None

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self._immediate = self._immediate, []
        for job_id, _ok, transfer_time in self._pool.get_finished():
            result = self._results.pop(job_id, None)
            if result is None:  # the task itself died; should not happen
                result = JobResult(job_id=job_id, success=False)
            result.transfer_time = transfer_time
            done.append(result)
        return done

    def has_pending_work(self) -> bool:
        return bool(self._immediate)

    # ---- KV events ----------------------------------------------------
    @property
    def kv_events_enabled(self) -> bool:
        return self._events is not None

    def _record_event(self, key: bytes, removed: bool) -> None:
        with self._events_lock:
            if self._events is not None:
                self._events.append((key, removed))

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The tier's KV events since the last call (vLLM's ``TieringOffloadingManager``
        yields them after the primary's): ``removed=False`` for each chunk file this
        instance wrote (a store that completed, whatever became of the rest of its job),
        ``removed=True`` for each of its own files it deleted (evicted, or found broken
        on a load), in the order they happened, consecutive ones of a kind in one event.
        Another instance's files on a shared directory, which this one only finds,
        serves and never deletes, are never announced here: their writer announces them.

        Stores say ``removal_expected``, so vLLM's event tracker keeps a chunk's
        payload until this tier's removal and fans it out to the same block hashes.
        """
        if self._events is None:
            return
        with self._events_lock:
            taken, self._events = self._events, []
        run: list = []
        removed = False
        for key, gone in taken:
            if run and gone != removed:
                yield self._event(run, removed)
                run = []
            run.append(key)
            removed = gone
        if run:
            yield self._event(run, removed)

    def _event(self, keys: list, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys,
            medium=self.medium,
            removed=removed,
            locality=self.locality,
            removal_expected=not removed,
        )

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def config_info(self):
        return {}

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        kinds = {"gauge": OffloadingGaugeMetadata, "counter": OffloadingCounterMetadata}
        return {m.name: kinds[m.kind](documentation=m.help) for m in DISK_TIER_METRICS}

    def get_stats(self) -> OffloadingConnectorStats:
        """The counters since the last call and the gauges now (vLLM's per-step pull)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        snap = self.snapshot()
        stats = OffloadingConnectorStats()
        for m in DISK_TIER_METRICS:
            name, field = m.name, _STAT_FIELDS[m.name]
            if m.kind == "gauge":
                stats.set_gauge(name, snap[field])
                continue
            delta = snap[field] - self._reported.get(field, 0)
            self._reported[field] = snap[field]
            stats.increase_counter(name, delta)
        return stats

    def snapshot(self) -> dict[str, int]:
        return self.chunks.snapshot()

    # ---- pool-thread work --------------------------------------------
    def _store_task(self, job_id: JobId, keys: list, offsets: list[list[int]]) -> None:
        size = self.block_size_bytes
        flat = self._primary_kv_view.cast("B")
        ok = True
        written = 0
        for key, rows in zip(keys, offsets, strict=True):
            try:
                stored = self.chunks.put(key, [flat[off : off + size] for off in rows])
            except OSError as exc:
                self._on_write_failure(exc)
                ok = False
                break
            except Exception as exc:  # never into a request
                logger.exception("spillway disk tier: store failed: %s", exc)
                ok = False
                break
            if stored:
                written += size * len(rows)
            else:
                self.chunks.count("stores_dropped")
        if ok:
            self._on_write_success()
        self._results[job_id] = JobResult(job_id=job_id, success=ok, transfer_bytes=written or None)

    def _load_task(
        self, job_id: JobId, keys: list, offsets: list[list[int]], pinned: list[bool]
    ) -> None:
        size = self.block_size_bytes
        loaded: list = []  # a prefix of keys: loading stops at the first failure
        loaded_bytes = 0
        failed = False
        try:
            for key, rows, pin in zip(keys, offsets, pinned, strict=True):
                if failed or not pin:
                    failed = True
                    continue
                try:
                    self.chunks.read_into(key, self._primary_kv_view, rows, size)
                except (OSError, ValueError) as exc:
                    logger.debug("spillway disk tier: load %s: %s", key.hex(), exc)
                    self.chunks.count("load_failures")
                    self.chunks.forget(key)
                    failed = True
                    continue
                self.chunks.count("loads")
                loaded.append(key)
                loaded_bytes += size * len(rows)
        finally:
            for key, pin in zip(keys, pinned, strict=True):
                if pin:
                    self.chunks.unpin(key)
        if not failed:
            result = JobResult(job_id=job_id, success=True, transfer_bytes=loaded_bytes or None)
        else:
            # The loaded prefix is kept, as vLLM's fs tier does.
            result = JobResult(
                job_id=job_id,
                success=False,
                successful_keys=tuple(loaded) or None,
                transfer_bytes=loaded_bytes or None,
            )
        self._results[job_id] = result

    def _on_write_failure(self, exc: OSError) -> None:
        self.chunks.count("write_failures")
        with self._state_lock:
            self._episode_failures += 1
            self._backoff = min(
                self._max_failure_backoff_s,
                max(self._failure_backoff_s, self._backoff * 2),
            )
            self._backoff_until = time.monotonic() + self._backoff
            first = not self._failing
            self._failing = True
        if first:
            logger.warning(
                "spillway disk tier: disk is %s (%s); stores fail and back off "
                "until a write succeeds",
                _describe(exc),
                exc,
            )

    def _on_write_success(self) -> None:
        with self._state_lock:
            if not self._failing:
                return
            n, self._episode_failures = self._episode_failures, 0
            self._failing = False
            self._backoff = 0.0
        logger.warning("spillway disk tier: writes recovered after %d failures", n)


def _kv_events_on(offloading_spec: Any, flag: bool | None, tier_type: str) -> bool:
    """Whether the tier publishes KV events: with a spec, when vLLM's KV cache events
    are on (``flag=False`` turns the tier's off); without one (tests, tools), ``flag``."""
    config = getattr(offloading_spec, "kv_events_config", None)
    if offloading_spec is None or config is None:
        return bool(flag)
    on = bool(getattr(config, "enable_kv_cache_events", False))
    if flag and not on:
        logger.warning(
            "spillway disk tier %s: enable_kv_events is set but vLLM's KV cache events "
            "are off; the tier emits none",
            tier_type,
        )
    return on and flag is not False


def _spec_identity(offloading_spec: Any) -> str:
    """The storage identity vLLM's fs tier would use, when a spec is given."""
    if offloading_spec is None or getattr(offloading_spec, "config", None) is None:
        return ""
    try:
        from vllm.v1.kv_offload.file_mapper import FileMapper

        mapper = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=offloading_spec,
            blocks_per_file=getattr(offloading_spec, "blocks_per_chunk", 1),
        )
        return f"{sorted(mapper.get_run_config().items())!r} rank={mapper.rank}"
    except Exception:  # a spec this vLLM does not describe: plan key only
        return ""


__all__ = [
    "DISK_METRICS",
    "ChunkDir",
    "DiskTierStats",
    "SpillwayDiskTier",
    "plan_namespace",
]
