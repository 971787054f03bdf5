"""The scheduler-side host pool: vLLM's CPU manager with byte-exact, multi-unit slots.

vLLM's ``CPUOffloadingManager`` keeps the LRU, reference counts, events and request
accounting; Spillway only changes what a slot is. Upstream, every (chunk, group) key
takes one row sized for the largest group. Here a key of group ``g`` takes
``units_g`` units of the shared pool (:mod:`spillway_engine.offloader.host_layout`), so a
small group's chunk costs only its own bytes and all groups share one LRU.

The manager's ``chunk_id`` is a handle; ``self._units[handle]`` lists its units, and
the load/store spec it hands the worker is those units, key after key.

It also counts what vLLM does not export about the pool (fill, evictions, evicted
keys asked for again), for Spillway's ``spillway_host_pool_*`` metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from spillway_engine.arith import cdiv
from spillway_engine.metrics import (
    HOST_POOL_EVICTIONS,
    HOST_POOL_THRASH,
    HOST_POOL_TOKENS,
    HOST_POOL_USED_CHUNKS,
)
from spillway_engine.offloader.host_layout import HostLayout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import LookupResult, OffloadKey, PrepareStoreOutput, ReqContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

#: Evicted keys remembered for the thrash counter (a later lookup of one is thrash).
EVICTED_MEMORY = 65_536


class _StoreRefused(Exception):
    """Raised inside vLLM's ``prepare_store`` when the admitted keys cannot fit."""


class _EvictableUnits:
    """The units held by evictable keys (ref_cnt 0), so a store can be refused before
    anything is evicted.

    The count lives in the manager, not in a wrapper around the policy: ``self._policy``
    stays vLLM's own policy object, so ``isinstance`` holds and whatever vLLM (or a
    test) reads or writes on it (ARC's ``target_t1_size``) is the policy's own. (A
    subclass of each policy class would also pass ``isinstance``, but changes the
    object's class and sees the policy's calls to itself.) A key's ref_cnt changes to
    or from 0 only inside vLLM's ``_prepare_load`` (also the tiering manager's path),
    ``complete_load`` and ``complete_store``, and a key leaves the pool evictable only
    through Spillway's eviction (``_make_room``; vLLM's ``prepare_store`` never evicts
    itself, see ``_get_num_free_chunks``) or ``reset_cache``. Each is overridden to move
    the count by the units of the distinct keys that changed, so it stays exact (the
    property tests in tests/contract/test_host_manager.py check it every step).

    Mixed in before vLLM's ``CPUOffloadingManager``, like :class:`_UnitSlots`.
    """

    def _idle_units(self, keys: Iterable[OffloadKey]) -> int:
        """Units of the distinct ``keys`` held in the pool with ref_cnt 0."""
        total = 0
        for key in dict.fromkeys(keys):
            chunk = self._policy.get(key)
            if chunk is not None and chunk.ref_cnt == 0:
                total += self.units_of(key)
        return total

    def _prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext, *, record_access: bool
    ) -> Any:
        pinned = self._idle_units(keys)  # these go ref_cnt 0 -> 1
        spec = super()._prepare_load(keys, req_context, record_access=record_access)
        self.evictable_units -= pinned
        return spec

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        super().complete_load(keys, req_context)
        # every key had ref_cnt > 0 (vLLM asserts it); those now at 0 went 1 -> 0
        self.evictable_units += self._idle_units(keys)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        stored = 0
        if success:  # pending keys (ref_cnt -1) become ready at ref_cnt 0
            for key in dict.fromkeys(keys):
                chunk = self._policy.get(key)
                if chunk is not None and not chunk.is_ready:
                    stored += self.units_of(key)
        # a failed store removes pending keys, which were never evictable
        super().complete_store(keys, req_context, success)
        self.evictable_units += stored


class _UnitSlots:
    """The slot half of the manager: which units each key holds, and the pool figures.

    Mixed in before vLLM's ``CPUOffloadingManager`` (whose slot hooks it overrides);
    vLLM's types come as class attributes from :func:`make_manager_class`.
    """

    def _empty_slots(self) -> None:
        """No key holds a unit: at start and after ``reset_cache``."""
        # Units are handed out like vLLM hands out rows: never-used ones in order,
        # then freed ones last-in first-out (single-group pools match slot for slot).
        self._fresh_units = 0
        self._free_units: list[int] = []
        self._units: dict[int, np.ndarray] = {}
        self._handle_group: dict[int, int] = {}
        self._free_handles: list[int] = []
        self._next_handle = 0
        # current pool gauges
        self.used_units = 0
        self.evictable_units = 0
        self.stored_bytes = 0
        self.keys_per_group = dict.fromkeys(self._group_units, 0)

    def units_of(self, key: OffloadKey) -> int:
        return self._group_units[self._group_idx(key)]

    @property
    def free_units(self) -> int:
        return self.layout.num_units - self._fresh_units + len(self._free_units)

    def _get_num_free_chunks(self) -> int:
        # vLLM's prepare_store counts slots in keys; here a key takes its group's
        # units, so admission is decided in _allocate_chunks, which vLLM calls with
        # exactly the keys it admitted. Tell it every key has a slot, so that it
        # never evicts by key count itself.
        return 1 << 62

    def _allocate_chunks(self, keys: list[OffloadKey]) -> list[ChunkStatus]:
        self._make_room(sum(self.units_of(k) for k in keys))
        chunks = []
        for key in keys:
            k = self.units_of(key)
            fresh = min(k, self.layout.num_units - self._fresh_units)
            units = list(range(self._fresh_units, self._fresh_units + fresh))
            self._fresh_units += fresh
            units.extend(self._free_units.pop() for _ in range(k - fresh))
            handle = self._free_handles.pop() if self._free_handles else self._new_handle()
            group = self._group_idx(key)
            self._units[handle] = np.array(units, dtype=np.int64)
            self._handle_group[handle] = group
            self.used_units += k
            self.stored_bytes += self._group_chunk_bytes[group]
            self.keys_per_group[group] += 1
            chunks.append(self._chunk_status(handle))
        return chunks

    def _new_handle(self) -> int:
        self._next_handle += 1
        return self._next_handle - 1

    def _free_chunk(self, chunk: ChunkStatus) -> None:
        units = self._units.pop(chunk.chunk_id)
        group = self._handle_group.pop(chunk.chunk_id)
        self._free_handles.append(chunk.chunk_id)
        # reversed, so popping hands a multi-unit slot back in its own order
        self._free_units.extend(units[::-1].tolist())
        self.used_units -= len(units)
        self.stored_bytes -= self._group_chunk_bytes[group]
        self.keys_per_group[group] -= 1

    def _get_load_store_spec(
        self, keys: Iterable[OffloadKey], chunks: Iterable[ChunkStatus]
    ) -> CPULoadStoreSpec:
        parts = [self._units[c.chunk_id] for c in chunks]
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return self._load_store_spec(ids.tolist())

    def get_stats(self) -> Any:
        stats = super().get_stats()
        # vLLM derives "pinned by transfers" from its own chunk counters, which this
        # pool does not use: restate it from the keys held here.
        pinned = len(self._units) - self._num_evictable_cache_chunks
        usage = pinned / self._num_chunks if self._num_chunks else 0.0
        stats.set_gauge(self._offload_metrics.CPU_CACHE_USAGE_PERC, usage)
        read = max(usage - self._num_write_pending_chunks / max(self._num_chunks, 1), 0.0)
        stats.set_gauge(self._offload_metrics.CPU_CACHE_READ_USAGE_PERC, read)
        sets = sum(self._group_units.values())
        stats.set_gauge(HOST_POOL_USED_CHUNKS.name, self.used_units // sets)
        stats.set_gauge(
            HOST_POOL_TOKENS.name,
            self.keys_per_group[self.anchor_group] * self.layout.chunk_tokens,
        )
        evicted, thrash = self._reported
        stats.increase_counter(HOST_POOL_EVICTIONS.name, self.evicted_keys - evicted)
        stats.increase_counter(HOST_POOL_THRASH.name, self.thrash_chunks - thrash)
        self._reported = (self.evicted_keys, self.thrash_chunks)
        return stats

    @property
    def fill(self) -> float:
        """Share of the pool's units holding a key (stored or being stored)."""
        return self.used_units / self.layout.num_units if self.layout.num_units else 0.0

    @property
    def row_utilization(self) -> float:
        """True KV bytes of the held keys / host bytes their slots take."""
        slot_bytes = self.used_units * self.layout.unit_bytes
        return self.stored_bytes / slot_bytes if slot_bytes else 1.0


class _Eviction:
    """The eviction half of the manager: room by units, refusals that evict nothing,
    and the thrash count (evicted keys asked for again).

    Mixed in before vLLM's ``CPUOffloadingManager``, like :class:`_UnitSlots`.
    """

    # ------------------------------------------------------------- eviction

    def _make_room(self, need: int) -> None:
        """Free ``need`` units by evicting LRU keys, or refuse having evicted nothing.

        The store's own offer is never evicted for it (vLLM's rule), so keys of the
        offer that sit evictable in the pool do not count towards the room.
        """
        short = need - self.free_units
        if short <= 0:
            return
        offered_idle = 0
        for key in self._offer:
            chunk = self._policy.get(key)
            if chunk is not None and chunk.ref_cnt == 0:
                offered_idle += self.units_of(key)
        if short > self.evictable_units - offered_idle:
            raise _StoreRefused
        # As many keys as surely needed in one call (vLLM's single call when every
        # key takes the same units), then one at a time until the units are free.
        batch = cdiv(short, self._max_units)
        while short > 0:
            evicted = self._policy.evict(batch, self._offer)
            assert evicted, "evictable units were counted but could not be evicted"
            self._num_evictable_cache_chunks -= len(evicted)
            for key, chunk in evicted:
                units = len(self._units[chunk.chunk_id])
                short -= units
                self.evictable_units -= units
                self._free_chunk(chunk)
                self._store_evicted.append(key)
                if self._group_idx(key) == self.anchor_group:
                    self._remember_evicted(key)
            self.evicted_keys += len(evicted)
            batch = 1
        if self.events is not None:
            removed = list(self._store_evicted)
            self.events.append(
                self._offloading_event(keys=removed, medium=self.medium, removed=True)
            )

    def _remember_evicted(self, key: OffloadKey) -> None:
        self._recently_evicted[key] = None
        self._recently_evicted.move_to_end(key)
        if len(self._recently_evicted) > EVICTED_MEMORY:
            self._recently_evicted.popitem(last=False)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        self._offer, self._store_evicted = set(keys), []
        try:
            output = super().prepare_store(keys, req_context)
        except _StoreRefused:
            # vLLM's own refusal point: its bookkeeping of the offer is done, nothing
            # was evicted or allocated.
            return None
        finally:
            self._offer = set()
        if output is not None and self._store_evicted:
            output = replace(output, evicted_keys=self._store_evicted)
        return output

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = super().lookup(key, req_context)
        if result is not self._lookup_hit and key in self._recently_evicted:
            del self._recently_evicted[key]
            self.thrash_chunks += 1
        return result

    def reset_cache(self) -> None:
        super().reset_cache()
        self._empty_slots()


def make_manager_class() -> type:
    """Build the class lazily: importing vLLM must stay out of the planner's path."""
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadingEvent,
        get_offload_group_idx,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    class SpillwayHostManager(_Eviction, _EvictableUnits, _UnitSlots, CPUOffloadingManager):
        _group_idx = staticmethod(get_offload_group_idx)
        _load_store_spec = CPULoadStoreSpec
        _offload_metrics = CPUOffloadingMetrics
        _chunk_status = ChunkStatus
        _offloading_event = OffloadingEvent
        _lookup_hit = LookupResult.HIT

        def __init__(self, layout: HostLayout, **kwargs: Any):
            self.layout = layout
            self._group_units = {g.group_id: g.units for g in layout.groups}
            self._group_chunk_bytes = {g.group_id: g.chunk_bytes for g in layout.groups}
            min_units = min(self._group_units.values())
            # The policy and vLLM's bookkeeping count keys; at most this many fit.
            super().__init__(num_chunks=layout.num_units // min_units, **kwargs)
            self._max_units = max(self._group_units.values())
            self._empty_slots()
            #: the store being prepared: its offer (never evicted for it) and evictions
            self._offer: set[OffloadKey] = set()
            self._store_evicted: list[OffloadKey] = []
            #: the group whose chunks stand for "chunks of prefix" in the metrics
            self.anchor_group = layout.anchor_group
            # cumulative pool statistics (the gauges are reset with the slots)
            self.evicted_keys = 0
            self.thrash_chunks = 0
            self._reported = (0, 0)
            self._recently_evicted: OrderedDict[OffloadKey, None] = OrderedDict()

    return SpillwayHostManager


def make_primary_tier_class() -> type:
    """The unit pool as the primary tier of vLLM's ``TieringOffloadingManager`` (a disk
    tier under it): the four calls vLLM's ``CPUPrimaryTierOffloadingManager`` adds,
    and the view of the shared region the secondary tiers copy rows from and to.

    A key's rows are its units, so a secondary tier must know each group's units
    (``group_units`` in its config; :mod:`spillway_engine.offloader.disk_tier` does)."""

    class SpillwayPrimaryTier(make_manager_class()):
        def __init__(self, layout: HostLayout, region: Any, **kwargs: Any):
            super().__init__(layout, **kwargs)
            self._region = region
            self._kv_memoryview = region.create_kv_memoryview()
            # read/write: a secondary tier reading from or writing to this pool
            self.complete_read = self.complete_load
            self.prepare_write = self.prepare_store
            self.complete_write = self.complete_store

        def prepare_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
            # a cascade to disk is not a request's access: the LRU order stays
            return self._prepare_load(keys, req_context, record_access=False)

        def get_kv_memoryview(self) -> memoryview:
            return self._kv_memoryview

        def shutdown(self) -> None:
            super().shutdown()
            self._kv_memoryview.release()
            self._region.cleanup()

    return SpillwayPrimaryTier
