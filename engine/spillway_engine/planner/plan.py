"""The plan: KV groups, chunk geometry, host pool and pod memory for one deployment.

``make_plan(config, request)`` is the one entry point the CLI, the operator and the
engine use. It is pure (no I/O, no vLLM import) and raises :class:`PlanRefused` with
the reason vLLM would give, or the piece Spillway does not model.

Assumptions (vLLM 0.33.0 defaults): OffloadingConnector on (layout LBHNC), hybrid KV
cache manager on, speculative decoding only as asked (``speculative_method``; a
separate drafter's config.json is ``make_plan``'s ``draft_config``), no decode/prefill
context parallelism,
``mp`` executor on one node, ``--prefix-cache-retention-interval`` at its default.

Pipeline parallelism (``pipeline_parallel_size`` > 1): vLLM groups the whole model's
layers once, and every stage's workers hold those groups with only the stage's layers.
The plan's top-level figures (``worker_bytes_per_block``, rows, chunks, capacity) are
then stage 0's, the KV-cache config vLLM's scheduler and its offloader's manager take;
``stages`` gives each stage's layers, groups and host pool as its workers compute them.
Where stages differ, Spillway's pool is what every stage holds (``pool_bounding_stage``
names the stage that bounds it), and vLLM's offloader is refused where a stage holds
fewer chunks than stage 0's manager hands out.

The pieces: the request and plan types (``plan_schema.py``), the layout the request
asks for (``request_layout.py``), the host pool and pod (``host_pool.py``), the plan's
sections (``plan_sections.py``) and its JSON reader (``plan_reader.py``); this module
re-exports what callers import.
"""

from __future__ import annotations

from typing import Any

from spillway_engine import __version__
from spillway_engine.planner.gpus import UnknownGpu
from spillway_engine.planner.host_pool import chosen_offload, fit_pool, per_node, sized_pod
from spillway_engine.planner.offload_geometry import OffloadRefused
from spillway_engine.planner.plan_reader import PlanReadError, read_plan
from spillway_engine.planner.plan_schema import (
    DiskTierInfo,
    GpuInfo,
    GroupChunkInfo,
    KVGroupInfo,
    ModelInfo,
    Parallelism,
    Plan,
    PlanRefused,
    PlanRequest,
    PodInfo,
    SpillwayInfo,
    StageInfo,
    UpstreamInfo,
)
from spillway_engine.planner.plan_sections import (
    DISK_HASH_ALGO,
    disk_tier,
    draft_layers,
    gpu_info,
    kv_groups,
    model_info,
    parallelism_info,
    pod_info,
    spillway_info,
    stage_sections,
    upstream_info,
)
from spillway_engine.planner.pod_sizing import PodSizingError
from spillway_engine.planner.request_layout import layout_for
from spillway_engine.planner.shape import ModelConfigError, UnsupportedModel
from spillway_engine.vllm_pins import VLLM_VERSION

__all__ = [
    "DISK_HASH_ALGO",
    "DiskTierInfo",
    "GpuInfo",
    "GroupChunkInfo",
    "KVGroupInfo",
    "ModelInfo",
    "Parallelism",
    "Plan",
    "PlanReadError",
    "PlanRefused",
    "PlanRequest",
    "PodInfo",
    "SpillwayInfo",
    "StageInfo",
    "UpstreamInfo",
    "make_plan",
    "read_plan",
]


def make_plan(
    config: dict[str, Any],
    request: PlanRequest,
    draft_config: dict[str, Any] | None = None,
) -> Plan:
    """The plan for ``config`` (a parsed config.json) and ``request``, or PlanRefused.

    ``draft_config``: the separate drafter's config.json for ``speculative_method``
    draft_model or eagle3 (the ``model`` of vLLM's --speculative-config)."""
    try:
        return _make_plan(config, request, draft_config)
    except (ModelConfigError, UnsupportedModel, UnknownGpu, OffloadRefused, PodSizingError) as e:
        raise PlanRefused(str(e)) from e


def _make_plan(
    config: dict[str, Any], request: PlanRequest, draft_config: dict[str, Any] | None
) -> Plan:
    model_layout, max_len = layout_for(config, request, draft_config)
    # the scheduler's view: stage 0's KV-cache config under pipeline parallelism
    layout = model_layout.stages[0].layout if model_layout.stages else model_layout
    workers = request.tensor_parallel_size * request.pipeline_parallel_size
    dp = request.data_parallel_size
    # The workers of each engine one pod holds and the engines it holds: pod memory and
    # the pool that fits it are per node.
    local, engines = per_node(request, workers, dp)
    if model_layout.stages and request.disk_bytes is not None:
        raise PlanRefused(
            "offload.disk.size (--disk) with pipeline parallelism: the disk tier is not "
            "modelled for pipeline stages"
        )
    pool = fit_pool(layout, request, workers, local, engines, max_len)
    sections = stage_sections(model_layout, request, pool.cpu_bytes, workers, max_len)
    stages = sections.stages
    # Spillway's manager hands out only what every stage holds (uneven stages)
    spillway = sections.shared_spillway or pool.spillway
    chosen = chosen_offload(request.offloader, pool.upstream, spillway)
    # Each stage's workers map their own region: a pod holds a stage's, the largest.
    region = max([chosen.region_bytes, *(s["region_bytes"] for s in stages)])
    pod = sized_pod(region, local, engines, request.memory_limit_bytes, chosen.host_keys)
    disk = disk_tier(request, layout, spillway, workers, engines, max_len)
    # One validation of nested dicts (pydantic's core walks them) instead of a model
    # per group and chunk: a tenth of a millisecond on many-group models.
    return Plan.model_validate(dict(
        vllm_version=VLLM_VERSION,
        spillway_version=__version__,
        gpu=gpu_info(layout),
        model=model_info(request, layout),
        parallelism=parallelism_info(request, workers, dp),
        kv_cache_dtype=layout.kv_cache_dtype,
        max_model_len=max_len,
        block_size=layout.block_size,
        enable_prefix_caching=request.enable_prefix_caching,
        mamba_cache_mode=layout.mamba_cache_mode,
        kv_groups=kv_groups(model_layout),
        tokens_per_hash=layout.tokens_per_hash,
        worker_bytes_per_block=layout.worker_bytes_per_block,
        offloader=request.offloader,
        blocks_per_chunk=chosen.blocks_per_chunk,
        cpu_memory_bytes=pool.cpu_bytes,
        row_bytes=chosen.row_bytes,
        num_chunks=chosen.num_chunks,
        capacity_tokens=chosen.capacity_tokens,
        upstream=None if pool.upstream is None else upstream_info(pool.upstream),
        upstream_refusal=pool.upstream_refusal,
        spillway=spillway_info(spillway),
        kv_connector_extra_config=chosen.extra_config,
        kv_transfer_config=chosen.transfer_config,
        pod=pod_info(request, pod, engines),
        disk=disk,
        notes=list(model_layout.notes) + sections.notes,
        speculative_method=request.speculative_method,
        num_speculative_tokens=request.num_speculative_tokens if request.speculative_method else 0,
        speculative_model=request.speculative_model if request.speculative_method else None,
        draft_layer_indices=draft_layers(model_layout),
        stages=stages,
        pool_bounding_stage=sections.bounding_stage,
    ))
