"""Start-up check: the KV geometry vLLM built equals the geometry the pod was sized for.

Two halves, so the comparison is testable without vLLM:

* :func:`observe` reads vLLM 0.33.0's real objects (``VllmConfig`` and the
  ``KVCacheConfig`` the engine core hands to its workers) into an
  :class:`ObservedGeometry`: the KV-cache groups (kind, layers, tokens per block, page
  bytes per layer, window), the hash unit, the bytes of one block of the backing
  allocation, and -- when vLLM's ``OffloadingConnector`` is configured -- what
  ``build_offloading_config`` and ``CPUOffloadingSpec`` make of it (blocks per chunk,
  row bytes, number of rows). It imports vLLM lazily.
* :func:`compare` is pure: the :class:`~spillway_engine.planner.plan.Plan` against the
  observation, one :class:`Mismatch` per differing field. :func:`format_table` lays
  them out side by side for the log.

Which offload figures are expected depends on the connector vLLM really runs: with
``OffloadingConnector`` they are the plan's ``upstream`` figures (the whole plan for an
``upstream`` plan; for a ``spillway`` plan whose connector was overridden to vLLM's,
see :func:`effective_plan`); with Spillway's connector they are the plan's
``spillway`` figures, observed through the connector's own geometry
(``spillway_engine.offloader.geometry.build_geometry``): chunk span, blocks per chunk
per group, unit size, units per group and number of units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spillway_engine.planner.plan import KVGroupInfo, Plan
from spillway_engine.vllm_pins import SPILLWAY_CONNECTOR, UPSTREAM_CONNECTOR


class PlanMismatch(RuntimeError):
    """vLLM built a KV geometry other than the plan's; the message holds the table."""

    def __init__(self, mismatches: Sequence[Mismatch]) -> None:
        self.mismatches = list(mismatches)
        super().__init__(
            "Spillway plan check failed: vLLM built a KV-cache geometry that differs from "
            f"the plan this pod was sized for ({len(self.mismatches)} field(s)); refusing "
            "to serve. Re-plan for this vLLM/GPU or fix the engine flags.\n"
            + format_table(self.mismatches)
        )


@dataclass(frozen=True)
class ObservedGroup:
    kind: str
    num_layers: int
    tokens_per_block: int
    page_bytes: int
    sliding_window: int | None = None
    #: a group of mixed pages (a draft model's layers): its block, the pages' sum
    block_bytes: int | None = None

    @property
    def bytes_per_block(self) -> int:
        if self.block_bytes is not None:
            return self.block_bytes
        return self.page_bytes * self.num_layers


@dataclass(frozen=True)
class ObservedGeometry:
    """What vLLM really built (None: not observable in this configuration)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_model_len: int
    groups: tuple[ObservedGroup, ...]
    tokens_per_hash: int
    worker_bytes_per_block: int
    kv_connector: str | None = None
    cpu_bytes_to_use: int | None = None
    blocks_per_chunk: int | None = None
    row_bytes: int | None = None
    num_chunks: int | None = None
    #: vLLM's own refusal while building the offloading config, if any
    offload_error: str | None = None
    #: Spillway's connector: chunk span, per-group blocks per chunk and units, pool units
    chunk_tokens: int | None = None
    group_blocks_per_chunk: tuple[int, ...] | None = None
    group_units: tuple[int, ...] | None = None
    unit_bytes: int | None = None
    num_units: int | None = None


@dataclass(frozen=True)
class Mismatch:
    field: str
    plan: Any
    vllm: Any


# --------------------------------------------------------------------------- stages


def stage_of_rank(plan: Plan, rank: int, prefill_context_parallel_size: int = 1) -> int:
    """The pipeline stage of worker ``rank`` (within one data-parallel engine): vLLM
    orders an engine's ranks stage-major, ``rank = stage x TP x PCP + ...``
    (``initialize_model_parallel``)."""
    par = plan.parallelism
    return rank // (par.tensor_parallel_size * max(1, prefill_context_parallel_size))


def stage_plan(plan: Plan, stage: int | None) -> Plan:
    """The plan as one pipeline stage's workers see it: the stage's KV-cache groups,
    bytes per block and host-pool geometry (``plan.stages``). Without stages (no
    pipeline parallelism, or ``stage`` None) the plan itself."""
    if stage is None or not plan.stages:
        return plan
    if not 0 <= stage < len(plan.stages):
        raise ValueError(f"stage {stage} outside the plan's {len(plan.stages)} stages")
    st = plan.stages[stage]
    update: dict[str, Any] = {
        "kv_groups": list(st.kv_groups),
        "worker_bytes_per_block": st.worker_bytes_per_block,
        "upstream": st.upstream,
        "upstream_refusal": st.upstream_refusal,
        "spillway": st.spillway,
    }
    return plan.model_copy(update=update)


# --------------------------------------------------------------------------- compare


def effective_plan(plan: Plan, kv_connector: str | None) -> Plan:
    """The plan's figures for the connector that really runs.

    ``spillway-engine serve`` always runs a ``spillway`` plan with Spillway's
    connector; a ``spillway`` plan served by vLLM's own ``OffloadingConnector``
    anyway (the connector overridden by whoever starts vLLM) runs the plan's
    ``upstream`` geometry: its blocks per chunk, rows, chunks and capacity are then
    the ones to check and to publish as metrics. With any other connector, or without
    upstream figures, the plan itself is returned.
    """
    upstream = plan.upstream
    if kv_connector != UPSTREAM_CONNECTOR or plan.offloader != "spillway" or upstream is None:
        return plan
    return plan.model_copy(
        update={
            "offloader": "upstream",
            "blocks_per_chunk": upstream.blocks_per_chunk,
            "row_bytes": upstream.row_bytes,
            "num_chunks": upstream.num_chunks,
            "capacity_tokens": upstream.capacity_tokens,
            "kv_connector_extra_config": dict(upstream.kv_connector_extra_config),
        }
    )


#: The per-group facts the plan and the engine must agree on (same names on both sides).
GROUP_FIELDS = (
    "kind",
    "num_layers",
    "tokens_per_block",
    "page_bytes",
    "bytes_per_block",
    "sliding_window",
)


def _group_fields(group: KVGroupInfo | ObservedGroup) -> dict[str, Any]:
    fields = {name: getattr(group, name) for name in GROUP_FIELDS}
    if isinstance(group, KVGroupInfo) and group.layer_page_bytes:
        fields["kind"] = f"uniform({group.kind})"  # as _kind names vLLM's mixed-page spec
        pages = group.layer_page_bytes
        if len(set(pages)) == 1 and group.page_bytes == pages[0] * len(pages):
            # a packed (block-outermost) group of one page size: vLLM's page is one layer's
            fields["page_bytes"] = pages[0]
    return fields


def compare(plan: Plan, observed: ObservedGeometry) -> list[Mismatch]:
    """Every plan field vLLM disagrees with; empty when the geometry is the plan's."""
    out: list[Mismatch] = []

    def check(field: str, expected: Any, actual: Any) -> None:
        if expected != actual:
            out.append(Mismatch(field, expected, actual))

    par = plan.parallelism
    check("tensor_parallel_size", par.tensor_parallel_size, observed.tensor_parallel_size)
    check("pipeline_parallel_size", par.pipeline_parallel_size, observed.pipeline_parallel_size)
    check("max_model_len", plan.max_model_len, observed.max_model_len)

    check("kv_groups (count)", len(plan.kv_groups), len(observed.groups))
    for i, (want, got) in enumerate(zip(plan.kv_groups, observed.groups, strict=False)):
        got_fields = _group_fields(got)
        for name, value in _group_fields(want).items():
            check(f"kv_groups[{i}].{name}", value, got_fields[name])

    check("tokens_per_hash", plan.tokens_per_hash, observed.tokens_per_hash)
    check("worker_bytes_per_block", plan.worker_bytes_per_block, observed.worker_bytes_per_block)

    connector = observed.kv_connector
    if connector is None:
        return out  # offloading off: nothing chunked to compare
    if connector not in (UPSTREAM_CONNECTOR, SPILLWAY_CONNECTOR):
        check("kv_connector", plan.kv_transfer_config.get("kv_connector"), connector)
        return out
    check("cpu_bytes_to_use", plan.cpu_memory_bytes, observed.cpu_bytes_to_use)
    if connector == SPILLWAY_CONNECTOR:
        if plan.offloader != "spillway":
            check("offloader", plan.offloader, "spillway")
            return out
        if observed.offload_error is not None:
            out.append(Mismatch("offloading config", "Spillway's geometry", observed.offload_error))
            return out
        spillway = plan.spillway
        if spillway is None:  # a stage Spillway's geometry refused at planning
            out.append(Mismatch("offloader", "spillway refused for this stage", connector))
            return out
        check("spillway.chunk_tokens", spillway.chunk_tokens, observed.chunk_tokens)
        check(
            "spillway.groups[].blocks_per_chunk",
            tuple(g.blocks_per_chunk for g in spillway.groups),
            observed.group_blocks_per_chunk,
        )
        check(
            "spillway.groups[].units",
            tuple(g.units for g in spillway.groups),
            observed.group_units,
        )
        check("spillway.unit_bytes", spillway.unit_bytes, observed.unit_bytes)
        check("spillway.num_units", spillway.num_units, observed.num_units)
        return out

    # vLLM's own offloader: its figures are the plan's upstream ones.
    upstream = plan.upstream
    if upstream is None:
        reason = plan.upstream_refusal or "no upstream geometry in the plan"
        out.append(Mismatch("offloader", f"spillway only ({reason})", connector))
        return out
    if observed.offload_error is not None:
        out.append(
            Mismatch(
                "offloading config",
                f"blocks_per_chunk={upstream.blocks_per_chunk}",
                f"refused: {observed.offload_error}",
            )
        )
        return out
    check("blocks_per_chunk", upstream.blocks_per_chunk, observed.blocks_per_chunk)
    if observed.row_bytes is not None:
        check("row_bytes", upstream.row_bytes, observed.row_bytes)
    if observed.num_chunks is not None:
        check("num_chunks", upstream.num_chunks, observed.num_chunks)
    return out


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def format_table(mismatches: Sequence[Mismatch]) -> str:
    """``field | plan | vLLM`` rows, aligned, for the start-up log."""
    rows = [("field", "plan", "vLLM")] + [
        (m.field, _cell(m.plan), _cell(m.vllm)) for m in mismatches
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


# --------------------------------------------------------------------------- observe


def _kind(spec: Any) -> str:
    """The plan's name for a vLLM KV cache spec (class checks, subclasses first)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = {_kind(s) for s in spec.kv_cache_specs.values()}
        return f"uniform({','.join(sorted(inner))})"
    for cls, name in (
        (CircularBufferSpec, "circular_buffer"),
        (MambaSpec, "mamba"),
        (MLAAttentionSpec, "mla"),
        (SlidingWindowSpec, "sliding_window"),
        (ChunkedLocalAttentionSpec, "chunked_local"),
        (FullAttentionSpec, "full_attention"),
    ):
        if isinstance(spec, cls):
            return name
    return type(spec).__name__


def _observe_group(group: Any) -> ObservedGroup:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    layers = len(group.layer_names)
    block = None
    window = getattr(spec, "sliding_window", None)
    if isinstance(spec, UniformTypeKVCacheSpecs):
        # one attention type: the layers share its window (the wrapper has none)
        window = getattr(spec.first_spec, "sliding_window", None)
        pages = {s.page_size_bytes for s in spec.kv_cache_specs.values()}
        # one page per layer when they agree; otherwise the group's sum (the plan's
        # page of a mixed-page group), which is also its block
        if len(pages) == 1:
            page = pages.pop()
        else:
            page = block = spec.page_size_bytes
    else:
        page = spec.page_size_bytes
    return ObservedGroup(
        kind=_kind(spec),
        num_layers=layers,
        tokens_per_block=spec.block_size,
        page_bytes=page,
        sliding_window=window,
        block_bytes=block,
    )


def _worker_bytes_per_block(kv_cache_config: Any) -> int:
    """One block of the backing allocation (``build_offloading_config``'s rule)."""
    if kv_cache_config.num_blocks > 0 and kv_cache_config.kv_cache_tensors:
        return kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    return max(
        (_observe_group(g).bytes_per_block for g in kv_cache_config.kv_cache_groups),
        default=0,
    )


def _tokens_per_hash(vllm_config: Any, kv_cache_config: Any) -> int:
    resolved = getattr(kv_cache_config, "hash_block_size", None)
    if resolved:
        return int(resolved)  # the engine core sets it before the workers see the config
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])


def observe(vllm_config: Any, kv_cache_config: Any) -> ObservedGeometry:
    """Read the geometry vLLM built from its ``VllmConfig`` and ``KVCacheConfig``."""
    parallel = vllm_config.parallel_config
    transfer = vllm_config.kv_transfer_config
    connector = getattr(transfer, "kv_connector", None) if transfer is not None else None
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    cpu_bytes = extra.get("cpu_bytes_to_use")
    fields: dict[str, Any] = {
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "max_model_len": vllm_config.model_config.max_model_len,
        "groups": tuple(_observe_group(g) for g in kv_cache_config.kv_cache_groups),
        "tokens_per_hash": _tokens_per_hash(vllm_config, kv_cache_config),
        "worker_bytes_per_block": _worker_bytes_per_block(kv_cache_config),
        "kv_connector": connector,
        "cpu_bytes_to_use": None if cpu_bytes is None else int(cpu_bytes),
    }
    if connector == UPSTREAM_CONNECTOR:
        fields.update(_observe_upstream_offload(vllm_config, kv_cache_config))
    elif connector == SPILLWAY_CONNECTOR:
        fields.update(_observe_spillway_offload(vllm_config, kv_cache_config))
    return ObservedGeometry(**fields)


def _observe_spillway_offload(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The geometry Spillway's connector will build (the same pure function it calls)."""
    from spillway_engine.offloader.geometry import SpillwayConfigError, build_geometry

    try:
        layout = build_geometry(vllm_config, kv_cache_config).layout
    except SpillwayConfigError as e:
        return {"offload_error": str(e)}
    return {
        "chunk_tokens": layout.chunk_tokens,
        "group_blocks_per_chunk": tuple(g.blocks_per_chunk for g in layout.groups),
        "group_units": tuple(g.units for g in layout.groups),
        "unit_bytes": layout.unit_bytes,
        "num_units": layout.num_units,
    }


def _observe_upstream_offload(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """What vLLM's OffloadingConnector will build: the same calls, side-effect free.

    ``build_offloading_config`` is what the connector's constructor calls, and
    ``CPUOffloadingSpec.__init__`` only does arithmetic (the shared region is created
    later, by the workers), so running them here costs nothing and sees exactly what
    the connector will see.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    try:
        off = build_offloading_config(vllm_config, kv_cache_config)
    except (AssertionError, ValueError) as e:
        return {"offload_error": str(e) or type(e).__name__}
    out: dict[str, Any] = {
        "blocks_per_chunk": off.cache.blocks_per_chunk,
        "worker_bytes_per_block": off.worker_kv_bytes_per_block,
    }
    try:
        spec = OffloadingSpecFactory.create_spec(off)
    except Exception as e:  # vLLM raises bare Exception for a missing pool size
        return {**out, "offload_error": str(e) or type(e).__name__}
    if hasattr(spec, "num_chunks") and hasattr(spec, "kv_bytes_per_chunk"):
        out.update(row_bytes=int(spec.kv_bytes_per_chunk), num_chunks=int(spec.num_chunks))
    return out


def check(plan: Plan, vllm_config: Any, kv_cache_config: Any,
          stage: int | None = None) -> ObservedGeometry:
    """Observe and compare (with ``stage``: against that pipeline stage of the plan,
    :func:`stage_plan`); raises :class:`PlanMismatch` on any difference."""
    observed = observe(vllm_config, kv_cache_config)
    mismatches = compare(stage_plan(plan, stage), observed)
    if mismatches and stage is not None and plan.stages:
        mismatches = [Mismatch(f"stages[{stage}].{m.field}", m.plan, m.vllm) for m in mismatches]
    if mismatches:
        raise PlanMismatch(mismatches)
    return observed
