"""The scheduler-side host pool: vLLM's CPU manager with byte-exact, multi-unit slots.

vLLM's ``CPUOffloadingManager`` keeps the LRU, reference counts, events and request
accounting; Spillway only changes what a slot is. Upstream, every (chunk, group) key
takes one row sized for the largest group. Here a key of group ``g`` takes
``units_g`` units of the shared pool (:mod:`spillway_engine.offloader.layout`), so a
small group's chunk costs only its own bytes and all groups share one LRU.

The manager's ``chunk_id`` is a handle; ``self._units[handle]`` lists its units, and
the load/store spec it hands the worker is those units, key after key.

It also counts what vLLM does not export about the pool (fill, evictions, evicted
keys asked for again), for Spillway's ``spillway_host_pool_*`` metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np

from spillway_engine.offloader.layout import HostLayout

#: Spillway's pool series, carried in vLLM's offloading stats payload (names as exported).
POOL_USED_CHUNKS = "spillway_host_pool_used_chunks"
POOL_TOKENS = "spillway_host_pool_tokens"
POOL_EVICTIONS = "spillway_host_pool_evictions"
POOL_THRASH = "spillway_host_pool_thrash"
LOOKUP_TOKENS = "spillway_host_lookup_tokens"
HIT_TOKENS = "spillway_host_hit_tokens"
SPILLWAY_STATS = (
    POOL_USED_CHUNKS,
    POOL_TOKENS,
    POOL_EVICTIONS,
    POOL_THRASH,
    LOOKUP_TOKENS,
    HIT_TOKENS,
)

#: Evicted keys remembered for the thrash counter (a later lookup of one is thrash).
EVICTED_MEMORY = 65_536


def make_manager_class() -> type:
    """Build the class lazily: importing vLLM must stay out of the planner's path."""
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadingEvent,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
        get_offload_group_idx,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    class SpillwayHostManager(CPUOffloadingManager):
        def __init__(self, layout: HostLayout, **kwargs: Any):
            self.layout = layout
            self._group_units = {g.group_id: g.units for g in layout.groups}
            self._group_chunk_bytes = {g.group_id: g.chunk_bytes for g in layout.groups}
            min_units = min(self._group_units.values())
            # The policy and vLLM's bookkeeping count keys; at most this many fit.
            super().__init__(num_chunks=layout.num_units // min_units, **kwargs)
            self._min_units = min_units
            self._free_units: list[int] = list(range(layout.num_units - 1, -1, -1))
            self._units: dict[int, np.ndarray] = {}
            self._handle_group: dict[int, int] = {}
            self._free_handles: list[int] = []
            self._next_handle = 0
            # pool statistics (cumulative counters, current gauges)
            self.used_units = 0
            self.stored_bytes = 0
            self.keys_per_group = dict.fromkeys(self._group_units, 0)
            #: the group whose chunks stand for "chunks of prefix" in the metrics
            self.anchor_group = layout.anchor_group
            self.evicted_keys = 0
            self.thrash_chunks = 0
            self._reported = (0, 0)
            self._recently_evicted: OrderedDict[OffloadKey, None] = OrderedDict()

        # ---------------------------------------------------------------- slots

        def units_of(self, key: OffloadKey) -> int:
            return self._group_units[get_offload_group_idx(key)]

        def _get_num_free_chunks(self) -> int:
            # A lower bound vLLM's prepare_store compares with the keys it must place;
            # prepare_store below has already freed units for all of them.
            return len(self._free_units) // self._min_units

        def _allocate_chunks(self, keys: list[OffloadKey]) -> list[ChunkStatus]:
            need = sum(self.units_of(k) for k in keys)
            assert need <= len(self._free_units), "units were not reserved before allocation"
            chunks = []
            for key in keys:
                k = self.units_of(key)
                units = np.array(self._free_units[-k:][::-1], dtype=np.int64)
                del self._free_units[-k:]
                handle = self._free_handles.pop() if self._free_handles else self._new_handle()
                group = get_offload_group_idx(key)
                self._units[handle] = units
                self._handle_group[handle] = group
                self.used_units += k
                self.stored_bytes += self._group_chunk_bytes[group]
                self.keys_per_group[group] += 1
                chunks.append(ChunkStatus(handle))
            return chunks

        def _new_handle(self) -> int:
            self._next_handle += 1
            return self._next_handle - 1

        def _free_chunk(self, chunk: ChunkStatus) -> None:
            units = self._units.pop(chunk.chunk_id)
            group = self._handle_group.pop(chunk.chunk_id)
            self._free_handles.append(chunk.chunk_id)
            self._free_units.extend(units[::-1].tolist())
            self.used_units -= len(units)
            self.stored_bytes -= self._group_chunk_bytes[group]
            self.keys_per_group[group] -= 1

        def _get_load_store_spec(
            self, keys: Iterable[OffloadKey], chunks: Iterable[ChunkStatus]
        ) -> CPULoadStoreSpec:
            parts = [self._units[c.chunk_id] for c in chunks]
            ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            return CPULoadStoreSpec(ids.tolist())

        # ------------------------------------------------------------- eviction

        def _make_room(self, keys: list[OffloadKey]) -> bool:
            """Evict LRU keys until the keys not yet stored fit; False if they cannot."""
            missing = [k for k in keys if self._policy.get(k) is None]
            short = sum(self.units_of(k) for k in missing) - len(self._free_units)
            if short <= 0:
                return True
            protected = set(keys)
            evicted_keys = []
            while short > 0:
                evicted = self._policy.evict(1, protected)
                if not evicted:
                    break
                for key, chunk in evicted:
                    self._num_evictable_cache_chunks -= 1
                    short -= len(self._units[chunk.chunk_id])
                    self._free_chunk(chunk)
                    evicted_keys.append(key)
                    if get_offload_group_idx(key) == self.anchor_group:
                        self._remember_evicted(key)
                self.evicted_keys += len(evicted)
            if evicted_keys and self.events is not None:
                self.events.append(
                    OffloadingEvent(keys=evicted_keys, medium=self.medium, removed=True)
                )
            return short <= 0

        def _remember_evicted(self, key: OffloadKey) -> None:
            self._recently_evicted[key] = None
            self._recently_evicted.move_to_end(key)
            if len(self._recently_evicted) > EVICTED_MEMORY:
                self._recently_evicted.popitem(last=False)

        def prepare_store(
            self, keys: Collection[OffloadKey], req_context: ReqContext
        ) -> PrepareStoreOutput | None:
            keys = list(keys)
            if not self._make_room(keys):
                return None
            return super().prepare_store(keys, req_context)

        def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
            result = super().lookup(key, req_context)
            if result is not LookupResult.HIT and key in self._recently_evicted:
                del self._recently_evicted[key]
                self.thrash_chunks += 1
            return result

        def reset_cache(self) -> None:
            super().reset_cache()
            self._free_units = list(range(self.layout.num_units - 1, -1, -1))
            self._units.clear()
            self._handle_group.clear()
            self.keys_per_group = dict.fromkeys(self._group_units, 0)
            self._free_handles.clear()
            self._next_handle = 0
            self.used_units = 0
            self.stored_bytes = 0

        # ---------------------------------------------------------------- stats

        def get_stats(self) -> Any:
            stats = super().get_stats()
            # vLLM derives "pinned by transfers" from its own chunk counters, which this
            # pool does not use: restate it from the keys held here.
            pinned = len(self._units) - self._num_evictable_cache_chunks
            usage = pinned / self._num_chunks if self._num_chunks else 0.0
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
            read = max(usage - self._num_write_pending_chunks / max(self._num_chunks, 1), 0.0)
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read)
            sets = sum(self._group_units.values())
            stats.set_gauge(POOL_USED_CHUNKS, self.used_units // sets)
            stats.set_gauge(
                POOL_TOKENS, self.keys_per_group[self.anchor_group] * self.layout.chunk_tokens
            )
            evicted, thrash = self._reported
            stats.increase_counter(POOL_EVICTIONS, self.evicted_keys - evicted)
            stats.increase_counter(POOL_THRASH, self.thrash_chunks - thrash)
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

    return SpillwayHostManager
