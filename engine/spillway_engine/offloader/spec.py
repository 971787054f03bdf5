"""Spillway's offloading spec: the unit pool manager and the device-agnostic worker.

vLLM's connector code asks an ``OffloadingSpec`` for the scheduler-side manager, the
worker and the metric definitions. The connector builds this spec itself, with the
geometry it read off vLLM's KV-cache config; vLLM's metrics code resolves the class
by name (``spec_name``/``spec_module_path``) to learn the metric definitions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from spillway_engine.metrics import POOL_METRICS
from spillway_engine.offloader import stand_in
from spillway_engine.offloader.geometry import ConnectorGeometry, contract_runs
from spillway_engine.offloader.host_layout import HostLayout
from spillway_engine.offloader.manager import make_manager_class
from spillway_engine.planner.offload_geometry import unit_pool_gauge_tokens

SPEC_NAME = "SpillwayHostSpec"
SPEC_MODULE = __name__


def pool_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Spillway's live pool series (the catalogue's), exported by vLLM's offloading metrics."""
    kinds = {"gauge": OffloadingGaugeMetadata, "counter": OffloadingCounterMetadata}
    return {m.name: kinds[m.kind](documentation=m.help) for m in POOL_METRICS}


def stand_in_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The counters a stand-in GPU installed (the emulated GPU's page check); none on
    a real GPU."""
    return {m.name: OffloadingCounterMetadata(documentation=m.help) for m in stand_in.counters}


def host_info(config: Any, layout: HostLayout) -> CPUOffloadingInfo:
    """vLLM's ``kv_offload_config_info`` facts for the unit pool."""
    sets = sum(g.units for g in layout.groups)
    max_len = config.model.max_model_len
    return CPUOffloadingInfo(
        cpu_num_chunks=layout.num_units // sets,
        cpu_blocks_per_chunk=max(g.blocks_per_chunk for g in layout.groups),
        cpu_kv_cache_size_bytes=layout.region_bytes,
        cpu_kv_cache_size_tokens=(
            unit_pool_gauge_tokens(
                layout.num_units,
                max_len,
                layout.chunk_tokens,
                ((g.window_chunks, g.units) for g in layout.groups),
            )
            if max_len > 0
            else None
        ),
    )


def _tiered(extra_config: Mapping[str, Any]) -> bool:
    """Secondary tiers under the host pool (vLLM's tiering config key)."""
    return bool(extra_config.get("secondary_tiers"))


class SpillwayHostSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        base = TieringOffloadingSpec if _tiered(extra_config) else CPUOffloadingSpec
        return {
            **base.build_metric_definitions(extra_config),
            **pool_metric_definitions(),
            **stand_in_metric_definitions(),
        }

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        if _tiered(extra_config):
            from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

            return TieringOffloadingSpec.config_info_keys(extra_config)
        return CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: Any, geometry: ConnectorGeometry | None = None):
        super().__init__(config)
        if geometry is None:
            raise ValueError(
                "SpillwayHostSpec is built by SpillwayOffloadingConnector; set "
                "kv_connector to SpillwayOffloadingConnector instead of naming the spec"
            )
        self.geometry = geometry
        self.layout = geometry.layout
        self.replicated_layout = self.layout.copies == 1 and config.parallel.world_size > 1
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def _manager_options(self) -> dict[str, Any]:
        extra = self.extra_config
        return dict(
            cache_policy=extra.get("eviction_policy", "lru"),
            cache_policy_module_path=extra.get("cache_policy_module_path"),
            enable_events=self.kv_events_config.enable_kv_cache_events,
            info=host_info(self.config, self.layout),
        )

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            if _tiered(self.extra_config):
                self._manager = self._tiering_manager()
            else:
                extra = self.extra_config
                self._manager = make_manager_class()(
                    self.layout,
                    store_threshold=int(extra.get("store_threshold", 0)),
                    max_tracker_size=int(extra.get("max_tracker_size", 64_000)),
                    **self._manager_options(),
                )
        return self._manager

    def _tiering_manager(self) -> OffloadingManager:
        """vLLM's ``TieringOffloadingManager`` over the unit pool: the pool stays the
        primary tier (its units, one LRU), and each secondary tier copies a key's
        units whole (so it is told each group's units)."""
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.manager import (
            DEFAULT_TIER_POLL_INTERVAL_S,
            TieringOffloadingManager,
        )

        from spillway_engine.offloader.manager import make_primary_tier_class
        from spillway_engine.offloader.worker import scheduler_host_pool

        region = scheduler_host_pool(self.layout, self.config.engine_id)
        try:
            primary = make_primary_tier_class()(self.layout, region, **self._manager_options())
        except Exception:
            region.cleanup()
            raise
        units = {str(g.group_id): g.units for g in self.layout.groups}
        tiers = []
        try:
            for tier_config in self.extra_config["secondary_tiers"]:
                tiers.append(SecondaryTierFactory.create_secondary_tier(
                    {**tier_config, "group_units": units, "anchor_group": self.layout.anchor_group},
                    primary.get_kv_memoryview(), self))
            return TieringOffloadingManager(
                primary,
                tiers,
                tier_poll_interval_s=float(self.extra_config.get(
                    "tier_poll_interval_s", DEFAULT_TIER_POLL_INTERVAL_S)),
            )
        except Exception:
            for tier in reversed(tiers):
                tier.shutdown()
            primary.shutdown()
            raise

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from spillway_engine.offloader.geometry import packed_layer_pages
            from spillway_engine.offloader.worker import (
                SpillwayHostWorker,
                allocate_host_pool,
                unpack_caches,
            )

            # vLLM hands packed KV blocks (GLM-5 Next) over whole, once per group; the
            # host layout holds each group's own unpadded pages.
            kv_cache_config = self.geometry.kv_cache_config
            groups = [g.group_id for g in self.layout.groups]
            pages = (
                None if kv_cache_config is None else packed_layer_pages(kv_cache_config, groups)
            )
            if pages is not None:
                kv_caches = unpack_caches(kv_caches, pages)
            parallel = self.config.parallel
            pool, cleanup = allocate_host_pool(
                self.layout,
                self.config.engine_id,
                parallel.rank,
                parallel.world_size,
                self.replicated_layout,
                scheduler_maps=_tiered(self.extra_config),
            )
            try:
                worker: OffloadingWorker = SpillwayHostWorker(
                    kv_caches, self.layout, pool, release=cleanup, link_s=stand_in.link_seconds()
                )
            except Exception:
                cleanup()
                raise
            if self.geometry.expansion:
                worker = ContractingWorker(worker, self.layout, self.geometry.expansion)
            self._worker = worker
        return self._worker


def contract_gpu_spec(
    spec: GPULoadStoreSpec, layout: HostLayout, expansion: Mapping[int, int]
) -> GPULoadStoreSpec:
    """The real-block GPU spec behind one the scheduler built over virtual blocks."""
    ids = spec.block_ids.tolist()
    out_ids: list[int] = []
    sizes: list[int] = []
    indices: list[int] = []
    start = 0
    for group, size, first in zip(layout.groups, spec.group_sizes, spec.block_indices, strict=True):
        chunk = ids[start : start + size]
        start += size
        m = expansion.get(group.group_id, 1)
        if m == 1 or size == 0:
            real, real_first = chunk, first // m
        else:
            real, real_first = contract_runs(chunk, first, m)
        out_ids.extend(real)
        sizes.append(len(real))
        indices.append(real_first)
    return GPULoadStoreSpec(out_ids, group_sizes=sizes, block_indices=indices)


class ContractingWorker(OffloadingWorker):
    """Hands the host worker real block ids when the scheduler worked in virtual ones."""

    def __init__(self, inner: OffloadingWorker, layout: HostLayout, expansion: Mapping[int, int]):
        self.inner = inner
        self.layout = layout
        self.expansion = dict(expansion)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        src = contract_gpu_spec(src_spec, self.layout, self.expansion)
        return self.inner.submit_store(job_id, src, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        dst = contract_gpu_spec(dst_spec, self.layout, self.expansion)
        return self.inner.submit_load(job_id, src_spec, dst, expedited)

    def get_finished(self) -> list[TransferResult]:
        return self.inner.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()
