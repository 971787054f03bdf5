"""``SpillwayOffloadingConnector``: vLLM's offloading connector with Spillway's geometry.

It is vLLM's ``OffloadingConnector`` (scheduler, worker wiring, KV events, metrics,
``SupportsHMA``) with three changes, all made from outside vLLM:

* one chunk span ``T`` for every offloaded group, each group cutting ``T / tpb`` of its
  own blocks (:mod:`spillway_engine.offloader.geometry`), so chunk boundaries line up
  across groups and a coarse group cannot zero a finer one's hit;
* a host pool of byte-exact slots shared by all groups (:mod:`.manager`, :mod:`.worker`);
* the pool series vLLM lacks (fill, evictions, thrash, host lookups and hits).

Keys stay vLLM's ``(block hash of the chunk's last token, group)`` so KV events and
everything keyed on them keep working. For a single-group model the geometry, keys
and capacity are upstream's exactly (one unit per chunk = upstream's row).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.logger import init_logger

from spillway_engine.metrics import HOST_HIT_TOKENS, HOST_LOOKUP_TOKENS
from spillway_engine.offloader.geometry import (
    SpillwayConfigError,
    build_geometry,
    expand_blocks,
    with_extra_config,
)
from spillway_engine.offloader.spec import SPEC_MODULE, SPEC_NAME, SpillwayHostSpec

logger = init_logger(__name__)


class SpillwayOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        try:
            geometry = build_geometry(vllm_config, kv_cache_config)
        except SpillwayConfigError as e:
            raise SpillwayConfigError(f"Spillway offloader: {e}") from None
        self.geometry = geometry
        self._expansion = dict(geometry.expansion)
        self._canonical_layout = geometry.offloading_config.canonical_layout
        spec = SpillwayHostSpec(geometry.offloading_config, geometry)
        self.connector_scheduler: OffloadingConnectorScheduler | None = None
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = OffloadingConnectorScheduler(
                spec, vllm_config, geometry.scheduler_kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)
        self._lookup_tokens = 0
        self._hit_tokens = 0
        #: request id -> prompt tokens its latest host lookup covered, until admitted
        self._pending_lookups: dict[str, int] = {}
        layout = geometry.layout
        logger.info(
            "Spillway offloader: %d-token chunks; groups %s cut %s blocks per chunk; "
            "%d units of %d bytes (x%d copies) = %d bytes; virtual blocks %s",
            layout.chunk_tokens,
            [g.group_id for g in layout.groups],
            [g.blocks_per_chunk for g in layout.groups],
            layout.num_units,
            layout.unit_bytes,
            layout.copies,
            layout.region_bytes,
            self._expansion or "none",
        )

    # --------------------------------------------------- scheduler side, block ids

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        # Admission: count the last lookup once (a request that waited for blocks was
        # looked up again every step), with the hit the scheduler actually took.
        looked_up = self._pending_lookups.pop(request.request_id, None)
        if looked_up is not None:
            self._lookup_tokens += looked_up
            self._hit_tokens += num_external_tokens
        if self._expansion:
            blocks = dataclasses.replace(
                blocks, blocks=expand_blocks(blocks.blocks, self._expansion)
            )
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if not self._expansion:
            return super().build_connector_meta(scheduler_output)
        meta = super().build_connector_meta(self._expanded_output(scheduler_output))
        # A real block appears once per virtual block in a store's fences; the
        # scheduler releases a fence once per id, so keep each id once.
        jobs = self.scheduler._jobs
        for job_id in meta.store_jobs:
            status = jobs.get(job_id)
            if status is None:
                continue
            for name in ("fenced_block_ids", "deferred_fence_block_ids"):
                ids = getattr(status, name)
                if ids:
                    setattr(status, name, list(dict.fromkeys(ids)))
        return meta

    def _expanded_output(self, out: Any) -> Any:
        new_reqs = [
            dataclasses.replace(r, block_ids=expand_blocks(r.block_ids, self._expansion))
            for r in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        cached = dataclasses.replace(
            cached,
            new_block_ids=[expand_blocks(ids, self._expansion) for ids in cached.new_block_ids],
        )
        return dataclasses.replace(out, scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached)

    # ------------------------------------------------------------------- metrics

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if result[0] is not None:  # None: the lookup is still in flight, asked again later
            self._pending_lookups[request.request_id] = max(
                request.num_prompt_tokens - num_computed_tokens, 0
            )
        return result

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._pending_lookups.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        self._pending_lookups.pop(request.request_id, None)
        return super().request_finished_all_groups(request, block_ids)

    def get_kv_connector_stats(self) -> Any:
        stats = super().get_kv_connector_stats()
        if stats is not None:
            stats.increase_counter(HOST_LOOKUP_TOKENS.name, self._lookup_tokens)
            stats.increase_counter(HOST_HIT_TOKENS.name, self._hit_tokens)
            self._lookup_tokens = self._hit_tokens = 0
        return stats

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        # vLLM's metrics code finds the spec (and so our metric names) by name.
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config)
        extra.update(spec_name=SPEC_NAME, spec_module_path=SPEC_MODULE)
        return super().build_prom_metrics(
            with_extra_config(vllm_config, extra), metric_types, labelnames, per_engine_labelvalues
        )
