"""Byte-range copy plans between GPU KV blocks and host pool units, without vLLM.

``plan_copies`` turns one transfer (GPU block ids per offloaded group, and the host
unit ids of the chunks they fall in) into byte-range copies; ``copy_pointers`` turns
a plan into the (src, dst, size) arrays a batched memcpy (vLLM's
``swap_blocks_batch``, or ``cuMemcpyBatchAsync`` itself) executes; ``copy_pieces``
executes a plan with tensor copies. The worker (:mod:`.worker`) runs these behind
vLLM's interfaces; the GPU transfer check (``e2e/gpu/transfer_check.py``) runs them
with torch alone, which is why nothing here imports vLLM: vLLM's specs and refs are
accepted by their attributes (:class:`GpuBlocks`, :class:`UnitIds`, :class:`PageRef`).

Byte layout of a chunk in the pool: :mod:`.host_layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from spillway_engine.arith import cdiv
from spillway_engine.offloader.host_layout import GroupSlots, HostLayout


class PageRef(Protocol):
    """One layer's page in a group (vLLM's ``CanonicalKVCacheRef``)."""

    @property
    def tensor_idx(self) -> int: ...

    @property
    def page_size_bytes(self) -> int: ...


class GpuBlocks(Protocol):
    """GPU side of a transfer (vLLM's ``GPULoadStoreSpec``)."""

    @property
    def block_ids(self) -> np.ndarray: ...

    @property
    def group_sizes(self) -> Sequence[int]: ...

    @property
    def block_indices(self) -> Sequence[int]: ...


class UnitIds(Protocol):
    """Host side of a transfer: unit ids (vLLM's ``BlockIDsLoadStoreSpec``)."""

    @property
    def block_ids(self) -> np.ndarray: ...


@dataclass(frozen=True)
class Ref:
    """A :class:`PageRef` for callers without vLLM."""

    tensor_idx: int
    page_size_bytes: int


@dataclass(frozen=True)
class Blocks:
    """A :class:`GpuBlocks` (and, with only ``block_ids``, :class:`UnitIds`) without vLLM."""

    block_ids: np.ndarray
    group_sizes: Sequence[int] = ()
    block_indices: Sequence[int] = ()


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class CopyPlan:
    """Byte-range copies of one transfer.

    ``gpu_offsets`` are relative to the start of block 0 of canonical tensor
    ``tensor_idx[i]``; ``host_offsets`` to the start of unit 0 of this worker's pool
    view. ``src_offsets``/``dst_offsets`` give the same arrays in copy direction.
    """

    store: bool
    tensor_idx: np.ndarray
    gpu_offsets: np.ndarray
    host_offsets: np.ndarray
    sizes: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def src_offsets(self) -> np.ndarray:
        return self.gpu_offsets if self.store else self.host_offsets

    @property
    def dst_offsets(self) -> np.ndarray:
        return self.host_offsets if self.store else self.gpu_offsets

    def __len__(self) -> int:
        return len(self.sizes)


def chunk_stream_bytes(refs: Sequence[PageRef], blocks_per_chunk: int) -> int:
    """Bytes of one chunk's stream on one worker: every ref's unpadded page per block."""
    return sum(r.page_size_bytes for r in refs) * blocks_per_chunk


def check_layout_agreement(layout: HostLayout, group_refs: Sequence[Sequence[PageRef]]) -> None:
    """The scheduler's layout and this worker's KV caches must agree byte for byte.

    ``group_refs`` is indexed by offloaded position (``GroupSlots.position``).
    """
    for i, g in enumerate(layout.groups):
        if g.position != i:
            raise ValueError(
                f"host layout lists group {g.group_id} at index {i} but its position is "
                f"{g.position}: groups must be in offloaded-position order"
            )
    if len(group_refs) != len(layout.groups):
        raise ValueError(
            f"the worker has layer refs for {len(group_refs)} offloaded groups, the host "
            f"layout has {len(layout.groups)} groups "
            f"(vLLM group ids {[g.group_id for g in layout.groups]})"
        )
    for g, refs in zip(layout.groups, group_refs, strict=True):
        actual = chunk_stream_bytes(refs, g.blocks_per_chunk)
        if actual != g.chunk_bytes:
            raise ValueError(
                f"KV-cache group {g.group_id} (offloaded position {g.position}): the "
                f"worker's {len(refs)} layer pages x {g.blocks_per_chunk} blocks per "
                f"chunk = {actual} bytes per chunk, but the host layout's chunk_bytes "
                f"is {g.chunk_bytes}"
            )
        if g.chunk_bytes > g.units * layout.unit_bytes:
            raise ValueError(
                f"KV-cache group {g.group_id}: chunk_bytes {g.chunk_bytes} does not fit "
                f"in {g.units} units of {layout.unit_bytes} bytes"
            )


def _group_pieces(
    g: GroupSlots,
    refs: Sequence[PageRef],
    gpu_ids: np.ndarray,
    first_block: int,
    unit_ids: np.ndarray,
    unit_bytes: int,
    gpu_row_bytes: np.ndarray,
    host_row_bytes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tensor_idx, gpu_offset, host_offset, size) of one group's pieces, ref-major."""
    bpc = g.blocks_per_chunk
    pos = first_block % bpc + np.arange(len(gpu_ids), dtype=np.int64)
    chunk, in_chunk = pos // bpc, pos % bpc
    units = unit_ids.reshape(-1, g.units)

    pages = np.array([r.page_size_bytes for r in refs], dtype=np.int64)
    tensors = np.array([r.tensor_idx for r in refs], dtype=np.int64)
    keep = pages > 0
    pages, tensors = pages[keep], tensors[keep]
    # where each ref's run of bpc pages starts in the chunk stream
    ref_start = np.cumsum(pages * bpc) - pages * bpc

    shape = (len(pages), len(gpu_ids))
    seg_start = (ref_start[:, None] + in_chunk[None, :] * pages[:, None]).ravel()
    seg_len = np.broadcast_to(pages[:, None], shape).ravel()
    seg_chunk = np.broadcast_to(chunk[None, :], shape).ravel()
    seg_tensor = np.broadcast_to(tensors[:, None], shape).ravel()
    seg_gpu = (gpu_ids[None, :] * gpu_row_bytes[tensors][:, None]).ravel()

    # A page may straddle unit boundaries: cut it at each one.
    first_unit = seg_start // unit_bytes
    count = (seg_start + seg_len - 1) // unit_bytes - first_unit + 1
    seg = np.repeat(np.arange(len(count)), count)
    k = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    unit = first_unit[seg] + k
    start = np.maximum(seg_start[seg], unit * unit_bytes)
    end = np.minimum(seg_start[seg] + seg_len[seg], (unit + 1) * unit_bytes)
    host = units[seg_chunk[seg], unit] * host_row_bytes + (start - unit * unit_bytes)
    gpu = seg_gpu[seg] + (start - seg_start[seg])
    return seg_tensor[seg], gpu, host, end - start


def _coalesce(
    t: np.ndarray, gpu: np.ndarray, host: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge pieces contiguous on both sides (fewer descriptors, same bytes)."""
    if len(size) < 2:
        return t, gpu, host, size
    join = (t[1:] == t[:-1]) & (gpu[1:] == gpu[:-1] + size[:-1])
    join &= host[1:] == host[:-1] + size[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~join)))
    return t[starts], gpu[starts], host[starts], np.add.reduceat(size, starts)


def _chunks_per_group(
    layout: HostLayout, sizes: list[int], first_blocks: list[int], unit_ids: np.ndarray
) -> list[int]:
    """The chunks each group's blocks touch; raises ValueError when the CPU spec does not
    name exactly their units, or names a unit outside the pool."""
    groups = layout.groups
    chunks = [
        cdiv(b % g.blocks_per_chunk + n, g.blocks_per_chunk) if n else 0
        for g, n, b in zip(groups, sizes, first_blocks, strict=True)
    ]
    expected = sum(c * g.units for c, g in zip(chunks, groups, strict=True))
    if expected != len(unit_ids):
        detail = ", ".join(
            f"group {g.group_id}: {c} chunks x {g.units} units"
            for c, g in zip(chunks, groups, strict=True)
        )
        raise ValueError(
            f"CPU spec names {len(unit_ids)} units, the GPU spec needs {expected} ({detail})"
        )
    if len(unit_ids) and (unit_ids.min() < 0 or unit_ids.max() >= layout.num_units):
        raise ValueError(f"CPU spec unit ids out of range [0, {layout.num_units})")
    return chunks


def plan_copies(
    layout: HostLayout,
    group_refs: Sequence[Sequence[PageRef]],
    gpu_spec: GpuBlocks,
    cpu_spec: UnitIds,
    *,
    store: bool,
    gpu_row_bytes: Sequence[int],
    host_row_bytes: int | None = None,
    coalesce: bool = True,
) -> CopyPlan:
    """Byte copies moving ``gpu_spec``'s blocks to (``store``) or from the units of
    ``cpu_spec``.

    ``group_refs[i]``: layer refs of offloaded group ``i`` (page sizes, tensor index).
    ``gpu_row_bytes[t]``: bytes between consecutive blocks of canonical tensor ``t``.
    ``host_row_bytes``: bytes between consecutive units of the pool view (default
    ``unit_bytes``; ``unit_bytes * copies`` for a shared-region slot view).
    Raises ValueError when the specs do not match the layout.
    """
    groups = layout.groups
    sizes = list(gpu_spec.group_sizes)
    first_blocks = list(gpu_spec.block_indices)
    if not len(sizes) == len(first_blocks) == len(groups) == len(group_refs):
        raise ValueError(
            f"GPU spec has {len(sizes)} group sizes and {len(first_blocks)} block "
            f"indices, the layout {len(groups)} groups, the worker {len(group_refs)} "
            "groups of refs"
        )
    gpu_ids_all = np.asarray(gpu_spec.block_ids, dtype=np.int64)
    unit_ids_all = np.asarray(cpu_spec.block_ids, dtype=np.int64)
    row_bytes = np.asarray(gpu_row_bytes, dtype=np.int64)
    host_row = layout.unit_bytes if host_row_bytes is None else host_row_bytes
    # Count units first so a mismatch fails before any copy.
    chunks = _chunks_per_group(layout, sizes, first_blocks, unit_ids_all)

    parts: list[tuple[np.ndarray, ...]] = []
    gpu_off = unit_off = 0
    for g, refs, n, first, c in zip(groups, group_refs, sizes, first_blocks, chunks, strict=True):
        if n == 0:
            continue
        stream = chunk_stream_bytes(refs, g.blocks_per_chunk)
        if stream > g.units * layout.unit_bytes:
            raise ValueError(
                f"KV-cache group {g.group_id}: {stream} bytes per chunk do not fit in "
                f"{g.units} units of {layout.unit_bytes} bytes"
            )
        parts.append(
            _group_pieces(
                g,
                refs,
                gpu_ids_all[gpu_off : gpu_off + n],
                first,
                unit_ids_all[unit_off : unit_off + c * g.units],
                layout.unit_bytes,
                row_bytes,
                host_row,
            )
        )
        gpu_off += n
        unit_off += c * g.units

    if parts:
        t, gpu, host, size = (np.concatenate(a) for a in zip(*parts, strict=True))
    else:
        t = gpu = host = size = np.zeros(0, dtype=np.int64)
    if coalesce:
        t, gpu, host, size = _coalesce(t, gpu, host, size)
    return CopyPlan(store=store, tensor_idx=t, gpu_offsets=gpu, host_offsets=host, sizes=size)


# --------------------------------------------------------------------------- execution


def flat_bytes(tensor: torch.Tensor, num_rows: int, row_bytes: int, last_row: int) -> torch.Tensor:
    """1-D int8 view from the tensor's first row to the end of its last row's data."""
    nbytes = (num_rows - 1) * row_bytes + last_row if num_rows else 0
    offset = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()
    if offset + nbytes > storage.nbytes():
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} does not back {num_rows} rows of "
            f"{row_bytes} bytes"
        )
    return torch.empty(0, dtype=torch.int8, device=tensor.device).set_(
        storage, offset, (nbytes,), (1,)
    )


def copy_pointers(
    plan: CopyPlan, gpu_bases: Sequence[int], host_base: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_ptrs, dst_ptrs, sizes): one raw-pointer copy per piece of ``plan``.

    ``gpu_bases[t]``: address of block 0 of canonical tensor ``t``; ``host_base``:
    address of unit 0 of the pool view. Contiguous int64 arrays, the form vLLM's
    ``swap_blocks_batch`` takes on CUDA (and what ``cuMemcpyBatchAsync`` reads).
    """
    bases = np.asarray(gpu_bases, dtype=np.int64)
    gpu_ptrs = bases[plan.tensor_idx] + plan.gpu_offsets
    host_ptrs = host_base + plan.host_offsets
    src, dst = (gpu_ptrs, host_ptrs) if plan.store else (host_ptrs, gpu_ptrs)
    return (
        np.ascontiguousarray(src, dtype=np.int64),
        np.ascontiguousarray(dst, dtype=np.int64),
        np.ascontiguousarray(plan.sizes, dtype=np.int64),
    )


def copy_pieces(
    plan: CopyPlan,
    gpu_flat: Sequence[torch.Tensor],
    host_flat: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> None:
    """Execute ``plan`` piece by piece with tensor copies (``flat_bytes`` views)."""
    for t, g, h, n in zip(
        plan.tensor_idx.tolist(),
        plan.gpu_offsets.tolist(),
        plan.host_offsets.tolist(),
        plan.sizes.tolist(),
        strict=True,
    ):
        gpu = gpu_flat[t][g : g + n]
        if plan.store:
            host_flat[h : h + n].copy_(gpu, non_blocking=non_blocking)
        else:
            gpu.copy_(host_flat[h : h + n], non_blocking=non_blocking)
