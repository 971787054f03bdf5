"""Spillway's worker side: moves KV pages between the GPU caches and the host unit pool.

The byte layout of a chunk in the pool is defined in :mod:`.layout`. ``plan_copies``
turns one transfer (a GPU spec and a CPU spec of unit ids) into byte-range copies and is
device-agnostic; ``SpillwayHostWorker`` executes those plans (CUDA streams and vLLM's
batched memcpy on the GPU, plain tensor copies on the CPU) behind vLLM's
``OffloadingWorker`` interface; ``allocate_host_pool`` builds this worker's view of the
pool.

Transfer semantics follow upstream's CPU worker, with per-group chunk sizes and chunks
of several units:

- GPU spec: ``block_ids`` grouped by ``group_sizes`` (one entry per offloaded group,
  in ``HostLayout.groups`` order); block ``k`` of group ``i`` is logical block
  ``block_indices[i] + k`` of the request, i.e. position
  ``p = block_indices[i] % bpc + k`` of the group's chunk stream (chunk ``p // bpc``,
  block-in-chunk ``p % bpc``).
- CPU spec: ``block_ids`` are unit ids; per group in order, per chunk it touches in
  order, that group's ``GroupSlots.units`` unit ids.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from spillway_engine.arith import cdiv, round_up
from spillway_engine.offloader.host_layout import GroupSlots, HostLayout
from spillway_engine.planner.offload_geometry import host_copies

logger = logging.getLogger(__name__)

# Split the shared region into this many shm files so ranks pre-fault them in
# parallel (upstream's CPU spec does the same).
_REGION_SEGMENTS = 32


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


def chunk_stream_bytes(refs: Sequence[CanonicalKVCacheRef], blocks_per_chunk: int) -> int:
    """Bytes of one chunk's stream on one worker: every ref's unpadded page per block."""
    return sum(r.page_size_bytes for r in refs) * blocks_per_chunk


def check_layout_agreement(
    layout: HostLayout, group_refs: Sequence[Sequence[CanonicalKVCacheRef]]
) -> None:
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
    refs: Sequence[CanonicalKVCacheRef],
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


def plan_copies(
    layout: HostLayout,
    group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    gpu_spec: GPULoadStoreSpec,
    cpu_spec: BlockIDsLoadStoreSpec,
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
    chunks = [
        cdiv(b % g.blocks_per_chunk + n, g.blocks_per_chunk) if n else 0
        for g, n, b in zip(groups, sizes, first_blocks, strict=True)
    ]
    expected = sum(c * g.units for c, g in zip(chunks, groups, strict=True))
    if expected != len(unit_ids_all):
        detail = ", ".join(
            f"group {g.group_id}: {c} chunks x {g.units} units"
            for c, g in zip(chunks, groups, strict=True)
        )
        raise ValueError(
            f"CPU spec names {len(unit_ids_all)} units, the GPU spec needs {expected} ({detail})"
        )
    if len(unit_ids_all) and (unit_ids_all.min() < 0 or unit_ids_all.max() >= layout.num_units):
        raise ValueError(f"CPU spec unit ids out of range [0, {layout.num_units})")

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


def _flat_bytes(tensor: torch.Tensor, num_rows: int, row_bytes: int, last_row: int) -> torch.Tensor:
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


@dataclass
class _InFlight:
    job_id: int
    num_bytes: int
    start: Any  # torch.cuda.Event
    end: Any
    # descriptor arrays must outlive the asynchronous copy
    keepalive: tuple[Any, ...] = field(default_factory=tuple)


class _CudaLane:
    """One direction's dedicated stream; copies run (and finish) in submission order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pending: deque[_InFlight] = deque()

    def finished(self) -> list[TransferResult]:
        out = []
        while self.pending and self.pending[0].end.query():
            job = self.pending.popleft()
            seconds = job.start.elapsed_time(job.end) * 1e-3
            out.append(TransferResult(job.job_id, True, job.num_bytes, seconds))
        return out

    def wait(self, job_ids: set[int]) -> None:
        for job in self.pending:
            if job.job_id in job_ids:
                job.end.synchronize()

    def drain(self) -> None:
        if self.pending:
            self.pending[-1].end.synchronize()
        self.pending.clear()


def _batched_memcpy() -> Callable[..., None] | None:
    """vLLM's cuMemcpyBatchAsync op (pointer arrays), if this build registers it."""
    try:
        from vllm import _custom_ops as ops

        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018  raises if not built
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ops.swap_blocks_batch


class SpillwayHostWorker(OffloadingWorker):
    """Moves KV pages between the worker's KV caches and its view of the host pool.

    ``pool``: int8 CPU tensor (num_units, unit_bytes), rows may be strided (a slot of
    the shared region). ``release`` (e.g. ``allocate_host_pool``'s cleanup) runs once
    at shutdown, after every transfer has finished and the worker dropped its views.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        layout: HostLayout,
        pool: torch.Tensor,
        *,
        release: Callable[[], None] | None = None,
    ) -> None:
        if pool.dtype != torch.int8 or pool.device.type != "cpu" or pool.ndim != 2:
            raise ValueError(
                f"host pool must be a 2-D int8 CPU tensor, got {pool.dtype} "
                f"{pool.ndim}-D on {pool.device}"
            )
        if tuple(pool.shape) != (layout.num_units, layout.unit_bytes) or (
            pool.numel() and pool.stride(1) != 1
        ):
            raise ValueError(
                f"host pool view has shape {tuple(pool.shape)} stride {pool.stride()}, the "
                f"layout needs ({layout.num_units}, {layout.unit_bytes}) with unit stride"
            )
        if not kv_caches.tensors:
            raise ValueError("no KV-cache tensors to offload")
        # Indexed by offloaded position, not vLLM group id: the connector builds it
        # over get_offloading_group_ids() in order, as upstream's worker assumes.
        self._group_refs = kv_caches.group_data_refs
        check_layout_agreement(layout, self._group_refs)
        self.layout = layout

        self._num_blocks: list[int] = []
        self._gpu_row_bytes: list[int] = []
        self._gpu_flat: list[torch.Tensor] = []
        for t_idx, kv in enumerate(kv_caches.tensors):
            t = kv.tensor
            row = t.stride(0) * t.element_size()
            if kv.page_size_bytes > row:
                raise ValueError(
                    f"KV tensor {t_idx}: page of {kv.page_size_bytes} bytes exceeds its "
                    f"block stride of {row} bytes"
                )
            self._num_blocks.append(t.shape[0])
            self._gpu_row_bytes.append(row)
            self._gpu_flat.append(_flat_bytes(t, t.shape[0], row, kv.page_size_bytes))
        for g, refs in zip(layout.groups, self._group_refs, strict=True):
            for r in refs:
                if not 0 <= r.tensor_idx < len(kv_caches.tensors):
                    raise ValueError(f"group {g.group_id}: ref to missing tensor {r.tensor_idx}")
                page = kv_caches.tensors[r.tensor_idx].page_size_bytes
                if r.page_size_bytes > page:
                    raise ValueError(
                        f"group {g.group_id}: ref page of {r.page_size_bytes} bytes exceeds "
                        f"tensor {r.tensor_idx}'s page of {page} bytes"
                    )
        self._min_blocks = min(self._num_blocks)

        self._pool = pool
        self._host_row_bytes = pool.stride(0) if pool.numel() else layout.unit_bytes
        self._pool_flat = _flat_bytes(
            pool, layout.num_units, self._host_row_bytes, layout.unit_bytes
        )
        self._release = release

        devices = {kv.tensor.device for kv in kv_caches.tensors}
        if len(devices) != 1:
            raise ValueError(f"KV tensors span several devices: {sorted(map(str, devices))}")
        (device,) = devices
        self._cuda = device.type == "cuda"
        self._done: list[TransferResult] = []  # CPU path: finished at submit
        self._lanes: dict[str, _CudaLane] = {}
        self._memcpy: Callable[..., None] | None = None
        if self._cuda:
            # Own stream per direction, plus one so expedited loads skip the queue.
            self._lanes = {k: _CudaLane(device) for k in ("store", "load", "expedited")}
            self._memcpy = _batched_memcpy()
            if self._memcpy is None:
                logger.warning("vLLM's batched memcpy op is missing; copying piece by piece")

    # ------------------------------------------------------------------ OffloadingWorker

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """GPU -> host."""
        return self._submit(job_id, src_spec, dst_spec, store=True, lane="store")

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Host -> GPU."""
        lane = "expedited" if expedited else "load"
        return self._submit(job_id, dst_spec, src_spec, store=False, lane=lane)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        for lane in self._lanes.values():
            done += lane.finished()
        return done

    def wait(self, job_ids: set[int]) -> None:
        for lane in self._lanes.values():
            lane.wait(job_ids)

    def shutdown(self) -> None:
        try:
            for lane in self._lanes.values():
                lane.drain()
        finally:
            self._lanes = {}
            self._done = []
            # drop every view of the pool so the release can unmap it
            self._pool_flat = self._pool = None  # type: ignore[assignment]
            self._gpu_flat = []
            release, self._release = self._release, None
            if release is not None:
                release()

    # ------------------------------------------------------------------ internals

    def plan(self, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec, store: bool) -> CopyPlan:
        if not isinstance(gpu_spec, GPULoadStoreSpec):
            raise TypeError(f"expected a GPULoadStoreSpec, got {type(gpu_spec).__name__}")
        if not isinstance(cpu_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"expected a CPU spec of unit ids, got {type(cpu_spec).__name__}")
        ids = gpu_spec.block_ids
        if len(ids) and (ids.min() < 0 or ids.max() >= self._min_blocks):
            raise ValueError(f"GPU block ids out of range [0, {self._min_blocks})")
        return plan_copies(
            self.layout,
            self._group_refs,
            gpu_spec,
            cpu_spec,
            store=store,
            gpu_row_bytes=self._gpu_row_bytes,
            host_row_bytes=self._host_row_bytes,
        )

    def _submit(
        self,
        job_id: int,
        gpu_spec: GPULoadStoreSpec,
        cpu_spec: LoadStoreSpec,
        *,
        store: bool,
        lane: str,
    ) -> bool:
        if self._pool is None:
            raise RuntimeError("worker is shut down")
        plan = self.plan(gpu_spec, cpu_spec, store)
        if self._cuda:
            self._submit_cuda(job_id, plan, self._lanes[lane])
        else:
            t0 = time.perf_counter()
            self._copy_pieces(plan, non_blocking=False)
            seconds = time.perf_counter() - t0
            self._done.append(TransferResult(job_id, True, plan.num_bytes, seconds))
        return True

    def _copy_pieces(self, plan: CopyPlan, non_blocking: bool) -> None:
        host = self._pool_flat
        for t, g, h, n in zip(
            plan.tensor_idx.tolist(),
            plan.gpu_offsets.tolist(),
            plan.host_offsets.tolist(),
            plan.sizes.tolist(),
            strict=True,
        ):
            gpu = self._gpu_flat[t][g : g + n]
            if plan.store:
                host[h : h + n].copy_(gpu, non_blocking=non_blocking)
            else:
                gpu.copy_(host[h : h + n], non_blocking=non_blocking)

    def _submit_cuda(self, job_id: int, plan: CopyPlan, lane: _CudaLane) -> None:
        stream = lane.stream
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        # Stores read KV the model is still writing; loads must land after pending
        # writes (zeroing) to their blocks: both order after the compute stream.
        stream.wait_stream(torch.cuda.current_stream(lane.device))
        keepalive: tuple[Any, ...] = ()
        with torch.cuda.stream(stream):
            start.record(stream)
            if len(plan) and self._memcpy is not None:
                bases = np.array([f.data_ptr() for f in self._gpu_flat], dtype=np.int64)
                gpu_ptrs = bases[plan.tensor_idx] + plan.gpu_offsets
                host_ptrs = self._pool_flat.data_ptr() + plan.host_offsets
                src, dst = (gpu_ptrs, host_ptrs) if plan.store else (host_ptrs, gpu_ptrs)
                keepalive = (
                    torch.from_numpy(np.ascontiguousarray(src, dtype=np.int64)),
                    torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64)),
                    torch.from_numpy(np.ascontiguousarray(plan.sizes, dtype=np.int64)),
                )
                # host memory is never written by a GPU stream: loads may prefetch it
                self._memcpy(*keepalive, is_src_access_order_any=not plan.store)
            elif len(plan):
                self._copy_pieces(plan, non_blocking=True)
            end.record(stream)
        lane.pending.append(_InFlight(job_id, plan.num_bytes, start, end, keepalive))


# --------------------------------------------------------------------------- host pool


def _all_workers_barrier() -> None:
    """Every worker rank has mapped the region once this returns (gloo CPU group)."""
    from vllm.distributed.parallel_state import get_inner_dp_world_group, get_world_group

    try:
        group = get_inner_dp_world_group()
    except AssertionError:  # no inner DP group in this deployment
        group = get_world_group()
    group.barrier()


def _platform_shares_region() -> bool:
    # Same platforms as upstream's CPU spec (it keeps ROCm on private tensors).
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def allocate_host_pool(
    layout: HostLayout,
    engine_id: str,
    rank: int,
    world_size: int,
    replicated: bool,
    *,
    shared: bool | None = None,
    barrier: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, Callable[[], None]]:
    """This worker's (num_units, unit_bytes) int8 view of the host pool, and its cleanup.

    On CUDA (or ``shared=True``) the pool is vLLM's ``SharedOffloadRegion`` in /dev/shm:
    ``num_units`` rows of ``unit_bytes * copies`` bytes (page-rounded), one
    ``unit_bytes`` slot per rank; a replicated layout has one slot that rank 0 writes
    and every rank reads. ``barrier`` defaults to vLLM's all-workers barrier. Elsewhere
    it is a private zeroed tensor. Drop every reference to the view before cleanup.
    """
    copies = host_copies(world_size, replicated)
    if layout.copies != copies:
        raise ValueError(
            f"host layout has {layout.copies} copies per unit row; "
            f"{'replicated' if replicated else 'per-rank'} layout over {world_size} "
            f"ranks needs {copies}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if shared is None:
        shared = _platform_shares_region()
    if not shared or layout.num_units == 0:
        if replicated and world_size > 1:
            # Other ranks would read their own zeros, never rank 0's writes.
            raise ValueError("a replicated host layout needs the shared /dev/shm region")
        pool = torch.zeros(
            (layout.num_units, layout.unit_bytes),
            dtype=torch.int8,
            pin_memory=torch.cuda.is_available(),
        )
        return pool, lambda: None

    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    row = round_up(layout.unit_bytes * copies, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT)
    region = SharedOffloadRegion(
        engine_id=engine_id,
        num_chunks=layout.num_units,
        rank=0 if replicated else rank,
        kv_bytes_per_chunk=row,
        cpu_page_size=layout.unit_bytes,
        barrier=barrier if barrier is not None else _all_workers_barrier,
        num_segments=_REGION_SEGMENTS,
        # every rank maps the same slot: split its pre-faulting across them
        populate_shard=(rank, world_size) if replicated else None,
    )
    try:
        pool = region.create_next_worker_view(layout.unit_bytes)
        if torch.cuda.is_available():
            from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region

            # pins only this rank's slots where that saves enough; stays pageable on failure
            pin_mmap_region(region, worker_slot_only=True)
    except Exception:
        region.cleanup()
        raise
    return pool, region.cleanup
