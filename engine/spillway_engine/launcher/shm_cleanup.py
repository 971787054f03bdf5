"""Free what an earlier engine of this pod left in its shm folder, before vLLM starts.

The pod's ``/dev/shm`` is a memory-backed ``emptyDir``: it outlives a container restart,
so files a killed engine left there still hold memory and count against the volume's
size limit; the restarted engine may then not fit. What vLLM 0.33.0 leaves after a
SIGKILL (measured, see tests/contract/test_engine_restart.py):

* the offload region ``vllm_offload_<engine_id>.mmap`` (and ``.1``, ``.2``... segments)
  when the engine died before every worker had mapped it (a sparse file then), or when
  the region was made without the all-workers barrier (upstream's tiering spec,
  vLLM #54002: the whole region stays allocated); once mapped behind the barrier the
  file is unlinked and a SIGKILL frees it;
* ``psm_<hex>``: Python ``SharedMemory`` blocks -- vLLM's ``MessageQueue`` rings
  (24 MiB x 10 chunks each, filled as used), ``ShmTensorArena``, the shm object store;
* ``sem.mp-<id>``: multiprocessing semaphores;
* ``vllm_ec_<engine_id>.mmap``: the encoder-cache region; ``nccl-*``: NCCL's shm
  transport; ``torch_*``: torch tensors shared with the file_system strategy.

Only those names are removed (the folder may be a developer's real ``/dev/shm``), and
never a file that a process we can see still has open or mapped. In a pod the
container's earlier processes are gone after a restart, so nothing of theirs is in use.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from spillway_engine.offloader.host_layout import REGION_FILE_PREFIX

ENV_SHM_DIR = "SPILLWAY_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"

#: Names vLLM 0.33.0, torch, NCCL and Python's multiprocessing create in /dev/shm.
LEFTOVER_PATTERNS: tuple[str, ...] = (
    f"{REGION_FILE_PREFIX}*.mmap",
    f"{REGION_FILE_PREFIX}*.mmap.*",
    "vllm_ec_*.mmap",
    "psm_*",
    "sem.mp-*",
    "nccl-*",
    "torch_*",
)


@dataclass(frozen=True)
class Freed:
    name: str
    #: memory the file held (tmpfs blocks), what the size limit counts
    used_bytes: int
    #: its length (a sparse file may be far larger than what it held)
    size_bytes: int


@dataclass(frozen=True)
class Cleanup:
    folder: Path
    freed: tuple[Freed, ...]
    #: leftover-looking names kept because a live process uses them
    in_use: tuple[str, ...]
    #: names that could not be removed, with the reason
    failed: tuple[tuple[str, str], ...]

    @property
    def freed_bytes(self) -> int:
        return sum(f.used_bytes for f in self.freed)

    def log_lines(self) -> list[str]:
        lines = [
            f"freed leftover {self.folder / f.name}: {f.used_bytes} bytes "
            f"({f.size_bytes} bytes long) from an earlier engine"
            for f in self.freed
        ]
        lines += [f"kept {self.folder / n}: a running process uses it" for n in self.in_use]
        lines += [f"could not remove {self.folder / n}: {why}" for n, why in self.failed]
        if self.freed:
            lines.append(
                f"freed {len(self.freed)} leftover file(s), {self.freed_bytes} bytes, "
                f"in {self.folder}"
            )
        return lines


def shm_dir(value: str | None = None) -> Path:
    """The shm folder: ``value`` (the flag), else ``SPILLWAY_SHM_DIR``, else /dev/shm."""
    return Path(value or os.environ.get(ENV_SHM_DIR) or DEFAULT_SHM_DIR)


def is_leftover_name(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in LEFTOVER_PATTERNS)


def _paths_in_use(proc: Path) -> set[str]:
    """Files under any folder that visible processes hold open or mapped."""
    used: set[str] = set()
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return used
    for pid in pids:
        try:
            for fd in (pid / "fd").iterdir():
                try:
                    used.add(os.readlink(fd))
                except OSError:
                    continue
        except OSError:
            pass
        try:
            maps = (pid / "maps").read_text(errors="replace")
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                used.add(parts[5])
    return used


def free_leftovers(folder: Path, *, proc: Path = Path("/proc")) -> Cleanup:
    """Remove the leftover-looking files of ``folder`` that no visible process uses.

    Raises OSError (with the folder's name) when the folder cannot be listed.
    """
    entries = sorted(e for e in folder.iterdir() if is_leftover_name(e.name))
    in_use_paths = _paths_in_use(proc) if entries else set()
    freed: list[Freed] = []
    kept: list[str] = []
    failed: list[tuple[str, str]] = []
    for entry in entries:
        try:
            st = entry.lstat()
        except FileNotFoundError:
            continue
        if not entry.is_file() or entry.is_symlink():
            continue
        if _is_used(entry, folder, in_use_paths):
            kept.append(entry.name)
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            failed.append((entry.name, e.strerror or str(e)))
            continue
        freed.append(Freed(entry.name, st.st_blocks * 512, st.st_size))
    return Cleanup(folder, tuple(freed), tuple(kept), tuple(failed))


def _is_used(entry: Path, folder: Path, in_use: Iterable[str]) -> bool:
    # /proc names the file by the path it was opened under; a private mount of the
    # same tmpfs (a container's /dev/shm) shows it by the folder's real path.
    names = {str(entry), str(folder.resolve() / entry.name)}
    return any(n in in_use for n in names)
