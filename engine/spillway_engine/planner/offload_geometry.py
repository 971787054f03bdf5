"""Offload chunk geometry and host pool, for vLLM's CPU offloader and Spillway's.

Upstream (vLLM 0.33.0 ``build_offloading_config`` + ``CPUOffloadingSpec``):
one global ``blocks_per_chunk`` (bpc); every (chunk, group) key takes one row of
``round_up(worker_bytes_per_block * copies * bpc, 4096)`` bytes, where
``worker_bytes_per_block`` is the whole backing allocation's block (the largest group)
and ``copies`` is the number of workers, or 1 for the replicated MLA layout.

Spillway (the patched offloader, ``spillway_engine.offloader``, which computes its
geometry with these same functions from vLLM's KV-cache config): one common chunk
span ``T`` tokens for every offloaded group, a multiple of every group's tokens per
block and of the hash unit; group g cuts ``T / tokens_per_block_g`` blocks per chunk.
The host pool is one array of equal *units* (a 4 KiB multiple chosen by
:func:`host_units` so the groups' chunks fill whole units with little slack); a chunk
of group g takes ``units_g`` units anywhere in the pool, its true bytes (unpadded
pages) only, so all groups share one pool and one LRU. A single-group model gets one
unit per chunk, which is exactly upstream's row. Counting every group's chunk
densely, the pool holds ``num_units // sum(units_g)`` chunks of every group, each
``T`` tokens of prefix.

Validation mirrors every offloading start-up error of vLLM 0.33.0 in plain words.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from spillway_engine.arith import cdiv, round_up
from spillway_engine.planner.kv_layout import KVGroup, KVLayout

#: ``SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT`` (``mmap.PAGESIZE`` on x86-64 Linux).
ROW_ALIGNMENT = 4096
#: Default chunk span when the user gives none: 256 tokens, the size vLLM's docs use.
DEFAULT_CHUNK_TOKENS = 256

Offloader = Literal["upstream", "spillway"]


class OffloadRefused(ValueError):
    """vLLM (or Spillway's offloader) would refuse this offloading configuration."""


@dataclass(frozen=True)
class OffloadRequest:
    cpu_bytes: int
    world_size: int
    max_model_len: int
    blocks_per_chunk: int | None = None
    #: the legacy token-based ``block_size`` key, accepted only to mirror its checks
    chunk_block_size_tokens: int | None = None
    #: vLLM's replicated MLA layout needs the single-node ``mp`` executor
    single_node: bool = True
    #: pipeline stages in ``world_size`` (vLLM's replicated layout needs 1)
    pipeline_parallel_size: int = 1


@dataclass(frozen=True)
class GroupChunk:
    group_index: int
    tokens_per_block: int
    blocks_per_chunk: int
    tokens_per_chunk: int
    chunk_bytes: int
    row_bytes: int
    window_chunks: int | None
    #: host units one chunk of this group takes (Spillway; upstream always 1 row)
    units: int = 1


@dataclass(frozen=True)
class UpstreamGeometry:
    blocks_per_chunk: int
    copies: int
    replicated_layout: bool
    kv_bytes_per_chunk: int
    row_bytes: int
    num_chunks: int
    region_bytes: int
    groups: tuple[GroupChunk, ...]
    capacity_tokens: int
    gauge_tokens: int
    kv_connector_extra_config: dict[str, int]


@dataclass(frozen=True)
class SpillwayGeometry:
    chunk_tokens: int
    copies: int
    #: bytes of one host unit on one worker (x copies per unit in the region)
    unit_bytes: int
    num_units: int
    groups: tuple[GroupChunk, ...]
    chunk_set_bytes: int
    num_chunks: int
    region_bytes: int
    capacity_tokens: int
    gauge_tokens: int
    kv_connector_extra_config: dict[str, object]


def _window_chunks(group: KVGroup, tokens_per_chunk: int) -> int | None:
    """``get_sliding_window_size_in_chunks`` (no extra retained tokens)."""
    if group.kind == "sliding_window":
        assert group.sliding_window
        w = group.sliding_window
        return max(cdiv(w, tokens_per_chunk), cdiv(w - 1, tokens_per_chunk))
    if group.kind == "chunked_local":
        assert group.attention_chunk_size
        return cdiv(group.attention_chunk_size, tokens_per_chunk)
    if group.kind == "mamba":
        return 1
    return None


def unit_pool_gauge_tokens(
    num_units: int,
    max_model_len: int,
    chunk_tokens: int,
    groups: Iterable[tuple[int | None, int]],
) -> int:
    """Spillway's ``cpu_kv_cache_size_tokens``: tokens the unit pool holds for requests of
    ``max_model_len``, each group keeping its chunks (up to its window) of ``units`` each;
    ``groups`` is (window chunks or None, units) per group."""
    per_request = sum(
        units * (c if window is None else min(c, window))
        for window, units in groups
        for c in (cdiv(max_model_len, chunk_tokens),)
    )
    return num_units * max_model_len // per_request


def _chunks_per_request(groups: tuple[GroupChunk, ...], max_model_len: int) -> list[int]:
    out = []
    for g in groups:
        c = cdiv(max_model_len, g.tokens_per_chunk)
        out.append(c if g.window_chunks is None else min(c, g.window_chunks))
    return out


def host_copies(world_size: int, replicated: bool) -> int:
    """Worker slots per host row or unit: one per worker, or 1 for the replicated layout."""
    return 1 if replicated else world_size


def replicated_layout(
    layout: KVLayout, world_size: int, single_node: bool, pipeline_parallel_size: int = 1
) -> bool:
    """``build_offloading_config``: one copy per row for TP-replicated MLA (mp, one node,
    TP only: no pipeline stages)."""
    if pipeline_parallel_size != 1:
        return False
    tp = world_size
    return layout.shape.mla_latent > 0 and tp > 1 and layout.tp_replicas == tp and single_node


def offloaded_groups(layout: KVLayout) -> list[tuple[int, KVGroup]]:
    """(group id, group) of the groups vLLM offloads: the prefix-cacheable ones
    (``KVCacheConfig.prefix_cacheable_group_ids``; a circular-buffer ring is not)."""
    return [(i, g) for i, g in enumerate(layout.groups) if g.prefix_cacheable]


def default_blocks_per_chunk(layout: KVLayout) -> int:
    """A bpc vLLM accepts for any group mix: ~256-token chunks, 1 for Mamba hybrids.

    Mamba hybrids keep 1: vLLM only serves sub-chunk (partial tail) hits when bpc == 1,
    and their blocks are already hundreds of tokens.
    """
    if any(g.kind == "mamba" for g in layout.groups):
        return 1
    largest = max(g.tokens_per_block for g in layout.groups)
    return max(1, DEFAULT_CHUNK_TOKENS // largest)


def resolve_blocks_per_chunk(layout: KVLayout, request: OffloadRequest) -> int:
    """vLLM's reading of ``blocks_per_chunk`` / ``block_size`` with its errors, reworded."""
    bpc, tokens = request.blocks_per_chunk, request.chunk_block_size_tokens
    if bpc is not None and tokens is not None:
        raise OffloadRefused(
            "give either blocks per chunk or the token-based block_size key, not both "
            "(vLLM: \"Specify only one of 'block_size' or 'blocks_per_chunk'\")"
        )
    if bpc is not None:
        if bpc <= 0:
            raise OffloadRefused("blocks per chunk must be greater than 0")
        return bpc
    if tokens is not None:
        sizes = {g.tokens_per_block for g in layout.groups}
        if len(sizes) != 1:
            raise OffloadRefused(
                "the token-based block_size key needs every KV-cache group to have the "
                f"same tokens per block, but this model's groups have {sorted(sizes)}; "
                "use blocks per chunk instead"
            )
        tpb = sizes.pop()
        if tokens <= 0 or tokens % tpb:
            raise OffloadRefused(
                f"block_size={tokens} must be a multiple of the GPU block size ({tpb} "
                f"tokens); use {round_up(max(tokens, 1), tpb)} or blocks per chunk"
            )
        return tokens // tpb
    return default_blocks_per_chunk(layout)


def _check_pool(cpu_bytes: int, row: int, what: str) -> None:
    if cpu_bytes <= 0:
        raise OffloadRefused(
            "the CPU offload pool size must be positive (vLLM: cpu_bytes_to_use must be specified)"
        )
    if cpu_bytes < row:
        raise OffloadRefused(
            f"the CPU pool ({cpu_bytes} bytes) is smaller than one {what} ({row} bytes): "
            "the offloader would start with 0 chunks and every store would fail"
        )


def upstream_geometry(layout: KVLayout, request: OffloadRequest) -> UpstreamGeometry:
    """vLLM 0.33.0's ``CPUOffloadingSpec`` sizing, with its start-up checks."""
    tph = layout.tokens_per_hash
    offloaded = offloaded_groups(layout)
    for index, g in offloaded:
        if g.tokens_per_block % tph:
            raise OffloadRefused(
                f"KV-cache group {index} ({g.kind}) has {g.tokens_per_block} tokens per "
                f"block, not a multiple of the {tph}-token hash unit; vLLM's offloader "
                "asserts at start-up (Mamba hybrids need prefix caching on)"
            )
    bpc = resolve_blocks_per_chunk(layout, request)
    replicated = replicated_layout(
        layout, request.world_size, request.single_node, request.pipeline_parallel_size
    )
    copies = host_copies(request.world_size, replicated)
    kv_bytes_per_chunk = layout.worker_bytes_per_block * copies * bpc
    row = round_up(kv_bytes_per_chunk, ROW_ALIGNMENT)
    _check_pool(request.cpu_bytes, row, "row")
    num_chunks = request.cpu_bytes // row
    groups = tuple(
        GroupChunk(
            group_index=i,
            tokens_per_block=g.tokens_per_block,
            blocks_per_chunk=bpc,
            tokens_per_chunk=g.tokens_per_block * bpc,
            chunk_bytes=g.bytes_per_block * copies * bpc,
            row_bytes=row,
            window_chunks=_window_chunks(g, g.tokens_per_block * bpc),
        )
        for i, g in offloaded
    )
    # Every prefix token costs 1/tpc_g rows in each group (dense retention): over the
    # common multiple L of the spans, sum(L / tpc_g) rows per L tokens (exact integers).
    span = math.lcm(*(g.tokens_per_chunk for g in groups))
    capacity = num_chunks * span // sum(span // g.tokens_per_chunk for g in groups)
    gauge = (
        num_chunks
        * request.max_model_len
        // sum(_chunks_per_request(groups, request.max_model_len))
    )
    return UpstreamGeometry(
        blocks_per_chunk=bpc,
        copies=copies,
        replicated_layout=replicated,
        kv_bytes_per_chunk=kv_bytes_per_chunk,
        row_bytes=row,
        num_chunks=num_chunks,
        region_bytes=num_chunks * row,
        groups=groups,
        capacity_tokens=capacity,
        gauge_tokens=gauge,
        kv_connector_extra_config={"cpu_bytes_to_use": request.cpu_bytes, "blocks_per_chunk": bpc},
    )


#: Most units one group's chunk may be split into (bounds per-key metadata).
MAX_UNITS_PER_CHUNK = 64


def host_units(chunk_bytes: list[int]) -> tuple[int, list[int]]:
    """Unit size (bytes per worker) and units per chunk for groups' true chunk bytes.

    The unit is a 4 KiB multiple (page-aligned rows for the shared mmap and pinning),
    one smallest chunk split ``n`` ways for the ``n`` (up to ``MAX_UNITS_PER_CHUNK``
    units per chunk) that fills units best; the first exact fit wins. Equal groups get
    one unit per chunk, which is upstream's row.
    """
    if not chunk_bytes or min(chunk_bytes) <= 0:
        raise ValueError("every group needs a positive chunk size")
    # Fill is total / (unit x units): the least bytes taken fills best (first one on a
    # tie), an exact fit takes exactly the total. Groups of equal chunks count once.
    sizes: dict[int, int] = {}
    for b in chunk_bytes:
        sizes[b] = sizes.get(b, 0) + 1
    smallest, largest, total = min(sizes), max(sizes), sum(chunk_bytes)
    pairs = tuple(sizes.items())
    best_unit = best_taken = 0
    split = 1
    while split <= MAX_UNITS_PER_CHUNK:
        share = -(-smallest // split)  # cdiv and round_up inline: this loop is hot
        unit = -(-share // ROW_ALIGNMENT) * ROW_ALIGNMENT
        if -(-largest // unit) > MAX_UNITS_PER_CHUNK:
            break
        taken = unit * sum(n * -(-b // unit) for b, n in pairs)
        if not best_unit or taken < best_taken:
            best_unit, best_taken = unit, taken
        if taken == total or unit == ROW_ALIGNMENT:
            break
        # the splits up to the next smaller unit give this unit again (the same fill,
        # which cannot beat the best): go straight to the first one that does not
        split = -(-smallest // (unit - ROW_ALIGNMENT))
    assert best_unit
    return best_unit, [-(-b // best_unit) for b in chunk_bytes]


@dataclass(frozen=True)
class UnitPool:
    """A host pool cut into units for chunks of one span: the per-group figures."""

    blocks_per_chunk: tuple[int, ...]
    #: true bytes of one chunk of each group on one worker
    chunk_bytes: tuple[int, ...]
    #: bytes of one unit on one worker
    unit_bytes: int
    #: units one chunk of each group takes
    units: tuple[int, ...]
    copies: int
    num_units: int

    @property
    def num_chunks(self) -> int:
        """Chunks of every group the pool holds (each group's chunks counted densely)."""
        return self.num_units // sum(self.units)


def unit_pool(
    cpu_bytes: int,
    span: int,
    groups: list[tuple[int, str, int, int]],
    copies: int,
) -> UnitPool:
    """Spillway's pool for ``span``-token chunks; ``groups`` is (group id, kind, tokens
    per block, true bytes per block) each. Refuses a pool smaller than one chunk of
    every group (every store would fail)."""
    blocks_per_chunk = tuple(span // tpb for _, _, tpb, _ in groups)
    chunk_bytes = tuple(
        per_block * bpc for (_, _, _, per_block), bpc in zip(groups, blocks_per_chunk, strict=True)
    )
    unit, units = host_units(list(chunk_bytes))
    num_units = cpu_bytes // (unit * copies)
    if num_units < sum(units):
        row = [k * unit * copies for k in units]
        parts = ", ".join(
            f"group {gid} ({kind}) {r} bytes"
            for (gid, kind, _, _), r in zip(groups, row, strict=True)
        )
        raise OffloadRefused(
            f"the host pool ({cpu_bytes} bytes) is smaller than one chunk of every KV-cache "
            f"group ({sum(row)} bytes: {parts}); every store would fail"
        )
    return UnitPool(blocks_per_chunk, chunk_bytes, unit, tuple(units), copies, num_units)


def chunk_span(
    tokens_per_block: list[int],
    tokens_per_hash: int,
    *,
    has_mamba: bool,
    blocks_per_chunk: int | None = None,
    chunk_tokens: int | None = None,
) -> int:
    """The common chunk span T: a multiple of every group's block and of the hash unit.

    ``chunk_tokens`` is taken as T if it is such a multiple; ``blocks_per_chunk`` is
    that many blocks of the finest group, rounded up to the common multiple; with
    neither, ~256 tokens (one common multiple for Mamba hybrids, whose blocks are
    already hundreds of tokens). Refusals name the group that breaks the span.
    """
    base = math.lcm(tokens_per_hash, *tokens_per_block)
    if chunk_tokens is not None:
        if blocks_per_chunk is not None:
            raise OffloadRefused("give either blocks per chunk or a chunk size in tokens")
        if chunk_tokens <= 0:
            raise OffloadRefused(f"a chunk of {chunk_tokens} tokens is not positive")
        for index, tpb in enumerate(tokens_per_block):
            if chunk_tokens % tpb:
                raise OffloadRefused(
                    f"a chunk of {chunk_tokens} tokens does not hold whole blocks of "
                    f"KV-cache group {index} ({tpb} tokens per block); the smallest span "
                    f"every group and the {tokens_per_hash}-token hash unit share is {base} "
                    f"tokens, so use a multiple of {base}"
                )
        if chunk_tokens % tokens_per_hash:
            raise OffloadRefused(
                f"a chunk of {chunk_tokens} tokens is not a multiple of the "
                f"{tokens_per_hash}-token hash unit; use a multiple of {base}"
            )
        return chunk_tokens
    if blocks_per_chunk is not None:
        if blocks_per_chunk <= 0:
            raise OffloadRefused("blocks per chunk must be greater than 0")
        return round_up(blocks_per_chunk * min(tokens_per_block), base)
    if has_mamba:
        return base
    return round_up(DEFAULT_CHUNK_TOKENS, base)


def spillway_chunk_tokens(
    layout: KVLayout, blocks_per_chunk: int | None, chunk_tokens: int | None = None
) -> int:
    """:func:`chunk_span` for a planned layout."""
    return chunk_span(
        [g.tokens_per_block for _, g in offloaded_groups(layout)],
        layout.tokens_per_hash,
        has_mamba=any(g.kind == "mamba" for g in layout.groups),
        blocks_per_chunk=blocks_per_chunk,
        chunk_tokens=chunk_tokens,
    )


def true_bytes_per_block(layout: KVLayout, group: KVGroup) -> int:
    """Bytes one block of a group really holds on one worker: Mamba pages unpadded."""
    if group.kind == "mamba" and layout.mamba_page_bytes is not None:
        return layout.mamba_page_bytes * group.num_layers
    if group.layer_true_page_bytes:  # pages padded to an alignment (DeepSeek-V4)
        return sum(group.layer_true_page_bytes)
    return group.bytes_per_block


def spillway_connector_refusal(layout: KVLayout) -> str | None:
    """Why Spillway's connector refuses to start on this layout, or None.

    Its scheduler sees every group on the finest group's block (``_scheduler_view``:
    a coarser group's blocks are re-cut into virtual ones), which only works for a
    group of one attention page: a Mamba group or one of mixed pages (DeepSeek-V4's
    packed groups) coarser than the finest block stops the engine at start-up."""
    if layout.mamba_cache_mode == "none":
        return None  # spillway_geometry refuses it with its own reason
    offloaded = offloaded_groups(layout)  # the connector's groups (no ring)
    finest = math.gcd(*(g.tokens_per_block for _, g in offloaded))
    for index, g in offloaded:
        if g.tokens_per_block != finest and (g.kind == "mamba" or g.layer_page_bytes):
            what = "Mamba" if g.kind == "mamba" else "UniformTypeKVCacheSpecs"
            return (
                f"Spillway's offloader refuses this model: KV-cache group {index} ({what}: "
                f"{g.num_layers} layers' pages) has {g.tokens_per_block}-token blocks, "
                f"coarser than the finest group's {finest}, and Spillway can only re-cut "
                "attention groups of one page; use the upstream offloader"
            )
    return None


#: A chunk file takes whole filesystem blocks on disk (ext4/xfs default).
FS_BLOCK_BYTES = 4096
#: Share of the disk tier's volume kept free of complete chunk files, for the temporary
#: files of writes in flight and directories (at least one chunk of every group).
DISK_RESERVE_DIVISOR = 50


@dataclass(frozen=True)
class DiskGeometry:
    """The second tier under the host pool: chunk files on a volume, one engine's share."""

    volume_bytes: int
    #: bytes of complete chunk files the tier keeps at most (it evicts LRU before)
    budget_bytes: int
    #: on-disk bytes of one chunk of each offloaded group (its host rows)
    file_bytes: tuple[int, ...]
    chunk_set_bytes: int
    num_chunks: int
    capacity_tokens: int


def disk_geometry(spillway: SpillwayGeometry, volume_bytes: int) -> DiskGeometry:
    """Chunks the disk tier holds in volume_bytes. A group's chunk is stored as the host
    rows it takes (its units, each row a unit of every rank copy, page-rounded as the
    shared region lays it out), so the tier copies rows whole between the tiers."""
    row = -(-(spillway.unit_bytes * spillway.copies) // FS_BLOCK_BYTES) * FS_BLOCK_BYTES
    files = tuple(g.units * row for g in spillway.groups)
    chunk_set = sum(files)
    budget = volume_bytes - max(volume_bytes // DISK_RESERVE_DIVISOR, chunk_set)
    if budget < chunk_set:
        raise OffloadRefused(
            f"the disk tier's share of {volume_bytes} bytes is below one chunk of every "
            f"group ({chunk_set} bytes on disk) plus as much again kept free for writes in "
            f"flight: give it at least {2 * chunk_set} bytes"
        )
    num_chunks = budget // chunk_set
    return DiskGeometry(
        volume_bytes=volume_bytes,
        budget_bytes=budget,
        file_bytes=files,
        chunk_set_bytes=chunk_set,
        num_chunks=num_chunks,
        capacity_tokens=num_chunks * spillway.chunk_tokens,
    )



def pool_figures(groups: tuple[GroupChunk, ...], num_units: int, num_chunks: int,
                 unit: int, copies: int, span: int, max_model_len: int) -> dict[str, Any]:
    """The SpillwayGeometry fields that follow from its groups and its unit pool: one
    place for the planner's pool and a pipeline stage's shared one (host_pool)."""
    return {
        "num_units": num_units,
        "groups": groups,
        "chunk_set_bytes": sum(g.row_bytes for g in groups),
        "num_chunks": num_chunks,
        "region_bytes": num_units * unit * copies,
        "capacity_tokens": num_chunks * span,
        "gauge_tokens": unit_pool_gauge_tokens(
            num_units, max_model_len, span, ((g.window_chunks, g.units) for g in groups)),
    }

def spillway_geometry(layout: KVLayout, request: OffloadRequest) -> SpillwayGeometry:
    """Spillway's per-group chunking: one token span, rows sized by each group's bytes."""
    if layout.mamba_cache_mode == "none":
        raise OffloadRefused(
            "Mamba states are only cached per block with prefix caching on (mamba cache "
            "mode 'align'); without it there is nothing chunkable to offload"
        )
    span = spillway_chunk_tokens(layout, request.blocks_per_chunk, request.chunk_block_size_tokens)
    replicated = replicated_layout(
        layout, request.world_size, request.single_node, request.pipeline_parallel_size
    )
    _check_pool(request.cpu_bytes, 1, "byte")
    # a pipeline stage may hold no layer of a group: its chunks take no host bytes there
    held = [(i, g) for i, g in offloaded_groups(layout) if g.num_layers]
    if not held:
        raise OffloadRefused(
            "the workers hold no layer of any offloaded KV-cache group: nothing to offload"
        )
    pool = unit_pool(
        request.cpu_bytes,
        span,
        [(i, g.kind, g.tokens_per_block, true_bytes_per_block(layout, g)) for i, g in held],
        host_copies(request.world_size, replicated),
    )
    copies, unit = pool.copies, pool.unit_bytes
    per_group = {
        i: (bpc, nbytes, k)
        for (i, _), bpc, nbytes, k in zip(
            held, pool.blocks_per_chunk, pool.chunk_bytes, pool.units, strict=True
        )
    }
    groups = tuple(
        GroupChunk(
            group_index=i,
            tokens_per_block=g.tokens_per_block,
            blocks_per_chunk=bpc,
            tokens_per_chunk=span,
            chunk_bytes=nbytes * copies,
            row_bytes=k * unit * copies,
            window_chunks=_window_chunks(g, span),
            units=k,
        )
        for i, g in offloaded_groups(layout)
        for bpc, nbytes, k in (per_group.get(i, (span // g.tokens_per_block, 0, 0)),)
    )
    return SpillwayGeometry(
        chunk_tokens=span,
        copies=copies,
        unit_bytes=unit,
        **pool_figures(groups, pool.num_units, pool.num_chunks, unit, copies, span,
                       request.max_model_len),
        kv_connector_extra_config={
            "cpu_bytes_to_use": request.cpu_bytes,
            "spillway_chunk_tokens": span,
            "spillway_group_blocks_per_chunk": [g.blocks_per_chunk for g in groups],
        },
    )
