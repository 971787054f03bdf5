"""Pod memory for a vLLM engine with a CPU offload pool in ``/dev/shm``.

The pool is one shared mmap in ``/dev/shm`` (tmpfs); tmpfs pages are charged to the
container's memory cgroup, so the pool counts against the memory limit, once, however
many workers map it. Each data-parallel engine in the pod has its own pool (vLLM
appends ``_dp<rank>`` to each engine's id, so their region files differ).

Terms (all per pod, bytes; W = GPU workers per engine, DP = engines per pod):

``shm_bytes``      = DP x region + :func:`shm_queue_bytes`
                     region = the offload pool actually mapped (rows x chunks; the
                     overshoot guard test holds vLLM's real mapping to it);
                     queues = vLLM's MessageQueue rings when the workers are processes
                     of their own (one broadcast ring plus one response ring per
                     worker, ``MQ_RING_BYTES`` each, filled as used) +
                     ``SHM_OTHER_BYTES`` (semaphores, NCCL, torch IPC).
``memory_request`` = shm_bytes + :func:`overhead_bytes`:
                     DP x (``API_SERVER_BYTES`` + engine core + host keys x
                     ``MANAGER_BYTES_PER_KEY`` + W x ``WORKER_PROCESS_BYTES``)
                     + ``DP_PROCESSES_BYTES`` when DP > 1. The engine core is
                     ``ENGINE_CORE_BYTES`` when its one worker runs inside it (vLLM's
                     ``uni`` executor: W = 1 and DP = 1), else ``ENGINE_CORE_MP_BYTES``
                     (the ``mp`` executor: W > 1 or DP > 1, workers in their own
                     processes, whose CPU side is part of ``WORKER_PROCESS_BYTES``).
``memory_limit``   = memory_request + headroom, headroom =
                     max(``MIN_HEADROOM_BYTES``, ``HEADROOM_FRACTION`` x request):
                     pinned pool pages cannot be reclaimed, so the kernel needs slack
                     before the OOM killer picks the engine.

Measured (bench/pod_memory.py: vLLM 0.33.0's real processes on the emulated GPU, peak
RssAnon + RssFile, file pages counted in every process that maps them): the API
server, the engine core with its helper processes, the manager's bytes per key, the
region, and at DP 2 the slimmer engine cores of the ``mp`` executor and vLLM's DP
process manager and coordinator. Estimates, not measurable without a GPU:
``WORKER_PROCESS_BYTES`` (CUDA context and kernels, torch CUDA libraries, NCCL buffers,
pinned staging, the safetensors page cache while loading; a separate emulated worker's
CPU side measured 1,046 MiB of it), the rings' fill (their size is from vLLM's
``MessageQueue`` defaults) and ``SHM_OTHER_BYTES``. ``ENGINE_CORE_MP_BYTES`` is measured
at DP 2 with one worker per engine and carried over to tensor parallelism (the same
executor and engine core; the emulator runs one worker per engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from spillway_engine.arith import round_up

GIB = 2**30
MIB = 2**20

#: One MessageQueue ring: 10 chunks of 24 MiB plus per-chunk flags (vLLM 0.33.0's
#: ``MessageQueue`` defaults), rounded up to a MiB; pages are touched as used.
MQ_RING_BYTES = 241 * MIB
#: /dev/shm besides the pool and the rings: semaphores, NCCL, torch IPC (estimate).
SHM_OTHER_BYTES = 256 * MIB
#: vLLM's API server process (HTTP, tokenizer, detokenizer, metrics). Measured peak
#: 943 MiB (tiny tokenizer; a real one adds its own size), rounded up.
API_SERVER_BYTES = 1 * GIB
#: One engine core running its one GPU worker in-process (vLLM's ``uni`` executor; the
#: worker's CUDA side is ``WORKER_PROCESS_BYTES``), with the kernel-setup helper
#: processes it starts (two Python children of about 570 MiB each). Measured peak
#: 2,166-2,293 MiB, + 6%.
ENGINE_CORE_BYTES = 2432 * MIB
#: One engine core whose workers are processes of their own (``mp`` executor: tensor or
#: pipeline parallelism, or DP > 1), with its helpers. Measured at DP 2 over three runs:
#: 1,911-2,263 MiB per engine (core 909 + helpers 1,002-1,354; the helpers vary from run
#: to run), + 2% on the largest.
ENGINE_CORE_MP_BYTES = 2304 * MIB
#: Spillway's offloading manager per stored key (one chunk of one group): 870-1,030
#: bytes on the Python heap measured (tracemalloc, 20k-100k keys), + allocator slack.
MANAGER_BYTES_PER_KEY = 1280
#: One GPU worker process (CUDA context, torch, NCCL, pinned staging, load cache): an
#: estimate, not measurable here.
WORKER_PROCESS_BYTES = 6 * GIB
#: DP > 1: vLLM's process manager (the launching process) and DP coordinator. Measured
#: at DP 2: 924 + 847 MiB, + 8%. (Each engine's API server is ``API_SERVER_BYTES``.)
DP_PROCESSES_BYTES = 1920 * MIB
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


def workers_in_own_processes(workers_per_engine: int, data_parallel_size: int) -> bool:
    """vLLM's ``mp`` executor (ParallelConfig: world size across DP above 1); with one
    worker and no data parallelism the ``uni`` executor runs it in the engine core."""
    return workers_per_engine * data_parallel_size > 1


def shm_queue_bytes(workers_per_engine: int, data_parallel_size: int) -> int:
    """/dev/shm besides the pools: every engine's rings (none under the ``uni``
    executor, which has no MessageQueue) and the rest."""
    mp = workers_in_own_processes(workers_per_engine, data_parallel_size)
    rings = 1 + workers_per_engine if mp else 0
    return data_parallel_size * rings * MQ_RING_BYTES + SHM_OTHER_BYTES


def measurable_process_bytes(
    host_keys_per_engine: int, data_parallel_size: int, workers_per_engine: int = 1
) -> int:
    """The process terms a CPU run measures (every process but the GPU workers, so
    vLLM's DP processes too): bench/pod_memory.py."""
    mp = workers_in_own_processes(workers_per_engine, data_parallel_size)
    core = ENGINE_CORE_MP_BYTES if mp else ENGINE_CORE_BYTES
    engine = API_SERVER_BYTES + core + host_keys_per_engine * MANAGER_BYTES_PER_KEY
    extra = DP_PROCESSES_BYTES if data_parallel_size > 1 else 0
    return data_parallel_size * engine + extra


def overhead_bytes(
    workers_per_engine: int, data_parallel_size: int, host_keys_per_engine: int = 0
) -> int:
    """Process memory of all engines in the pod (excludes the pool and shm queues)."""
    workers = data_parallel_size * workers_per_engine * WORKER_PROCESS_BYTES
    measured = measurable_process_bytes(
        host_keys_per_engine, data_parallel_size, workers_per_engine
    )
    return measured + workers


def size_pod(
    region_bytes: int,
    workers_per_engine: int,
    data_parallel_size: int,
    host_keys_per_engine: int = 0,
) -> PodMemory:
    """Pod memory for a pool region of ``region_bytes`` per engine whose manager can
    hold ``host_keys_per_engine`` keys (at most one per pool unit)."""
    if region_bytes < 0 or workers_per_engine < 1 or data_parallel_size < 1:
        raise PodSizingError("pool, worker count and data-parallel size must be positive")
    queues = shm_queue_bytes(workers_per_engine, data_parallel_size)
    shm = round_up(data_parallel_size * region_bytes + queues, MIB)
    processes = overhead_bytes(workers_per_engine, data_parallel_size, host_keys_per_engine)
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
    """The largest pool per engine whose pod fits ``memory_limit`` (before row rounding;
    the manager's per-key bytes, known once the pool's units are, are the planner's).

    Inverts :func:`size_pod`: the largest request r with r + headroom(r) <= limit is
    min(limit - MIN_HEADROOM, limit / (1 + HEADROOM_FRACTION)).
    """
    request = min(
        memory_limit - MIN_HEADROOM_BYTES,
        int(Fraction(memory_limit) / (1 + HEADROOM_FRACTION)),
    )
    fixed = round_up(shm_queue_bytes(workers_per_engine, data_parallel_size), MIB) + (
        overhead_bytes(workers_per_engine, data_parallel_size)
    )
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
