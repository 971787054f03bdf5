"""The host pool: the pool each engine gets (as asked, or the largest its pod's memory
limit allows), both offloaders' geometry on it, the figures of the one the engine runs,
and the pod's memory around it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from spillway_engine.planner.kv_layout import KVLayout
from spillway_engine.planner.offload_geometry import (
    OffloadRefused,
    OffloadRequest,
    SpillwayGeometry,
    UpstreamGeometry,
    pool_figures,
    spillway_connector_refusal,
    spillway_geometry,
    upstream_geometry,
)
from spillway_engine.planner.plan_schema import PlanRefused, PlanRequest
from spillway_engine.planner.pod_sizing import PodMemory, max_pool_bytes, size_pod
from spillway_engine.vllm_pins import (
    SPILLWAY_CONNECTOR,
    SPILLWAY_CONNECTOR_MODULE,
    UPSTREAM_CONNECTOR,
)


def offload_request(
    request: PlanRequest, cpu_bytes: int, workers: int, max_len: int
) -> OffloadRequest:
    return OffloadRequest(
        cpu_bytes=cpu_bytes,
        world_size=workers,
        max_model_len=max_len,
        blocks_per_chunk=request.blocks_per_chunk,
        chunk_block_size_tokens=request.chunk_block_size_tokens,
        pipeline_parallel_size=request.pipeline_parallel_size,
        # vLLM dedups TP-replicated MLA rows only within one node's /dev/shm
        # (build_offloading_config: parallel_config.nnodes_within_dp == 1)
        single_node=_nodes_per_engine(request) == 1,
    )


def _nodes_per_engine(request: PlanRequest) -> int:
    """vLLM's ``nnodes_within_dp``: the nodes one engine's ranks span. With data
    parallelism across nodes each node holds whole engines (``per_node``), so 1:
    ``nnodes // (data_parallel_size // data_parallel_size_local)`` = N // N."""
    return 1 if request.data_parallel_size > 1 else request.nodes


def per_node(request: PlanRequest, workers: int, dp: int) -> tuple[int, int]:
    """(GPU workers of each engine on one node, engines on one node) when the replica
    spans ``request.nodes`` nodes (vLLM's --nnodes). Data-parallel size 1: the engine's
    tensor x pipeline ranks split evenly. Above 1 (DP attention, e.g. DP x EP MoE): each
    node holds DP / nodes whole engines (vLLM's --data-parallel-size-local), each
    engine's ranks on one node, as vLLM runs them (``nnodes_within_dp`` 1)."""
    nodes = request.nodes
    if nodes == 1:
        return workers, dp
    if dp > 1:
        if dp % nodes:
            raise PlanRefused(
                f"data parallel size {dp} does not split over {nodes} nodes: each node "
                "holds whole data-parallel engines (data_parallel_size / nodes), so the "
                "data-parallel size must be a multiple of the nodes"
            )
        return workers, dp // nodes
    if workers % nodes:
        raise PlanRefused(f"{nodes} nodes do not divide the engine's {workers} workers "
                          "(tensor x pipeline parallel) evenly")
    return workers // nodes, 1


def pool_bytes(request: PlanRequest, workers: int, dp: int) -> int:
    """The host pool per engine: as asked, or the largest the memory limit allows
    (``workers`` and ``dp``: each engine's workers and the engines of one pod)."""
    cpu_bytes = request.cpu_memory_bytes
    if cpu_bytes is not None and request.host_memory_scope == "pod":
        cpu_bytes //= dp  # the pod's budget, one share per engine
    if cpu_bytes is None:
        if request.memory_limit_bytes is None:
            raise PlanRefused("give a CPU pool size (--cpu-memory) or a memory limit")
        cpu_bytes = max_pool_bytes(request.memory_limit_bytes, workers, dp)
    if cpu_bytes <= 0:
        raise PlanRefused("the CPU pool size must be positive")
    return cpu_bytes


def geometries(
    layout: KVLayout, request: PlanRequest, cpu_bytes: int, workers: int, max_len: int
) -> tuple[UpstreamGeometry | None, str | None, SpillwayGeometry]:
    """Both offloaders' geometry for the pool. vLLM's may refuse the model; that only
    stops the plan when vLLM's offloader is the one asked for."""
    offload = offload_request(request, cpu_bytes, workers, max_len)
    upstream: UpstreamGeometry | None = None
    refusal = None
    try:
        upstream = upstream_geometry(layout, offload)
    except OffloadRefused as e:
        if request.offloader == "upstream":
            raise
        refusal = str(e)
    if request.offloader == "spillway" and (why := spillway_connector_refusal(layout)):
        raise OffloadRefused(why)
    return upstream, refusal, spillway_geometry(layout, offload)


@dataclass(frozen=True)
class ChosenOffload:
    """The figures of the offloader the engine will run (the plan's top level)."""

    blocks_per_chunk: int
    row_bytes: int
    num_chunks: int
    capacity_tokens: int
    region_bytes: int
    #: most keys the host manager can hold (one per row or unit)
    host_keys: int
    extra_config: dict[str, Any]
    transfer_config: dict[str, Any]


def chosen_offload(
    offloader: str, upstream: UpstreamGeometry | None, spillway: SpillwayGeometry
) -> ChosenOffload:
    if offloader == "upstream":
        assert upstream is not None  # geometries raised otherwise
        extra = dict(upstream.kv_connector_extra_config)
        transfer: dict[str, Any] = {"kv_connector": UPSTREAM_CONNECTOR}
        figures = (
            upstream.blocks_per_chunk,
            upstream.row_bytes,
            upstream.num_chunks,
            upstream.capacity_tokens,
            upstream.region_bytes,
            upstream.num_chunks,
        )
    else:
        extra = dict(spillway.kv_connector_extra_config)
        transfer = {
            "kv_connector": SPILLWAY_CONNECTOR,
            "kv_connector_module_path": SPILLWAY_CONNECTOR_MODULE,
        }
        figures = (
            max(g.blocks_per_chunk for g in spillway.groups),
            spillway.chunk_set_bytes,
            spillway.num_chunks,
            spillway.capacity_tokens,
            spillway.region_bytes,
            spillway.num_units,
        )
    transfer.update(kv_role="kv_both", kv_connector_extra_config=extra)
    return ChosenOffload(*figures, extra_config=extra, transfer_config=transfer)


def sized_pod(
    region: int, workers: int, dp: int, memory_limit: int | None, host_keys: int = 0
) -> PodMemory:
    pod = size_pod(region, workers, dp, host_keys)
    if memory_limit is not None and pod.memory_limit_bytes > memory_limit:
        raise PlanRefused(
            f"the pod needs a memory limit of {pod.memory_limit_bytes} bytes (pool "
            f"{region} + processes {pod.process_overhead_bytes} + headroom), above the "
            f"given limit of {memory_limit}"
        )
    return pod


@dataclass(frozen=True)
class PoolFit:
    """The pool per engine and both offloaders' geometry on it."""

    cpu_bytes: int
    upstream: UpstreamGeometry | None
    #: why vLLM's offloader cannot run the model (when Spillway's is the one asked for)
    upstream_refusal: str | None
    spillway: SpillwayGeometry
    chosen: ChosenOffload


def fit_pool(
    layout: KVLayout, request: PlanRequest, workers: int, local: int, engines: int, max_len: int
) -> PoolFit:
    """The pool per engine, shrunk (without --cpu-memory) until the pod fits its limit
    (``local`` and ``engines``: each engine's workers on one pod and the pod's engines)."""
    cpu_bytes = pool_bytes(request, local, engines)
    upstream, upstream_refusal, spillway = geometries(
        layout, request, cpu_bytes, workers, max_len
    )
    chosen = chosen_offload(request.offloader, upstream, spillway)
    limit = request.memory_limit_bytes
    for _ in range(4 if request.cpu_memory_bytes is None else 0):
        # the pool filled the limit before its units (and the manager's bytes per
        # key) were known: give those bytes back from the pool (a row may round)
        needed = size_pod(chosen.region_bytes, local, engines, chosen.host_keys).memory_limit_bytes
        if limit is None or needed <= limit:
            break
        # from the region, not the budget: a budget short of a whole row above it
        # would give back bytes the region never held and change nothing
        cpu_bytes = min(cpu_bytes, chosen.region_bytes) - -(-(needed - limit) // engines)
        upstream, upstream_refusal, spillway = geometries(
            layout, request, cpu_bytes, workers, max_len
        )
        chosen = chosen_offload(request.offloader, upstream, spillway)
    return PoolFit(cpu_bytes, upstream, upstream_refusal, spillway, chosen)


@dataclass(frozen=True)
class SharedStagePool:
    """Spillway's pool as every pipeline stage can hold it: vLLM's scheduler (and so
    Spillway's manager) sees stage 0's KV-cache config only, yet a unit id it hands out
    is written on every stage, each at its own unit size."""

    #: each stage's geometry with the shared units per group and unit count
    stages: tuple[SpillwayGeometry, ...]
    #: the stage that alone holds the fewest chunks: it bounds the pool
    bounding_stage: int
    #: each stage's own chunk count before sharing (what it alone would hold)
    own_chunks: tuple[int, ...]


def shared_stage_pool(
    stages: list[SpillwayGeometry], max_model_len: int
) -> SharedStagePool | None:
    """The pool every stage holds, or None where the stages already agree (even splits).

    A chunk of group g takes the most units any stage needs for it (a stage needing
    fewer leaves the rest unwritten), and the manager hands out only the units the
    smallest stage's region has: never a unit id outside a stage's region."""
    if len({(s.num_units, tuple(g.units for g in s.groups)) for s in stages}) <= 1:
        return None
    first = stages[0]
    for s in stages:
        # the span, copies and groups are the whole model's: the same on every stage
        assert (s.chunk_tokens, s.copies, len(s.groups)) == (
            first.chunk_tokens, first.copies, len(first.groups)
        )
    units = [max(s.groups[i].units for s in stages) for i in range(len(first.groups))]
    num_units = min(s.num_units for s in stages)
    own = tuple(s.num_chunks for s in stages)
    shared = tuple(_with_units(s, units, num_units, max_model_len) for s in stages)
    return SharedStagePool(shared, own.index(min(own)), own)


def _with_units(
    geometry: SpillwayGeometry, units: list[int], num_units: int, max_model_len: int
) -> SpillwayGeometry:
    unit, copies, span = geometry.unit_bytes, geometry.copies, geometry.chunk_tokens
    groups = tuple(
        replace(g, units=k, row_bytes=k * unit * copies)
        for g, k in zip(geometry.groups, units, strict=True)
    )
    return replace(
        geometry,
        **pool_figures(groups, num_units, num_units // sum(units), unit, copies, span,
                       max_model_len),
        kv_connector_extra_config={
            **geometry.kv_connector_extra_config,
            # every stage's connector takes these over its own (offloader/geometry.py)
            "spillway_group_units": units,
            "spillway_num_units": num_units,
        },
    )
