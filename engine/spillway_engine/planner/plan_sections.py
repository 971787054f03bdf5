"""The plan's sections as the nested dicts :class:`~.plan_schema.Plan` validates in one
go: the GPU, model, parallelism and pod, the KV groups, both offloaders' chunk geometry,
the pipeline stages' pools and the disk tier.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from spillway_engine.planner.host_pool import offload_request, shared_stage_pool
from spillway_engine.planner.kv_layout import KVLayout
from spillway_engine.planner.layout_types import Stage
from spillway_engine.planner.offload_geometry import (
    OffloadRefused,
    SpillwayGeometry,
    UpstreamGeometry,
    disk_geometry,
    spillway_connector_refusal,
    spillway_geometry,
    upstream_geometry,
)
from spillway_engine.planner.plan_schema import PlanRequest
from spillway_engine.planner.pod_sizing import PodMemory
from spillway_engine.vllm_pins import VLLM_VERSION


def model_info(request: PlanRequest, layout: KVLayout) -> dict[str, Any]:
    return dict(
        name=request.model_name,
        architecture=layout.shape.architecture,
        model_type=layout.shape.model_type,
        dtype=layout.shape.dtype,
        num_cache_layers=len(layout.shape.layers),
    )


def parallelism_info(request: PlanRequest, workers: int, dp: int) -> dict[str, Any]:
    return dict(
        tensor_parallel_size=request.tensor_parallel_size,
        pipeline_parallel_size=request.pipeline_parallel_size,
        data_parallel_size=dp,
        world_size=workers,
        pipeline_layer_partition=request.pipeline_layer_partition,
        nodes=request.nodes,
    )


def pod_info(request: PlanRequest, pod: PodMemory, engines: int) -> dict[str, Any]:
    return dict(
        shm_bytes=pod.shm_bytes,
        memory_request_bytes=pod.memory_request_bytes,
        memory_limit_bytes=pod.memory_limit_bytes,
        pool_bytes_per_engine=pod.pool_bytes_per_engine,
        engines=engines,
        pool_bytes_per_pod=engines * pod.pool_bytes_per_engine,
        host_memory_scope=request.host_memory_scope,
        process_overhead_bytes=pod.process_overhead_bytes,
        headroom_bytes=pod.headroom_bytes,
    )


def gpu_info(layout: KVLayout) -> dict[str, Any]:
    gpu = layout.gpu
    return dict(
        name=gpu.name,
        product=gpu.product,
        generation=gpu.generation,
        compute_capability=f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}",
        attention_backend=layout.attention_backend,
        gdn_prefill_kernel=layout.gdn_prefill_kernel or gpu.gdn_prefill_kernel(),
    )


def kv_groups(layout: KVLayout) -> list[dict[str, Any]]:
    return [
        dict(
            kind=g.kind,
            num_layers=g.num_layers,
            layer_indices=list(g.layer_indices),
            tokens_per_block=g.tokens_per_block,
            page_bytes=g.page_bytes,
            bytes_per_block=g.bytes_per_block,
            sliding_window=g.sliding_window,
            attention_chunk_size=g.attention_chunk_size,
            padded_layers=g.padded_layers,
            layer_page_bytes=list(g.layer_page_bytes),
            prefix_cacheable=g.prefix_cacheable,
            backend=_group_backend(layout, g.kind),
        )
        for g in layout.groups
    ]


def _group_backend(layout: KVLayout, kind: str) -> str | None:
    """The backend a group's layers run on: the model's attention backend, or for state
    layers their family's kernels (GDN's prefill kernel, which sets the block grid, named)."""
    if kind != "mamba":
        return layout.attention_backend
    family = layout.shape.mamba.family if layout.shape.mamba is not None else "mamba"
    if layout.gdn_prefill_kernel is not None:
        return f"{family} ({layout.gdn_prefill_kernel} prefill)"
    return family


def upstream_info(upstream: UpstreamGeometry) -> dict[str, Any]:
    return dict(
        blocks_per_chunk=upstream.blocks_per_chunk,
        copies=upstream.copies,
        replicated_layout=upstream.replicated_layout,
        row_bytes=upstream.row_bytes,
        num_chunks=upstream.num_chunks,
        region_bytes=upstream.region_bytes,
        capacity_tokens=upstream.capacity_tokens,
        gauge_tokens=upstream.gauge_tokens,
        groups=_chunks(upstream),
        kv_connector_extra_config=dict(upstream.kv_connector_extra_config),
    )


def spillway_info(spillway: SpillwayGeometry) -> dict[str, Any]:
    return dict(
        chunk_tokens=spillway.chunk_tokens,
        copies=spillway.copies,
        unit_bytes=spillway.unit_bytes,
        num_units=spillway.num_units,
        groups=_chunks(spillway),
        row_layout=(
            "one pool of num_units units (rows of unit_bytes x copies); a chunk of group "
            "g takes units(g) of them, anywhere, so all groups share one LRU"
        ),
        chunk_set_bytes=spillway.chunk_set_bytes,
        num_chunks=spillway.num_chunks,
        region_bytes=spillway.region_bytes,
        capacity_tokens=spillway.capacity_tokens,
        gauge_tokens=spillway.gauge_tokens,
        kv_connector_extra_config=dict(spillway.kv_connector_extra_config),
    )


def _chunks(geometry: UpstreamGeometry | SpillwayGeometry) -> list[dict[str, Any]]:
    return [
        dict(
            group_index=g.group_index,
            tokens_per_block=g.tokens_per_block,
            blocks_per_chunk=g.blocks_per_chunk,
            tokens_per_chunk=g.tokens_per_chunk,
            chunk_bytes=g.chunk_bytes,
            row_bytes=g.row_bytes,
            window_chunks=g.window_chunks,
            units=g.units,
        )
        for g in geometry.groups
    ]


def draft_layers(layout: KVLayout) -> list[int]:
    """Indices of the drafter's cache layers: appended after the model's own."""
    total = len(layout.shape.layers)
    return list(range(total - layout.draft_layers, total))


#: vLLM's default prefix hash: cryptographic, so its NONE_HASH seed is a fixed default
#: (kv_cache_utils.resolve_none_hash_seed) and every process hashes a prefix alike.
DISK_HASH_ALGO = "sha256"


def disk_tier(
    request: PlanRequest,
    layout: KVLayout,
    spillway: SpillwayGeometry,
    workers: int,
    dp: int,
    max_len: int,
) -> dict[str, Any] | None:
    if request.disk_bytes is None:
        return None
    if request.offloader != "spillway":
        raise OffloadRefused("the disk tier runs under Spillway's offloader only")
    share = request.disk_bytes // (dp * request.disk_writers)
    try:
        disk = disk_geometry(spillway, share)
    except OffloadRefused as e:
        how = f" ({request.disk_bytes} bytes for {dp} engine(s) x {request.disk_writers} " \
            "writer(s))" if dp * request.disk_writers > 1 else ""
        raise OffloadRefused(f"offload.disk.size (--disk){how}: {e}") from None
    # Everything a chunk file's bytes depend on: another model, dtype, layout, chunk
    # span, rank count or vLLM release writes other bytes under the same prefix hash.
    key = json.dumps(dict(
        vllm=VLLM_VERSION,
        model=request.model_name,
        architecture=layout.shape.architecture,
        kv_cache_dtype=layout.kv_cache_dtype,
        max_model_len=max_len,
        block_size=layout.block_size,
        tokens_per_hash=layout.tokens_per_hash,
        groups=kv_groups(layout),
        chunk_tokens=spillway.chunk_tokens,
        blocks_per_chunk=[g.blocks_per_chunk for g in spillway.groups],
        workers=workers,
        copies=spillway.copies,
        hash_algo=DISK_HASH_ALGO,
    ), sort_keys=True)
    return dict(
        volume_bytes=request.disk_bytes,
        writers=request.disk_writers,
        volume_bytes_per_engine=share,
        budget_bytes_per_engine=disk.budget_bytes,
        file_bytes=list(disk.file_bytes),
        chunk_set_bytes=disk.chunk_set_bytes,
        num_chunks=disk.num_chunks,
        capacity_tokens=disk.capacity_tokens,
        cache_key=hashlib.sha256(key.encode()).hexdigest()[:16],
        hash_algo=DISK_HASH_ALGO,
    )


@dataclass(frozen=True)
class StageSections:
    """The plan's ``stages``, their notes, and Spillway's pool as every stage holds it."""

    stages: list[dict[str, Any]]
    notes: list[str]
    #: stage 0's Spillway geometry on the pool every stage holds (the scheduler's view),
    #: or None where the stages agree and the top-level figures stand as computed
    shared_spillway: SpillwayGeometry | None = None
    #: the stage whose pool bounds Spillway's chunks (None: the stages agree)
    bounding_stage: int | None = None


def stage_sections(
    model_layout: KVLayout, request: PlanRequest, cpu_bytes: int, workers: int, max_len: int
) -> StageSections:
    """Each pipeline stage's layers, groups and both offloaders' host pools as the
    stage's workers size them (every worker builds its offloading spec from its own
    KV-cache config and the same cpu_bytes_to_use), and notes on how they differ.

    Spillway's pools are then cut to what every stage holds (``shared_stage_pool``);
    vLLM's offloader, whose manager hands out stage 0's chunks, is refused where
    another stage holds fewer."""
    offload = offload_request(request, cpu_bytes, workers, max_len)
    upstreams: list[UpstreamGeometry | None] = []
    spillways: list[SpillwayGeometry | None] = []
    refusals: list[tuple[str | None, str | None]] = []
    for stage in model_layout.stages:
        layout = stage.layout
        upstream = spillway = None
        upstream_refusal = spillway_refusal = None
        try:
            upstream = upstream_geometry(layout, offload)
        except OffloadRefused as e:
            upstream_refusal = str(e)
        try:
            if request.offloader == "spillway" and (why := spillway_connector_refusal(layout)):
                raise OffloadRefused(why)
            spillway = spillway_geometry(layout, offload)
        except OffloadRefused as e:
            spillway_refusal = str(e)
        refusal = upstream_refusal if request.offloader == "upstream" else spillway_refusal
        if refusal is not None:
            raise OffloadRefused(f"pipeline stage {stage.index}: {refusal}")
        upstreams.append(upstream)
        spillways.append(spillway)
        refusals.append((upstream_refusal, spillway_refusal))
    if request.offloader == "upstream":
        _refuse_short_upstream_stages(request, model_layout, upstreams)
    shared = None
    if all(s is not None for s in spillways):
        shared = shared_stage_pool([s for s in spillways if s is not None], max_len)
        if shared is not None:
            spillways = list(shared.stages)
    out = [
        _stage_section(model_layout, stage, request, upstream, spillway, *why)
        for stage, upstream, spillway, why in zip(
            model_layout.stages, upstreams, spillways, refusals, strict=True
        )
    ]
    notes = _stage_notes(out)
    if shared is None:
        return StageSections(out, notes)
    notes.append(
        f"Spillway's offloader hands out {shared.stages[0].num_chunks} chunks "
        f"({shared.stages[0].num_units} units), what every pipeline stage holds: stage "
        f"{shared.bounding_stage} bounds it (each stage alone would hold "
        f"{list(shared.own_chunks)} chunks; a chunk of each group takes "
        f"{[g.units for g in shared.stages[0].groups]} units on every stage)"
    )
    return StageSections(out, notes, shared.stages[0], shared.bounding_stage)


def _stage_section(
    model_layout: KVLayout,
    stage: Stage,
    request: PlanRequest,
    upstream: UpstreamGeometry | None,
    spillway: SpillwayGeometry | None,
    upstream_refusal: str | None,
    spillway_refusal: str | None,
) -> dict[str, Any]:
    layout = stage.layout
    draft = set(draft_layers(model_layout))
    chosen = upstream if request.offloader == "upstream" else spillway
    assert chosen is not None
    return dict(
        stage=stage.index,
        first_layer=stage.first_layer,
        end_layer=stage.end_layer,
        num_cache_layers=len(stage.cache_layers),
        cache_layer_indices=list(stage.cache_layers),
        draft_layer_indices=[i for i in stage.cache_layers if i in draft],
        workers=request.tensor_parallel_size,
        kv_groups=kv_groups(layout),
        worker_bytes_per_block=layout.worker_bytes_per_block,
        upstream=None if upstream is None else upstream_info(upstream),
        upstream_refusal=upstream_refusal,
        spillway=None if spillway is None else spillway_info(spillway),
        spillway_refusal=spillway_refusal,
        region_bytes=chosen.region_bytes,
    )


def _refuse_short_upstream_stages(
    request: PlanRequest, model_layout: KVLayout, upstreams: list[UpstreamGeometry | None]
) -> None:
    """vLLM 0.33's offloading manager runs on stage 0's KV-cache config and hands out
    its chunk count; a stage whose rows are wider holds fewer, and a chunk id past its
    rows is written outside its region."""
    counts = [u.num_chunks for u in upstreams if u is not None]
    short = [i for i, n in enumerate(counts) if n < counts[0]]
    if not short:
        return
    split = [s.end_layer - s.first_layer for s in model_layout.stages]
    whose = "" if request.pipeline_layer_partition is not None else " (vLLM's own split)"
    raise OffloadRefused(
        f"pipeline_layer_partition (--pp-layer-partition, VLLM_PP_LAYER_PARTITION) "
        f"{split}{whose} with offloader upstream: vLLM's "
        f"offloading manager hands out stage 0's {counts[0]} chunks, but stage(s) {short} "
        f"hold only {[counts[i] for i in short]} (chunks per stage {counts}), so their "
        "workers would write past their host pool; give a split whose later stages hold "
        "no more KV-cache bytes per block than stage 0, or use offloader spillway (it "
        "hands out what every stage holds)"
    )


def _stage_notes(stages: list[dict[str, Any]]) -> list[str]:
    """Where vLLM's offloader sizes the stages differently: its scheduler-side manager
    counts stage 0's chunks, each stage's workers cut their own rows of the region."""
    rows = [(s["upstream"]["row_bytes"], s["upstream"]["num_chunks"]) for s in stages
            if s["upstream"] is not None]
    if len(set(rows)) <= 1:
        return []
    short = [s["stage"] for s in stages
             if s["upstream"] is not None and s["upstream"]["num_chunks"] < rows[0][1]]
    return [
        "vLLM's offloader sizes each stage's rows from that stage's KV cache: "
        f"(row bytes, chunks) per stage {rows}; its manager hands out stage 0's "
        f"{rows[0][1]} chunks"
        + (f", more than stage(s) {short} hold" if short else "")
        + ", and stages sharing a node share one /dev/shm region with different row "
        "strides (unchecked on GPUs; a split that gives every stage the same bytes per "
        "block avoids this)"
    ]
