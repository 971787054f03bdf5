"""Pipeline parallelism in the KV cache: the decoder layers each stage holds
(``get_pp_indices``, ``VLLM_PP_LAYER_PARTITION``) and the groups each stage's workers
keep (``_project_kv_cache_groups_to_worker``). The last step of
``kv_layout.compute_layout``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from spillway_engine.arith import round_up
from spillway_engine.planner.gpus import gdn_checkpoint_alignment
from spillway_engine.planner.layout_types import (
    CacheSpec,
    KVGroup,
    KVLayout,
    LayoutRequest,
    Stage,
)
from spillway_engine.planner.shape import UnsupportedModel


def parse_pp_layer_partition(text: str) -> tuple[int, ...]:
    """``VLLM_PP_LAYER_PARTITION`` as vLLM reads it: comma-separated integers."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UnsupportedModel(
            f"pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) {text!r} is not a "
            f"comma-separated list of integers; vLLM refuses it (Invalid partition string: "
            f"{text})"
        ) from None


def pp_partition(
    num_hidden_layers: int, pp_size: int, partition: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Decoder layers per stage as vLLM 0.33.0's ``get_pp_indices`` splits them.

    With ``partition`` (``VLLM_PP_LAYER_PARTITION``) it must have one entry per stage
    summing to the layer count. Without, an even split whose remainder goes one layer
    each to the stages before the last, from the second-to-last backwards."""
    if pp_size < 1:
        raise ValueError("pipeline_parallel_size must be at least 1")
    if partition is not None:
        partitions = list(partition)
        if len(partitions) != pp_size:
            raise UnsupportedModel(
                f"pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) has {len(partitions)} "
                f"entries for pipeline_parallel_size {pp_size}; vLLM refuses it "
                f"(len(partitions)={len(partitions)} does not match pp_size={pp_size}.)"
            )
        if sum(partitions) != num_hidden_layers:
            raise UnsupportedModel(
                f"pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) {partitions} sums to "
                f"{sum(partitions)}, not the model's {num_hidden_layers} decoder layers "
                f"(num_hidden_layers); vLLM refuses it (sum(partitions)={sum(partitions)} "
                f"does not match num_hidden_layers={num_hidden_layers}.)"
            )
        return tuple(partitions)
    partitions = [num_hidden_layers // pp_size] * pp_size
    for i in range(2, num_hidden_layers % pp_size + 2):
        partitions[-i] += 1
    return tuple(partitions)


def pp_indices(
    num_hidden_layers: int,
    pp_rank: int,
    pp_size: int,
    partition: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """``get_pp_indices``: stage ``pp_rank``'s decoder layers ``[start, end)``."""
    partitions = pp_partition(num_hidden_layers, pp_size, partition)
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def with_stages(
    layout: KVLayout, own_layers: int, specs: list[CacheSpec], request: LayoutRequest
) -> KVLayout:
    """The layout with its pipeline stages (none without pipeline parallelism).

    vLLM groups the whole model's layers once (``get_global_kv_cache_groups`` over
    every worker's specs merged: the same groups as without PP), then each worker keeps
    every group with only its own layers (``_project_kv_cache_groups_to_worker``; a
    group may keep none) and sizes its backing allocation from them: a block costs the
    stage's largest group. The hash unit and block sizes are the model's. Decoder
    layers split as ``get_pp_indices`` says; the drafter sits on the last stage.
    """
    pp = request.pipeline_parallel_size
    if pp == 1:
        return layout
    partitions, bounds, members = _stage_members(layout, own_layers, request)
    _check_stage_kinds(layout, own_layers, bounds, members)
    stages = [_stage(layout, s, bounds[s], members[s], specs, own_layers) for s in range(pp)]
    notes = list(layout.notes)
    hidden = layout.shape.num_hidden_layers or own_layers
    if request.pp_layer_partition is None and hidden % pp:
        notes.append(
            f"{hidden} decoder layers split unevenly over {pp} stages: {list(partitions)} "
            "(vLLM's get_pp_indices; VLLM_PP_LAYER_PARTITION overrides it)"
        )
    sizes = {st.layout.worker_bytes_per_block for st in stages}
    if len(sizes) > 1:
        notes.append(
            f"the stages' workers hold {sorted(sizes)} bytes per block: vLLM's scheduler "
            "and its CPU offloader's manager take stage 0's KV-cache config, each stage's "
            "workers their own"
        )
    return replace(layout, stages=tuple(stages), notes=tuple(notes))


def _stage_members(
    layout: KVLayout, own_layers: int, request: LayoutRequest
) -> tuple[tuple[int, ...], list[tuple[int, int]], list[list[int]]]:
    """(decoder layers per stage, each stage's [first, end) decoder layers, each stage's
    cache layers); refuses a split that leaves a stage without a cache layer."""
    pp = request.pipeline_parallel_size
    shape = layout.shape
    hidden = shape.num_hidden_layers or own_layers
    positions = shape.layer_positions or tuple(range(own_layers))
    assert len(positions) == own_layers
    partitions = pp_partition(hidden, pp, request.pp_layer_partition)
    if any(p < 0 for p in partitions):
        raise UnsupportedModel(
            f"pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) {list(partitions)} has a "
            "negative entry"
        )
    bounds = []
    start = 0
    for count in partitions:
        bounds.append((start, start + count))
        start += count
    stage_of: list[int] = []
    stage = 0
    for position in positions:  # cache layers come in decoder-layer order
        while position >= bounds[stage][1]:
            stage += 1
        stage_of.append(stage)
    stage_of += [pp - 1] * (len(shape.layers) - own_layers)  # the drafter: last stage
    members: list[list[int]] = [[] for _ in range(pp)]
    for index, s in enumerate(stage_of):
        members[s].append(index)
    empty = [s for s in range(pp) if not members[s]]
    if empty:
        what = (
            f"pipeline_parallel_size {pp} exceeds the model's {hidden} decoder layers"
            if pp > hidden and request.pp_layer_partition is None
            else f"the split {list(partitions)} of the model's {hidden} decoder layers"
        )
        raise UnsupportedModel(
            f"{what}: stage(s) {empty} would hold no KV-cache layer, and vLLM's KV "
            "planning fails for a worker without one (its block is 0 bytes)"
        )
    return partitions, bounds, members


def _check_stage_kinds(
    layout: KVLayout, own_layers: int, bounds: list[tuple[int, int]], members: list[list[int]]
) -> None:
    """Refuses the splits whose stages would pick their own block sizes."""
    shape = layout.shape
    pp = len(members)
    if shape.compressed_sparse_mla:
        kinds = set(shape.layers[:own_layers])
        for s in range(pp):
            if {shape.layers[i] for i in members[s] if i < own_layers} != kinds:
                raise UnsupportedModel(
                    f"pipeline stage {s} (decoder layers {bounds[s][0]}-{bounds[s][1] - 1}) "
                    f"holds only some of {shape.architecture}'s kinds of cache (compress "
                    "ratios): its worker picks its block from its own layers' backends (vLLM "
                    "fails on some such splits), so only splits where every stage holds "
                    "every kind are modelled; give pipeline_layer_partition "
                    "(VLLM_PP_LAYER_PARTITION) such a split"
                )
    if shape.mamba is not None:
        for s in range(pp):
            if all(shape.layers[i].kind == "mamba" for i in members[s]):
                raise UnsupportedModel(
                    f"pipeline stage {s} (decoder layers {bounds[s][0]}-{bounds[s][1] - 1}) "
                    f"holds only {shape.mamba.family} state layers: its worker sets its block "
                    "size without an attention layer (vLLM's update_block_size_for_backend "
                    "finds no attention backend and skips the hybrid alignment), so its "
                    "states do not match the other stages' blocks; give "
                    "pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) a split that puts "
                    "an attention layer on every stage"
                )
            gdn_grid = gdn_checkpoint_alignment(layout.gdn_prefill_kernel)
            if (
                shape.gdn
                and gdn_grid
                and layout.mamba_cache_mode == "align"
                and not any(shape.layers[i].kind == "mamba" for i in members[s])
            ):
                raise UnsupportedModel(
                    f"pipeline stage {s} (decoder layers {bounds[s][0]}-{bounds[s][1] - 1}) "
                    f"holds no {shape.mamba.family} layer: its worker aligns its block "
                    f"without the GDN kernel's {gdn_grid}-token checkpoint grid (vLLM reads it "
                    "from the stage's own layers), so its blocks do not match the other "
                    "stages'; give pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) a "
                    "split that puts a GDN layer on every stage"
                )


def _stage(
    layout: KVLayout,
    s: int,
    bounds: tuple[int, int],
    members: list[int],
    specs: list[CacheSpec],
    own_layers: int,
) -> Stage:
    """Stage ``s``: every group with only its layers, and its own bytes per block."""
    mine = set(members)
    groups = tuple(_project(g, mine) for g in layout.groups)
    widest = max(g.bytes_per_block for g in groups)
    if layout.block_outer:
        stride = math.lcm(*(specs[i].stride_alignment for i in members))
        widest = round_up(widest, stride)
    stage_layout = replace(
        layout,
        groups=groups,
        worker_bytes_per_block=widest,
        draft_layers=sum(1 for i in members if i >= own_layers),
        notes=(),
    )
    return Stage(
        index=s,
        first_layer=bounds[0],
        end_layer=bounds[1],
        cache_layers=tuple(members),
        draft_layers=stage_layout.draft_layers,
        layout=stage_layout,
    )


def _project(group: KVGroup, mine: set[int]) -> KVGroup:
    """``_project_kv_cache_groups_to_worker``: the group with only this worker's layers;
    a group of mixed pages (``UniformTypeKVCacheSpecs``) keeps those layers' pages (all
    of them, as vLLM keeps the spec, when the worker holds none)."""
    kept = tuple(i for i in group.layer_indices if i in mine)
    if len(kept) == group.num_layers:
        return group
    if not group.layer_page_bytes:
        return replace(group, layer_indices=kept, padded_layers=0)
    if not kept:
        return replace(
            group, layer_indices=(), padded_layers=0, layer_page_bytes=(), layer_true_page_bytes=()
        )
    where = [k for k, i in enumerate(group.layer_indices) if i in mine]
    pages = tuple(group.layer_page_bytes[k] for k in where)
    true_pages = (
        tuple(group.layer_true_page_bytes[k] for k in where) if group.layer_true_page_bytes else ()
    )
    return replace(
        group,
        layer_indices=kept,
        page_bytes=sum(pages),
        layer_page_bytes=pages,
        layer_true_page_bytes=true_pages,
        padded_layers=0,
    )
