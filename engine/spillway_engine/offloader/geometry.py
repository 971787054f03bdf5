"""Spillway's chunk geometry for a live engine, read off vLLM's own KV-cache config.

The arithmetic is :mod:`spillway_engine.planner.offload_geometry`'s (the planner's), so the plan and
the engine agree by construction; this module only gathers its inputs from vLLM's
objects and builds the two views vLLM's scheduler-side code needs.

Per-group chunk sizes inside vLLM's scheduler
---------------------------------------------
vLLM 0.33's offloading scheduler slices every group's GPU block list with one global
``blocks_per_chunk``. With one common span ``T`` and groups of different block sizes
each group needs its own ``T / tokens_per_block``. Spillway gets that without
rewriting the scheduler: the scheduler sees every offloaded group in *virtual* blocks
of ``v = gcd(tokens_per_block)`` tokens (the hash unit in vLLM 0.33), so one global
``blocks_per_chunk = T / v`` is right for all of them, and a real block of ``m = tpb /
v`` virtual blocks is handed to it as its id repeated ``m`` times. The connector
expands block ids on the way in (:func:`expand_blocks`) and the worker contracts
them on the way out (:func:`contract_gpu_spec`). Chunk boundaries are multiples of
every real block, so a chunk always holds whole runs. Models whose groups share one
block size (most) have ``m = 1`` everywhere and run vLLM's scheduler untouched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from spillway_engine.offloader.host_layout import GroupSlots, HostLayout
from spillway_engine.planner.offload_geometry import (
    OffloadRefused,
    UnitPool,
    chunk_span,
    host_copies,
    unit_pool,
)

#: vLLM offloading options whose host layout Spillway's pool does not implement.
UNSUPPORTED_OPTIONS = {
    "canonical_layout": "Spillway's host units hold each worker's own pages",
    "spec_name": "Spillway's connector brings its own spec (the unit pool)",
    "spec_module_path": "Spillway's connector brings its own spec (the unit pool)",
}

#: Secondary tiers that copy a key's host units whole. vLLM's own (fs, obj, p2p...)
#: take one row per key and would store the wrong bytes from the unit pool.
UNIT_AWARE_TIERS = frozenset({"SpillwayDiskTier"})


class SpillwayConfigError(ValueError):
    """Spillway's offloader cannot run this configuration; the message says why."""


@dataclass(frozen=True)
class ConnectorGeometry:
    chunk_tokens: int
    #: tokens per virtual block the scheduler sees (gcd of the groups' blocks)
    virtual_tokens_per_block: int
    #: vLLM group id -> virtual blocks per real block, for groups where that is > 1
    expansion: Mapping[int, int]
    layout: HostLayout
    #: upstream's OffloadingConfig with the scheduler's (virtual) geometry
    offloading_config: Any
    #: the KV-cache config the scheduler sees (virtual block sizes where expanded)
    scheduler_kv_cache_config: Any
    #: the engine's own KV-cache config, as the connector was given it (the worker's is
    #: where :func:`packed_layer_pages` finds each layer's pages)
    kv_cache_config: Any = None


def _layer_specs(spec: Any, layer_names: Sequence[str]) -> list[Any]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [spec.kv_cache_specs[name] for name in layer_names]
    return [spec] * len(layer_names)


def unpadded_page_bytes(spec: Any) -> int:
    """The bytes of one layer's page that hold KV, as vLLM's offloading worker copies them."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    if isinstance(spec, AttentionSpec):
        return spec.unpadded_page_size_bytes
    if isinstance(spec, MambaSpec):
        return replace(spec, page_size_padded=None).page_size_bytes
    raise SpillwayConfigError(f"{type(spec).__name__} pages cannot be offloaded")


def spec_true_bytes_per_block(group: Any) -> int:
    """Bytes one block of a vLLM KV-cache group (``KVCacheGroupSpec``) holds on one
    worker, padding excluded (the planner's ``true_bytes_per_block`` for a live engine)."""
    return sum(unpadded_page_bytes(s) for s in _layer_specs(group.kv_cache_spec, group.layer_names))


def _group_bytes(vllm_config: Any, kv_cache_config: Any, group: Any) -> int:
    """``spec_true_bytes_per_block``, also on the scheduler's copy of the config.

    EngineCore gives the scheduler a mixed-page group (``UniformTypeKVCacheSpecs``:
    DeepSeek-V3.2's latents and indexer keys, a draft model's layers) as one layer's
    spec; the other layers' pages are then read off their ``KVCacheTensor`` strides,
    so the scheduler sizes the host pool as the workers do."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs) or len(group.layer_names) < 2:
        return spec_true_bytes_per_block(group)
    block_outer = vllm_config.cache_config.get_resolved_kv_cache_layout().is_block_outermost
    stride = {
        name: t.layer_stride if block_outer else t.block_stride
        for t in kv_cache_config.kv_cache_tensors
        for name in t.layers
    }
    if len({stride.get(name) for name in group.layer_names}) == 1:
        return spec_true_bytes_per_block(group)  # one page: not a mixed group
    own = unpadded_page_bytes(spec)
    return sum(
        own if stride.get(name, spec.page_size_bytes) == spec.page_size_bytes else stride[name]
        for name in group.layer_names
    )


def _describe(spec: Any) -> str:
    return type(spec).__name__.removesuffix("Spec")


def _uses_shared_region() -> bool:
    from vllm.platforms import current_platform

    return (
        current_platform.is_cuda_alike() and not current_platform.is_rocm()
    ) or current_platform.is_xpu()


def with_extra_config(vllm_config: Any, extra: dict[str, Any]) -> Any:
    """A shallow copy of ``vllm_config`` whose connector extra config is ``extra``."""
    view = copy.copy(vllm_config)
    transfer = copy.copy(vllm_config.kv_transfer_config)
    object.__setattr__(transfer, "kv_connector_extra_config", extra)
    object.__setattr__(view, "kv_transfer_config", transfer)
    return view


def _int_option(extra: Mapping[str, Any], key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SpillwayConfigError(
            f"kv_connector_extra_config[{key!r}] must be an integer, got {value!r}"
        ) from None


def build_geometry(vllm_config: Any, kv_cache_config: Any) -> ConnectorGeometry:
    """Spillway's geometry for this engine, or :class:`SpillwayConfigError` saying why not."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config)
    cpu_bytes = _pool_bytes(extra)
    group_ids = _offloaded_group_ids(kv_cache_config)
    groups = [kv_cache_config.kv_cache_groups[g] for g in group_ids]
    tokens_per_block, tokens_per_hash, span = _chunk_span(
        vllm_config, kv_cache_config, groups, extra
    )
    _check_planned_blocks(extra, group_ids, tokens_per_block, span)
    virtual, expansion, scheduler_kv_cache_config = _scheduler_view(
        kv_cache_config, group_ids, tokens_per_block, tokens_per_hash
    )
    offloading_config = _offloading_config(
        vllm_config, kv_cache_config, scheduler_kv_cache_config, extra, span // virtual, span
    )
    copies = host_copies(
        vllm_config.parallel_config.world_size,
        offloading_config.replicated_layout and _uses_shared_region(),
    )
    try:
        pool = unit_pool(
            cpu_bytes,
            span,
            [
                (
                    gid,
                    _describe(g.kv_cache_spec),
                    tpb,
                    _group_bytes(vllm_config, kv_cache_config, g),
                )
                for gid, g, tpb in zip(group_ids, groups, tokens_per_block, strict=True)
            ],
            copies,
        )
    except OffloadRefused as e:
        raise SpillwayConfigError(str(e)) from None
    pool = shared_stage_units(pool, extra, group_ids)
    return ConnectorGeometry(
        chunk_tokens=span,
        virtual_tokens_per_block=virtual,
        expansion=expansion,
        layout=_host_layout(pool, span, group_ids, tokens_per_block, offloading_config),
        offloading_config=offloading_config,
        scheduler_kv_cache_config=scheduler_kv_cache_config,
        kv_cache_config=kv_cache_config,
    )


def shared_stage_units(
    pool: UnitPool, extra: Mapping[str, Any], group_ids: Sequence[int]
) -> UnitPool:
    """The pool cut to what every pipeline stage holds, as the plan gives it.

    vLLM's scheduler (and so Spillway's manager) sizes the pool from stage 0's KV-cache
    config; a stage of wider blocks holds fewer units. The plan then gives every
    stage's connector the units a chunk of each group takes on the widest stage
    (``spillway_group_units``) and the units the smallest stage's region holds
    (``spillway_num_units``), so a unit id the manager hands out is inside every
    stage's region and holds every stage's chunk bytes."""
    units, num_units = extra.get("spillway_group_units"), extra.get("spillway_num_units")
    if units is None and num_units is None:
        return pool
    if units is None or num_units is None:
        raise SpillwayConfigError(
            "kv_connector_extra_config: give both 'spillway_group_units' and "
            "'spillway_num_units' (the pool every pipeline stage holds), or neither"
        )
    try:
        units, num_units = tuple(int(k) for k in units), int(num_units)
    except (TypeError, ValueError):
        raise SpillwayConfigError(
            "kv_connector_extra_config['spillway_group_units'] must be a list of integers "
            f"and ['spillway_num_units'] an integer, got {units!r} and {num_units!r}"
        ) from None
    if len(units) != len(group_ids):
        raise SpillwayConfigError(
            f"kv_connector_extra_config['spillway_group_units'] has {len(units)} entries, "
            f"but this engine offloads {len(group_ids)} KV-cache groups {list(group_ids)}"
        )
    for gid, want, have in zip(group_ids, units, pool.units, strict=True):
        if want < have:
            raise SpillwayConfigError(
                f"kv_connector_extra_config['spillway_group_units']: KV-cache group {gid} "
                f"gets {want} units a chunk, but this worker's chunk needs {have} units of "
                f"{pool.unit_bytes} bytes; the plan was made for another split"
            )
    if not sum(units) <= num_units <= pool.num_units:
        raise SpillwayConfigError(
            f"kv_connector_extra_config['spillway_num_units'] {num_units} is outside this "
            f"worker's pool of {pool.num_units} units (at least {sum(units)}, one chunk of "
            "every group); the plan was made for another split or pool"
        )
    return replace(pool, units=units, num_units=num_units)


def _pool_bytes(extra: Mapping[str, Any]) -> int:
    """The host pool size, after refusing the options Spillway's pool does not implement."""
    for key, why in UNSUPPORTED_OPTIONS.items():
        if extra.get(key):
            raise SpillwayConfigError(f"kv_connector_extra_config[{key!r}] is not supported: {why}")
    for tier in extra.get("secondary_tiers") or ():
        if not isinstance(tier, Mapping) or tier.get("type") not in UNIT_AWARE_TIERS:
            raise SpillwayConfigError(
                f"kv_connector_extra_config['secondary_tiers']: {tier!r} is not supported: "
                f"Spillway's host units go only to a tier that knows them "
                f"({', '.join(sorted(UNIT_AWARE_TIERS))})")
    cpu_bytes = _int_option(extra, "cpu_bytes_to_use")
    if not cpu_bytes or cpu_bytes <= 0:
        raise SpillwayConfigError(
            "kv_connector_extra_config['cpu_bytes_to_use'] must give the host pool size in bytes"
        )
    return cpu_bytes


def _offloaded_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """vLLM's offloadable groups; Mamba groups only with per-block states (mode 'align')."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    group_ids = tuple(get_offloading_group_ids(kv_cache_config))
    if not group_ids:
        raise SpillwayConfigError("no KV-cache group can be offloaded (none is prefix-cacheable)")
    for gid in group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        for spec in _layer_specs(group.kv_cache_spec, group.layer_names):
            if isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align":
                raise SpillwayConfigError(
                    f"KV-cache group {gid} holds Mamba states in cache mode "
                    f"{spec.mamba_cache_mode!r}: they are only kept per block with prefix "
                    "caching on (mode 'align'), so there is nothing chunkable to offload"
                )
    return group_ids


def _chunk_span(
    vllm_config: Any, kv_cache_config: Any, groups: list[Any], extra: Mapping[str, Any]
) -> tuple[list[int], int, int]:
    """Tokens per block of each group, the hash unit and the common chunk span T."""
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import MambaSpec

    dcp = vllm_config.parallel_config.decode_context_parallel_size
    tokens_per_block = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp) for g in groups]
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    try:
        span = chunk_span(
            tokens_per_block,
            tokens_per_hash,
            has_mamba=any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups),
            blocks_per_chunk=_int_option(extra, "blocks_per_chunk"),
            chunk_tokens=_int_option(extra, "spillway_chunk_tokens")
            or _int_option(extra, "block_size"),
        )
    except OffloadRefused as e:
        raise SpillwayConfigError(str(e)) from None
    return tokens_per_block, tokens_per_hash, span


def _check_planned_blocks(
    extra: Mapping[str, Any], group_ids: Sequence[int], tokens_per_block: Sequence[int], span: int
) -> None:
    """The plan's per-group blocks per chunk, if it gave them, are this engine's."""
    planned = extra.get("spillway_group_blocks_per_chunk")
    if planned is None:
        return
    planned = list(planned)
    if len(planned) != len(group_ids):
        raise SpillwayConfigError(
            f"the plan has blocks per chunk for {len(planned)} KV-cache groups, but "
            f"this engine offloads {len(group_ids)} (groups {list(group_ids)})"
        )
    for gid, want, tpb in zip(group_ids, planned, tokens_per_block, strict=True):
        if int(want) != (have := span // tpb):
            raise SpillwayConfigError(
                f"KV-cache group {gid}: the plan cuts {want} blocks per chunk, this "
                f"engine {have} ({span}-token chunks); the plan was made for another "
                "engine configuration"
            )


def _scheduler_view(
    kv_cache_config: Any,
    group_ids: Sequence[int],
    tokens_per_block: Sequence[int],
    tokens_per_hash: int,
) -> tuple[int, dict[int, int], Any]:
    """The virtual block size, the expanded groups (id -> virtual blocks per real one)
    and the KV-cache config the scheduler sees with them."""
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    virtual = math.gcd(*tokens_per_block)
    if virtual % tokens_per_hash:
        raise SpillwayConfigError(
            f"the KV-cache groups' common block ({virtual} tokens) is not a multiple of "
            f"the {tokens_per_hash}-token hash unit"
        )
    expansion = {
        gid: tpb // virtual
        for gid, tpb in zip(group_ids, tokens_per_block, strict=True)
        if tpb != virtual
    }
    if not expansion:
        return virtual, expansion, kv_cache_config
    view_groups = list(kv_cache_config.kv_cache_groups)
    for gid, m in expansion.items():
        spec = view_groups[gid].kv_cache_spec
        if isinstance(spec, MambaSpec | UniformTypeKVCacheSpecs):
            raise SpillwayConfigError(
                f"KV-cache group {gid} ({_describe(spec)}) has {spec.block_size}-token "
                f"blocks, coarser than the finest offloaded group's {virtual}; Spillway "
                "can only re-cut attention groups"
            )
        view_groups[gid] = replace(
            view_groups[gid], kv_cache_spec=replace(spec, block_size=spec.block_size // m)
        )
    return virtual, expansion, replace(kv_cache_config, kv_cache_groups=view_groups)


def _offloading_config(
    vllm_config: Any,
    kv_cache_config: Any,
    scheduler_kv_cache_config: Any,
    extra: Mapping[str, Any],
    virtual_blocks_per_chunk: int,
    span: int,
) -> Any:
    """Upstream's OffloadingConfig over the scheduler's virtual blocks, with sliding
    windows sized in true ``span``-token chunks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
        get_sliding_window_size_in_chunks,
    )

    upstream_extra = {k: v for k, v in extra.items() if k != "block_size"}
    upstream_extra["blocks_per_chunk"] = virtual_blocks_per_chunk
    config = build_offloading_config(
        with_extra_config(vllm_config, upstream_extra), scheduler_kv_cache_config
    )

    def window(group_id: int) -> int | None:
        group = kv_cache_config.kv_cache_groups[group_id]
        first = _layer_specs(group.kv_cache_spec, group.layer_names)[0]
        return get_sliding_window_size_in_chunks(first, span)

    # vLLM sized windows in chunks with the virtual blocks; recheck with the true span.
    groups = tuple(
        replace(g, sliding_window_size_in_chunks=window(g.group_id)) for g in config.groups
    )
    return replace(config, groups=groups)


def _host_layout(
    pool: UnitPool,
    span: int,
    group_ids: Sequence[int],
    tokens_per_block: Sequence[int],
    offloading_config: Any,
) -> HostLayout:
    slots = zip(
        group_ids,
        tokens_per_block,
        pool.blocks_per_chunk,
        pool.chunk_bytes,
        pool.units,
        offloading_config.groups,
        strict=True,
    )
    return HostLayout(
        chunk_tokens=span,
        unit_bytes=pool.unit_bytes,
        copies=pool.copies,
        num_units=pool.num_units,
        groups=tuple(
            GroupSlots(
                group_id=gid,
                position=position,
                tokens_per_block=tpb,
                blocks_per_chunk=bpc,
                chunk_bytes=nbytes,
                units=k,
                window_chunks=off_group.sliding_window_size_in_chunks,
            )
            for position, (gid, tpb, bpc, nbytes, k, off_group) in enumerate(slots)
        ),
    )


# ------------------------------------------------------------ packed KV blocks


@dataclass(frozen=True)
class LayerPage:
    """Where one offloaded layer's pages sit in vLLM's KV-cache allocation: block ``b``'s
    page starts ``offset + b * block_stride`` bytes into the backing buffer."""

    name: str
    offset: int
    block_stride: int
    #: bytes of the layer's page in each block (padded)
    page_bytes: int
    #: bytes of it that hold KV (unpadded): what is offloaded
    data_bytes: int
    num_blocks: int


def packed_layer_pages(
    kv_cache_config: Any, group_ids: Sequence[int]
) -> list[list[LayerPage]] | None:
    """Each offloaded group's layer pages (group by group, in ``group_ids`` order, layers
    in the group's order) when vLLM packs its KV blocks; None when it does not.

    Packed (block-outermost) allocations put every layer's page of one block side by
    side (``KVCacheTensor.block_stride`` is the packed block, larger than a page):
    GLM-5 Next's KDA states, MLA latents, indexer keys and rings, DeepSeek-V4's caches.
    vLLM 0.33's offloading worker then hands its ``OffloadingSpec`` one region per
    group, the whole packed block, for every group (``register_kv_caches``; it
    detects packing, as here, by an attention layer's block stride exceeding its
    page). A group's chunk would then be ``block_stride x blocks per chunk`` bytes,
    not the unpadded pages of its own layers that the plan and the host layout hold,
    and Spillway's worker refused to start on the difference. These pages let the
    worker copy exactly those bytes (:func:`spillway_engine.offloader.worker.unpack_caches`).
    """
    from vllm.v1.kv_cache_interface import AttentionSpec

    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        return None  # vLLM's packed collapse is off there too
    where = {
        name: (t, i) for t in kv_cache_config.kv_cache_tensors for i, name in enumerate(t.layers)
    }
    groups: list[list[LayerPage]] = []
    packed = False
    for gid in group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        pages = []
        for name, spec in zip(
            group.layer_names, _layer_specs(group.kv_cache_spec, group.layer_names), strict=True
        ):
            if name not in where:
                raise SpillwayConfigError(
                    f"KV-cache group {gid}: layer {name} has no KV-cache tensor"
                )
            t, i = where[name]
            page = spec.page_size_bytes
            packed |= isinstance(spec, AttentionSpec) and t.block_stride != page
            pages.append(
                LayerPage(
                    name=name,
                    offset=t.offset + i * t.layer_stride,
                    block_stride=t.block_stride,
                    page_bytes=page,
                    data_bytes=unpadded_page_bytes(spec),
                    num_blocks=kv_cache_config.num_blocks_of(t),
                )
            )
        groups.append(pages)
    return groups if packed else None


# ------------------------------------------------------------ virtual block ids


def expand_blocks(
    groups: Sequence[Sequence[Any]] | None, expansion: Mapping[int, int]
) -> tuple[Sequence[Any], ...] | None:
    """Per-group block lists (ids or vLLM's block objects) with each real block repeated
    ``m`` times in the groups the scheduler sees in virtual blocks."""
    if groups is None:
        return None
    return tuple(
        [b for b in blocks for _ in range(expansion[gid])] if gid in expansion else blocks
        for gid, blocks in enumerate(groups)
    )


def contract_runs(block_ids: Sequence[int], first_index: int, m: int) -> tuple[list[int], int]:
    """Real block ids and first real index from a run-expanded id list (``m`` per block)."""
    if first_index % m or len(block_ids) % m:
        raise ValueError(
            f"virtual blocks [{first_index}, {first_index + len(block_ids)}) do not cover "
            f"whole {m}-block runs"
        )
    real = list(block_ids[::m])
    for i, b in enumerate(real):
        if any(x != b for x in block_ids[i * m : (i + 1) * m]):
            raise ValueError(f"virtual blocks of real block {b} are not one run")
    return real, first_index // m
