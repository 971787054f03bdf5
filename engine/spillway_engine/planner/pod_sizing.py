"""Pod memory for a vLLM engine with a CPU offload pool in ``/dev/shm``.

The pool is one shared mmap in ``/dev/shm`` (tmpfs); tmpfs pages are charged to the
container's memory cgroup, so the pool counts against the memory limit, once, however
many workers map it. Each data-parallel engine in the pod has its own pool.

Terms (all per pod, bytes):

``shm_bytes``      = DP x region + ``SHM_QUEUE_BYTES``
                     region = the offload pool actually mapped (rows x chunks);
                     ``SHM_QUEUE_BYTES``: vLLM's shared-memory message queues and
                     torch multiprocessing buffers also live in /dev/shm.
``memory_request`` = shm_bytes + DP x (``ENGINE_PROCESS_BYTES`` +
                     workers x ``WORKER_PROCESS_BYTES``)
                     ``ENGINE_PROCESS_BYTES``: API server + engine core (tokenizer,
                     scheduler, the offload manager's per-chunk bookkeeping);
                     ``WORKER_PROCESS_BYTES``: one GPU worker process (CUDA context, torch,
                     NCCL/gloo buffers, pinned staging, safetensors page cache while loading).
``memory_limit``   = memory_request + headroom, headroom =
                     max(``MIN_HEADROOM_BYTES``, ``HEADROOM_FRACTION`` x request):
                     pinned pool pages cannot be reclaimed, so the kernel needs slack
                     before the OOM killer picks the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from spillway_engine.arith import round_up

GIB = 2**30
MIB = 2**20

#: /dev/shm besides the pool: vLLM's MessageQueue rings and torch IPC buffers.
SHM_QUEUE_BYTES = 1 * GIB
#: API server + engine core process RSS for one data-parallel engine.
ENGINE_PROCESS_BYTES = 4 * GIB
#: One GPU worker process RSS (CUDA context, torch, NCCL, pinned staging, load cache).
WORKER_PROCESS_BYTES = 6 * GIB
#: Slack above the request before the limit.
MIN_HEADROOM_BYTES = 2 * GIB
HEADROOM_FRACTION = Fraction(1, 20)


class PodSizingError(ValueError):
    pass


@dataclass(frozen=True)
class PodMemory:
    shm_bytes: int
    memory_request_bytes: int
    memory_limit_bytes: int
    pool_bytes_per_engine: int
    process_overhead_bytes: int
    headroom_bytes: int


def headroom(request_bytes: int) -> int:
    """Slack above the request, in whole MiB."""
    return round_up(max(MIN_HEADROOM_BYTES, int(HEADROOM_FRACTION * request_bytes)), MIB)


def overhead_bytes(workers_per_engine: int, data_parallel_size: int) -> int:
    """Process memory of all engines in the pod (excludes the pool and shm queues)."""
    return data_parallel_size * (ENGINE_PROCESS_BYTES + workers_per_engine * WORKER_PROCESS_BYTES)


def size_pod(region_bytes: int, workers_per_engine: int, data_parallel_size: int) -> PodMemory:
    """Pod memory for a pool region of ``region_bytes`` per engine."""
    if region_bytes < 0 or workers_per_engine < 1 or data_parallel_size < 1:
        raise PodSizingError("pool, worker count and data-parallel size must be positive")
    shm = round_up(data_parallel_size * region_bytes + SHM_QUEUE_BYTES, MIB)
    processes = overhead_bytes(workers_per_engine, data_parallel_size)
    request = shm + processes
    slack = headroom(request)
    return PodMemory(
        shm_bytes=shm,
        memory_request_bytes=request,
        memory_limit_bytes=request + slack,
        pool_bytes_per_engine=region_bytes,
        process_overhead_bytes=processes,
        headroom_bytes=slack,
    )


def max_pool_bytes(memory_limit: int, workers_per_engine: int, data_parallel_size: int) -> int:
    """The largest pool per engine whose pod fits ``memory_limit`` (before row rounding).

    Inverts :func:`size_pod`: the largest request r with r + headroom(r) <= limit is
    min(limit - MIN_HEADROOM, limit / (1 + HEADROOM_FRACTION)).
    """
    request = min(
        memory_limit - MIN_HEADROOM_BYTES,
        int(Fraction(memory_limit) / (1 + HEADROOM_FRACTION)),
    )
    fixed = round_up(SHM_QUEUE_BYTES, MIB) + overhead_bytes(workers_per_engine, data_parallel_size)
    pool = (request - fixed) // data_parallel_size
    # MiB rounding of shm and headroom can overshoot by a MiB or two: step back.
    while pool > 0 and size_pod(pool, workers_per_engine, data_parallel_size).memory_limit_bytes > (
        memory_limit
    ):
        pool -= MIB
    if pool <= 0:
        raise PodSizingError(
            f"a memory limit of {memory_limit} bytes leaves no room for an offload pool: "
            f"the engine processes and headroom alone need about {fixed + headroom(fixed)} "
            "bytes"
        )
    return pool


def max_pool_bytes_for_node(
    node_allocatable_bytes: int,
    gpus_per_node: int,
    workers_per_engine: int,
    data_parallel_size: int,
) -> int:
    """The largest pool per engine when the node's GPUs are filled with identical pods.

    ``node_allocatable_bytes`` is the node's allocatable memory (the kubelet already
    keeps system-reserved memory out of it); the pods split it evenly.
    """
    gpus_per_pod = workers_per_engine * data_parallel_size
    pods = gpus_per_node // gpus_per_pod
    if pods < 1:
        raise PodSizingError(f"a pod needs {gpus_per_pod} GPUs but the node has {gpus_per_node}")
    return max_pool_bytes(node_allocatable_bytes // pods, workers_per_engine, data_parallel_size)
