"""Preflight: can this container hold the plan? Checked before vLLM loads anything.

Three questions, each answered with the numbers and the field to change:

* **shm**: the shm folder (``/dev/shm``, after leftovers are freed) has room for the
  plan's ``pod.shm_bytes`` -- every data-parallel engine's offload region plus vLLM's
  message queues. vLLM itself only checks the region, when the engine core is already
  up, and a too-small tmpfs otherwise ends in SIGBUS.
* **memory**: the container's memory cgroup limit (v2 ``memory.max``, v1
  ``memory/memory.limit_in_bytes``) is at least the plan's ``pod.memory_request_bytes``
  (tmpfs pages of the region are charged to the container, on top of the processes).
* **memlock**: where the engine pins the region (``cudaHostRegister`` on a CUDA GPU),
  ``RLIMIT_MEMLOCK`` covers one worker's share of it, unless the process holds
  ``CAP_IPC_LOCK``. Kubernetes has no ulimit field: the limit comes from the container
  runtime (containerd's ``LimitMEMLOCK``). This one is a warning, not a stop: vLLM
  0.33.0 treats pinning as a bandwidth optimisation and falls back to pageable copies
  when registration fails (``host_register.py``), and CUDA's own pinned allocations
  work in containers whose memlock limit is far below them (PyTorch's pinned host
  memory under Docker's default 8 MiB), so stopping would crash-loop engines that run.

Each check is a pure function of plain numbers; :func:`run_preflight` reads the
machine's. A shortfall is one line (``Shortfall.line``).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from spillway_engine.planner.plan import Plan

ENV_CGROUP_ROOT = "SPILLWAY_CGROUP_ROOT"
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"
#: cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value.
_V1_UNLIMITED = 1 << 62
_CAP_IPC_LOCK = 14
_MIB = 1 << 20


@dataclass(frozen=True)
class Shortfall:
    check: str  # shm, memory, memlock, disk
    line: str
    #: False: the engine still runs (slower); say so and go on
    fatal: bool = True


def _mib(n: int) -> str:
    return f"{n / _MIB:.0f} MiB" if n < 10 * 1024 * _MIB else f"{n / (1024 * _MIB):.1f} GiB"


def _engines(plan: Plan) -> str:
    dp = plan.pod.engines  # this pod's: data_parallel_size / nodes across nodes
    return f"{dp} engine{'s' if dp > 1 else ''}"


def shm_needed(plan: Plan) -> tuple[int, int, int]:
    """(needed, regions, queues): the plan's shm size and its two parts."""
    regions = plan.pod.engines * plan.pod.pool_bytes_per_engine
    return plan.pod.shm_bytes, regions, plan.pod.shm_bytes - regions


def check_shm(plan: Plan, folder: Path, free_bytes: int, total_bytes: int) -> Shortfall | None:
    need, _, queues = shm_needed(plan)
    if free_bytes >= need:
        return None
    return Shortfall(
        "shm",
        f"{folder} has {free_bytes} bytes free ({_mib(free_bytes)} of {_mib(total_bytes)}) but "
        f"the plan needs {need} bytes ({_mib(need)}: offload region "
        f"{_mib(plan.pod.pool_bytes_per_engine)} x {_engines(plan)} + queues {_mib(queues)}); "
        f"mount an emptyDir with medium Memory and sizeLimit >= {need} at {folder} "
        "(the plan's pod.shm_bytes) or lower the InferenceDeployment's offload.hostMemory",
    )


def check_memory(plan: Plan, limit_bytes: int | None, source: str) -> Shortfall | None:
    """``limit_bytes`` None: no limit (nothing to fall short of)."""
    need = plan.pod.memory_request_bytes
    if limit_bytes is None or limit_bytes >= need:
        return None
    return Shortfall(
        "memory",
        f"container memory limit {limit_bytes} bytes ({_mib(limit_bytes)}, {source}) is below "
        f"the plan's {need} bytes ({_mib(need)}: shm {_mib(plan.pod.shm_bytes)} + engine "
        f"processes {_mib(plan.pod.process_overhead_bytes)}); set the container's "
        f"resources.limits.memory >= {plan.pod.memory_limit_bytes} (the plan's "
        "pod.memory_limit_bytes; InferenceDeployment: resources.extraMemory adds to it) or "
        "lower offload.hostMemory",
    )


def pinned_bytes_per_worker(plan: Plan) -> int:
    """What one worker registers: its slots of the region (the whole region when all
    ranks share one replicated slot)."""
    copies = plan.spillway.copies if plan.offloader == "spillway" else (
        plan.upstream.copies if plan.upstream else 1
    )
    return -(-plan.pod.pool_bytes_per_engine // max(1, copies))


def check_memlock(
    plan: Plan, pins: bool, soft_limit: int, has_ipc_lock: bool
) -> Shortfall | None:
    """``soft_limit`` is ``RLIMIT_MEMLOCK``'s soft value (``RLIM_INFINITY`` for none)."""
    need = pinned_bytes_per_worker(plan)
    if not pins or has_ipc_lock or soft_limit == resource.RLIM_INFINITY or soft_limit >= need:
        return None
    return Shortfall(
        "memlock",
        f"locked-memory limit (ulimit -l) is {soft_limit} bytes ({_mib(soft_limit)}) but each "
        f"GPU worker pins {need} bytes ({_mib(need)}) of the offload region; raise the "
        "container runtime's memlock limit (containerd: LimitMEMLOCK=infinity; Kubernetes "
        "has no field for it) or run the engine as root with capability IPC_LOCK "
        "(securityContext.capabilities.add); until then the region stays pageable "
        "(slower host transfers)",
        fatal=False,
    )


# ---------------------------------------------------------------- the machine's facts


def cgroup_root(value: str | None = None) -> Path:
    return Path(value or os.environ.get(ENV_CGROUP_ROOT) or DEFAULT_CGROUP_ROOT)


def memory_limit(root: Path) -> tuple[int | None, str]:
    """The container's memory limit (None: unlimited or unknown) and where it came from."""
    v2 = root / "memory.max"
    v1 = root / "memory" / "memory.limit_in_bytes"
    for path in (v2, v1):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None, str(path)
        try:
            value = int(text)
        except ValueError:
            raise PreflightError(f"cannot read the memory limit in {path}: {text[:40]!r}") from None
        return (None if value >= _V1_UNLIMITED else value), str(path)
    return None, f"no memory.max or memory/memory.limit_in_bytes under {root}"


def has_cap_ipc_lock(status: Path = Path("/proc/self/status")) -> bool:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class PreflightError(Exception):
    """A fact the preflight could not read (one line)."""


@dataclass(frozen=True)
class Facts:
    shm_free: int
    shm_total: int
    memory_limit: int | None
    memory_source: str
    memlock_soft: int
    ipc_lock: bool


def read_facts(shm: Path, cgroups: Path) -> Facts:
    try:
        st = os.statvfs(shm)
    except OSError as e:
        raise PreflightError(f"cannot read the shm folder {shm}: {e.strerror or e}") from None
    limit, source = memory_limit(cgroups)
    return Facts(
        shm_free=st.f_bavail * st.f_frsize,
        shm_total=st.f_blocks * st.f_frsize,
        memory_limit=limit,
        memory_source=source,
        memlock_soft=resource.getrlimit(resource.RLIMIT_MEMLOCK)[0],
        ipc_lock=has_cap_ipc_lock(),
    )


def check_disk(plan: Plan, folder: Path) -> Shortfall | None:
    """The disk tier's folder takes files, and its filesystem can hold this pod's share
    (short of it, stores fail and back off: slower, so not fatal)."""
    disk = plan.disk
    if disk is None:
        return None
    probe = folder / f".spillway-preflight-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
        st = os.statvfs(folder)
    except OSError as e:
        return Shortfall(
            "disk",
            f"the disk tier's folder {folder} does not take files ({e.strerror or e}); mount "
            "the InferenceDeployment's offload.disk volume there, writable by the engine's "
            "user (--disk-dir)",
        )
    share = disk.volume_bytes // disk.writers
    total = st.f_blocks * st.f_frsize
    if total >= share:
        return None
    return Shortfall(
        "disk",
        f"{folder}'s filesystem holds {total} bytes ({_mib(total)}), less than this pod's "
        f"share of the disk tier, {share} bytes ({_mib(share)}); chunk stores will fail and "
        "back off once it fills (lower offload.disk.size)",
        fatal=False,
    )


def shortfalls(plan: Plan, facts: Facts, shm: Path, *, pins: bool,
               disk: Path | None = None) -> list[Shortfall]:
    checks = (
        check_shm(plan, shm, facts.shm_free, facts.shm_total),
        check_memory(plan, facts.memory_limit, facts.memory_source),
        check_memlock(plan, pins, facts.memlock_soft, facts.ipc_lock),
        None if disk is None else check_disk(plan, disk),
    )
    return [s for s in checks if s is not None]


def summary(plan: Plan, facts: Facts, shm: Path) -> str:
    """One line for the log when everything fits."""
    limit = "none" if facts.memory_limit is None else _mib(facts.memory_limit)
    return (
        f"preflight ok: {shm} {_mib(facts.shm_free)} free >= plan {_mib(plan.pod.shm_bytes)}; "
        f"memory limit {limit} >= plan {_mib(plan.pod.memory_request_bytes)}"
    )
