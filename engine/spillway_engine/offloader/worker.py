"""Spillway's worker side: moves KV pages between the GPU caches and the host unit pool.

The byte layout of a chunk in the pool is defined in :mod:`.host_layout`. ``plan_copies``
(:mod:`.copy_plan`, no vLLM) turns one transfer (a GPU spec and a CPU spec of unit ids)
into byte-range copies and is device-agnostic; ``SpillwayHostWorker`` executes those
plans (CUDA lanes of :mod:`.cuda_lanes` and vLLM's batched memcpy on the GPU, plain
tensor copies on the CPU) behind vLLM's ``OffloadingWorker`` interface;
``allocate_host_pool`` builds this worker's view of the pool.

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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from spillway_engine.arith import round_up
from spillway_engine.offloader.copy_plan import (
    CopyPlan,
    check_layout_agreement,
    chunk_stream_bytes,
    copy_pieces,
    flat_bytes,
    plan_copies,
)
from spillway_engine.offloader.cuda_lanes import CudaLane, batched_copy
from spillway_engine.offloader.geometry import LayerPage
from spillway_engine.offloader.host_layout import HostLayout, shared_region_forced
from spillway_engine.planner.offload_geometry import host_copies

__all__ = [
    "CopyPlan",
    "SpillwayHostWorker",
    "allocate_host_pool",
    "check_layout_agreement",
    "chunk_stream_bytes",
    "plan_copies",
    "unpack_caches",
]

logger = logging.getLogger(__name__)

# Split the shared region into this many shm files so ranks pre-fault them in
# parallel (upstream's CPU spec does the same).
_REGION_SEGMENTS = 32


# --------------------------------------------------------------------------- execution


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

    ``link_s`` (an emulated GPU): seconds a transfer of n bytes takes on the modelled
    host link. The bytes still move at submit, but a job is reported finished only
    when the link, one queue per direction as on a full-duplex PCIe link, would have
    carried it -- so vLLM's scheduler waits for loads as long as on the GPU.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        layout: HostLayout,
        pool: torch.Tensor,
        *,
        release: Callable[[], None] | None = None,
        link_s: Callable[[int], float] | None = None,
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
            self._gpu_flat.append(flat_bytes(t, t.shape[0], row, kv.page_size_bytes))
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
        self._pool_flat = flat_bytes(
            pool, layout.num_units, self._host_row_bytes, layout.unit_bytes
        )
        self._release = release

        devices = {kv.tensor.device for kv in kv_caches.tensors}
        if len(devices) != 1:
            raise ValueError(f"KV tensors span several devices: {sorted(map(str, devices))}")
        (device,) = devices
        self._cuda = device.type == "cuda"
        self._done: list[TransferResult] = []  # CPU path: finished at submit
        self._link_s = link_s
        # modelled link: (due time, result) per job, and when each direction is free
        self._in_flight: list[tuple[float, TransferResult]] = []
        self._link_free: dict[bool, float] = {}
        self._lanes: dict[str, CudaLane] = {}
        self._memcpy: Callable[..., None] | None = None
        if self._cuda:
            # Own stream per direction, plus one so expedited loads skip the queue.
            self._lanes = {k: CudaLane(device) for k in ("store", "load", "expedited")}
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
        self._land(time.monotonic())
        done, self._done = self._done, []
        for lane in self._lanes.values():
            done += [
                TransferResult(r.job_id, True, r.num_bytes, r.seconds) for r in lane.finished()
            ]
        return done

    def wait(self, job_ids: set[int]) -> None:
        due = [t for t, r in self._in_flight if r.job_id in job_ids]
        if due:
            time.sleep(max(0.0, max(due) - time.monotonic()))
            self._land(max(due))
        for lane in self._lanes.values():
            lane.wait(job_ids)

    def _land(self, now: float) -> None:
        """Jobs the modelled link has carried by ``now`` become finished."""
        if self._in_flight:
            self._done += [r for t, r in self._in_flight if t <= now]
            self._in_flight = [(t, r) for t, r in self._in_flight if t > now]

    def shutdown(self) -> None:
        try:
            for lane in self._lanes.values():
                lane.drain()
        finally:
            self._lanes = {}
            self._done = []
            self._in_flight = []
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
            if self._link_s is None:
                self._done.append(TransferResult(job_id, True, plan.num_bytes, seconds))
            else:
                now = time.monotonic()
                due = max(now, self._link_free.get(store, now)) + self._link_s(plan.num_bytes)
                self._link_free[store] = due
                self._in_flight.append(
                    (due, TransferResult(job_id, True, plan.num_bytes, due - now))
                )
        return True

    def _copy_pieces(self, plan: CopyPlan, non_blocking: bool) -> None:
        copy_pieces(plan, self._gpu_flat, self._pool_flat, non_blocking=non_blocking)

    def pointer_bases(self) -> tuple[list[int], int]:
        """(gpu_bases, host_base): the addresses ``copy_pointers`` offsets plans from."""
        return [f.data_ptr() for f in self._gpu_flat], self._pool_flat.data_ptr()

    def _copy_on_stream(self, plan: CopyPlan) -> tuple[Any, ...]:
        """Enqueue ``plan`` on the current stream; returns what must outlive the copy."""
        if self._memcpy is None:
            self._copy_pieces(plan, non_blocking=True)
            return ()
        gpu_bases, host_base = self.pointer_bases()
        return batched_copy(plan, gpu_bases, host_base, self._memcpy)

    def _submit_cuda(self, job_id: int, plan: CopyPlan, lane: CudaLane) -> None:
        lane.submit(job_id, plan, self._copy_on_stream)


# --------------------------------------------------------------------------- packed blocks


def unpack_caches(
    kv_caches: CanonicalKVCaches, pages: Sequence[Sequence[LayerPage]]
) -> CanonicalKVCaches:
    """Per-layer page views of vLLM's packed KV blocks, in place of the whole block.

    For a packed (block-outermost) allocation vLLM 0.33's ``register_kv_caches`` hands
    the spec one tensor, the packed blocks over the whole backing buffer, and every
    offloaded group one ref of the whole block. ``pages`` (``geometry.
    packed_layer_pages``) say where each group's layers sit in that buffer; the result
    has one tensor per distinct (offset, block stride) (layers of overlaid groups
    alias, as in vLLM's unpacked path) and per group its layers' refs of their unpadded
    pages -- the chunk stream the host layout (and the plan) sized.
    """
    refs_in = kv_caches.group_data_refs
    if len(kv_caches.tensors) != 1 or len(refs_in) != len(pages):
        raise ValueError(
            f"expected vLLM's packed KV caches (one tensor, {len(pages)} groups), got "
            f"{len(kv_caches.tensors)} tensors and {len(refs_in)} groups"
        )
    packed = kv_caches.tensors[0].tensor
    storage = packed.untyped_storage()  # the backing buffer KVCacheTensor offsets are in
    # (offset, block stride) -> [tensor index, blocks, largest page of its layers]
    regions: dict[tuple[int, int], list[int]] = {}
    group_refs: list[list[CanonicalKVCacheRef]] = []
    for group in pages:
        refs = []
        for p in group:
            region = regions.setdefault(
                (p.offset, p.block_stride), [len(regions), p.num_blocks, 0]
            )
            region[2] = max(region[2], p.page_bytes)
            refs.append(CanonicalKVCacheRef(tensor_idx=region[0], page_size_bytes=p.data_bytes))
        group_refs.append(refs)
    tensors = []
    for (offset, stride), (_, num_blocks, page) in regions.items():
        if num_blocks and offset + (num_blocks - 1) * stride + page > storage.nbytes():
            raise ValueError(
                f"a packed layer page at byte {offset} (block stride {stride}) runs past "
                f"the KV buffer's {storage.nbytes()} bytes"
            )
        view = torch.empty(0, dtype=torch.int8, device=packed.device).set_(
            storage, offset, (num_blocks, page), (stride, 1)
        )
        tensors.append(CanonicalKVCacheTensor(tensor=view, page_size_bytes=page))
    return CanonicalKVCaches(tensors=tensors, group_data_refs=group_refs)


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

    if shared_region_forced():
        return True
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
    scheduler_maps: bool = False,
) -> tuple[torch.Tensor, Callable[[], None]]:
    """This worker's (num_units, unit_bytes) int8 view of the host pool, and its cleanup.

    On CUDA (or ``shared=True``) the pool is vLLM's ``SharedOffloadRegion`` in /dev/shm:
    ``num_units`` rows of ``unit_bytes * copies`` bytes (page-rounded), one
    ``unit_bytes`` slot per rank; a replicated layout has one slot that rank 0 writes
    and every rank reads. ``barrier`` defaults to vLLM's all-workers barrier. Elsewhere
    it is a private zeroed tensor. Drop every reference to the view before cleanup.

    ``scheduler_maps``: the scheduler maps the region too (a disk tier under the pool
    copies its rows, :func:`scheduler_host_pool`), so it is always shared, and its file
    stays until the workers' cleanup instead of going once every worker mapped it.
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
    if scheduler_maps:
        shared = True
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

    region = _shared_region(
        layout,
        engine_id,
        0 if replicated else rank,
        # no barrier: the file is not unlinked once the workers mapped it
        barrier=None if scheduler_maps else barrier or _all_workers_barrier,
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


def scheduler_host_pool(layout: HostLayout, engine_id: str) -> Any:
    """The scheduler's mapping of the workers' host pool (vLLM's ``SharedOffloadRegion``
    with no rank), for a disk tier that copies whole rows; the same rows and segments
    as :func:`allocate_host_pool` lays out. The workers create the file (they start
    first); this joins it."""
    return _shared_region(layout, engine_id, None)


def _shared_region(layout: HostLayout, engine_id: str, rank: int | None, **options: Any) -> Any:
    """The host pool's ``SharedOffloadRegion`` as every process maps it: a row per unit
    (the unit of every rank copy, page-rounded) in ``_REGION_SEGMENTS`` files. The
    workers and the scheduler must map the same shape, so it is made here only."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    return SharedOffloadRegion(
        engine_id=engine_id,
        num_chunks=layout.num_units,
        rank=rank,
        kv_bytes_per_chunk=round_up(
            layout.unit_bytes * layout.copies, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
        ),
        cpu_page_size=layout.unit_bytes,
        num_segments=_REGION_SEGMENTS,
        **options,
    )
