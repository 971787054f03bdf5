"""The disk tier's files: a directory of whole chunk files under a byte budget,
evicted least recently used, written crash-safely, shared with other replicas.

:class:`ChunkDir` is what :class:`~spillway_engine.offloader.disk_tier.SpillwayDiskTier`
(the vLLM tier, in ``disk_tier.py``, whose docstring gives the rules) stores into and
loads from; it knows nothing of vLLM's jobs. Its log lines are the tier's
(``spillway_engine.offloader.disk_tier``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Union

from vllm.v1.kv_offload.tiering.fs.io import batch_load_block

logger = logging.getLogger("spillway_engine.offloader.disk_tier")

Buffer = Union[bytes, bytearray, memoryview]  # noqa: UP007 (a runtime alias)

CHUNK_SUFFIX = ".kv"
#: Evicted keys remembered for the thrash count (a later miss on one is thrash).
EVICTED_MEMORY = 65_536
TMP_SUFFIX = ".tmp"
TMP_PREFIX = "."
NAMESPACE_PREFIX = "spillway-"
OWN = "own"
SHARED = "shared"
# Errors that mean "the disk will not take this write"; any other OSError is
# treated the same way, these are only named in the log line.
_DISK_ERRNOS = {
    errno.ENOSPC: "full",
    errno.EDQUOT: "over quota",
    errno.EROFS: "read-only",
    errno.EACCES: "not writable",
    errno.EPERM: "not writable",
    errno.EIO: "failing",
}


@dataclass
class DiskTierStats:
    """A plain snapshot of the tier's counters."""

    budget_bytes: int = 0
    bytes_used: int = 0
    chunks_held: int = 0
    hits: int = 0  # own and shared
    shared_hits: int = 0  # of them, chunks another instance wrote after this one started
    misses: int = 0
    loads: int = 0
    load_failures: int = 0
    stores: int = 0
    evictions: int = 0
    write_failures: int = 0
    stores_dropped: int = 0
    temp_files_removed: int = 0
    thrash: int = 0  # evicted here, asked for again (anchor keys: one per chunk of prefix)
    shared_known: int = 0  # other instances' chunks this one knows of (not counted)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def plan_namespace(plan_key: str, chunk_bytes: int | None, extra: str = "") -> str:
    """The directory name every file of one plan lives under."""
    ident = f"plan={plan_key}\nchunk_bytes={chunk_bytes}\n{extra}"
    return NAMESPACE_PREFIX + hashlib.sha256(ident.encode()).hexdigest()[:20]


def _alloc_unit(path: str) -> int:
    try:
        unit = os.statvfs(path).f_frsize
    except OSError:
        unit = 4096
    return max(512, unit or 4096)


def _describe(exc: OSError) -> str:
    return _DISK_ERRNOS.get(exc.errno or 0, "failing")


class ChunkDir:
    """A directory of whole chunk files, bounded by bytes, evicted LRU.

    Thread safe: the index is guarded by one lock; file writes happen outside
    it, but the deletions that make room for a write happen inside it, before
    the write, so the bytes on disk never pass the budget while writers race.
    Keys are ``bytes``; sizes may differ per chunk unless ``chunk_bytes`` (one
    size) or ``size_of`` (a size per key, None for a key the tier cannot hold)
    is given, in which case a file of any other size is never indexed.
    """

    def __init__(
        self,
        directory: str,
        budget_bytes: int,
        chunk_bytes: int | None = None,
        fsync: bool = True,
        stale_temp_s: float = 0.0,
        size_of: Callable[[bytes], int | None] | None = None,
        shared: bool = True,
        max_shared_keys: int = 1 << 16,
        on_change: Callable[[bytes, bool], None] | None = None,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.directory = directory
        self.budget_bytes = int(budget_bytes)
        self.chunk_bytes = chunk_bytes
        self._size_of = size_of
        self._fsync = fsync
        self._stale_temp_s = stale_temp_s
        self._lock = threading.Lock()
        # Told (under the lock, so in the order it happened) of each own file that
        # appears (key, False) or is deleted (key, True); never of other instances' files.
        self._on_change = on_change
        # key -> charged bytes, oldest first.
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self._writing: set[bytes] = set()
        # Chunks another instance wrote into this directory after this one started:
        # key -> file size, most recently used last. Never counted, never evicted here.
        self.shared = shared
        self._max_shared = max(0, int(max_shared_keys))
        self._foreign: OrderedDict[bytes, int] = OrderedDict()
        # Keys this instance evicted lately, for the thrash count (bounded, oldest out).
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._used = 0  # bytes of indexed files plus reservations of writes
        self._held = 0  # bytes of indexed files
        self.stats = DiskTierStats(budget_bytes=self.budget_bytes)
        self.usable = True
        self._unit = 4096
        try:
            os.makedirs(directory, exist_ok=True)
            self._unit = _alloc_unit(directory)
            self._rebuild()
        except OSError as exc:
            # A directory we cannot even list: run empty, every store fails.
            self.usable = False
            logger.warning(
                "spillway disk tier: %s is %s (%s); running without it",
                directory,
                _describe(exc),
                exc,
            )

    # ---- naming -------------------------------------------------------
    def path_of(self, key: bytes) -> str:
        hx = key.hex()
        return os.path.join(self.directory, hx[:2], hx + CHUNK_SUFFIX)

    def _tmp_path(self, key: bytes) -> str:
        hx = key.hex()
        name = f"{TMP_PREFIX}{hx}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        return os.path.join(self.directory, hx[:2], name)

    def expected_size(self, key: bytes) -> int | None:
        """The one size a complete file of ``key`` has; None: any size; -1: none."""
        if self._size_of is not None:
            size = self._size_of(key)
            return -1 if size is None else size
        return self.chunk_bytes

    def charge(self, nbytes: int) -> int:
        """Bytes the filesystem allocates for a file of ``nbytes``."""
        unit = self._unit
        return -(-nbytes // unit) * unit

    # ---- start --------------------------------------------------------
    def _rebuild(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for dirpath, _dirs, files in os.walk(self.directory):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(TMP_SUFFIX) or name.startswith(TMP_PREFIX):
                    # Left by a crash (never renamed, so never read). On a shared
                    # volume a young one may be a live replica's write in flight.
                    if self._stale_temp_s <= 0 or self._older_than(path, self._stale_temp_s):
                        self._remove_quietly(path)
                        self.stats.temp_files_removed += 1
                    continue
                if not name.endswith(CHUNK_SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(name[: -len(CHUNK_SUFFIX)])
                    st = os.stat(path)
                except (ValueError, OSError):
                    continue
                if path != self.path_of(key):
                    continue  # not where this tier would look: never read, not counted
                expected = self.expected_size(key)
                if expected is not None and st.st_size != expected:
                    # Renamed files are whole by construction; a wrong size
                    # is not ours to read (or a torn foreign write).
                    self._remove_quietly(path)
                    self.stats.temp_files_removed += 1
                    continue
                charged = max(self.charge(st.st_size), st.st_blocks * 512)
                found.append((st.st_mtime, key, charged))
        found.sort()
        for _mtime, key, charged in found:
            self._lru[key] = charged
            self._used += charged
            self._held += charged
        # Files already over a (new, smaller) budget: trim oldest first.
        with self._lock:
            self._evict_locked(0)
        self._publish_locked()

    @staticmethod
    def _older_than(path: str, seconds: float) -> bool:
        try:
            return time.time() - os.stat(path).st_mtime > seconds
        except OSError:
            return False

    @staticmethod
    def _remove_quietly(path: str) -> bool:
        try:
            os.remove(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False

    # ---- index --------------------------------------------------------
    def _publish_locked(self) -> None:
        self.stats.bytes_used = self._held
        self.stats.chunks_held = len(self._lru)
        self.stats.shared_known = len(self._foreign)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return self.stats.as_dict()

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter from any thread."""
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def contains(self, key: bytes, refresh: bool = True) -> bool:
        with self._lock:
            if key not in self._lru:
                return False
            if refresh:
                self._lru.move_to_end(key)
            return True

    def _probe(self, key: bytes) -> int | None:
        """Size of a complete chunk file of ``key`` at its path, None when there is none.

        Only renamed files sit at ``path_of`` (temporaries have other names), so a
        regular file of the right size there is whole."""
        expected = self.expected_size(key)
        if expected == -1:
            return None
        try:
            st = os.stat(self.path_of(key))
        except (OSError, ValueError):
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
            return None
        if expected is not None and st.st_size != expected:
            return None
        return st.st_size

    def _know_foreign_locked(self, key: bytes, size: int) -> None:
        if self._max_shared <= 0:
            return
        self._foreign[key] = size
        self._foreign.move_to_end(key)
        while len(self._foreign) > self._max_shared:
            self._foreign.popitem(last=False)
        self._publish_locked()

    def locate(self, key: bytes, refresh: bool = True) -> str | None:
        """Where a lookup finds ``key``: ``"own"`` (indexed, counted against the budget),
        ``"shared"`` (a file another instance on this directory wrote after this one
        started: served, never counted or evicted here) or None.

        A key not known either way costs one ``stat`` of its path (when ``shared``);
        a known shared key is trusted until a load of it fails (:meth:`forget`).
        """
        with self._lock:
            if key in self._lru:
                if refresh:
                    self._lru.move_to_end(key)
                return OWN
            if key in self._foreign:
                if refresh:
                    self._foreign.move_to_end(key)
                return SHARED
        if not (self.shared and self.usable and self._max_shared > 0):
            return None
        size = self._probe(key)
        if size is None:
            return None
        with self._lock:
            if key in self._lru:  # this instance finished writing it meanwhile
                return OWN
            self._know_foreign_locked(key, size)
        return SHARED

    def evicted_lately(self, key: bytes) -> bool:
        """Whether this instance evicted ``key`` lately (forgets it: counted once)."""
        with self._lock:
            return self._evicted.pop(key, False) is None

    def is_shared(self, key: bytes) -> bool:
        with self._lock:
            return key in self._foreign

    def touch(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                if key in self._lru:
                    self._lru.move_to_end(key)
                elif key in self._foreign:
                    self._foreign.move_to_end(key)

    def pin(self, key: bytes) -> bool:
        """Keep an own chunk from eviction while it is read; True when the chunk is
        readable (own, or a known shared one, which this instance never evicts)."""
        with self._lock:
            if key not in self._lru:
                return key in self._foreign
            self._pins[key] = self._pins.get(key, 0) + 1
            self._lru.move_to_end(key)
            return True

    def unpin(self, key: bytes) -> None:
        with self._lock:
            n = self._pins.get(key, 0) - 1
            if n <= 0:
                self._pins.pop(key, None)
            else:
                self._pins[key] = n

    def forget(self, key: bytes) -> None:
        """Drop a key whose file turned out missing or unreadable (a shared one is only
        forgotten: its file is its writer's, and most likely that writer evicted it)."""
        with self._lock:
            self._foreign.pop(key, None)
            charged = self._lru.pop(key, None)
            if charged is not None:
                self._used -= charged
                self._held -= charged
                self._remove_quietly(self.path_of(key))
                self._changed_locked(key, True)
            self._publish_locked()

    def _changed_locked(self, key: bytes, removed: bool) -> None:
        if self._on_change is not None:
            try:
                self._on_change(key, removed)
            except Exception:  # an observer must not break the tier
                logger.exception("spillway disk tier: change observer failed")

    def _evict_locked(self, need: int) -> bool:
        """Delete LRU files until ``need`` more bytes fit. Under the lock."""
        if self._used + need <= self.budget_bytes:
            return True
        for key in list(self._lru):
            if self._used + need <= self.budget_bytes:
                break
            if self._pins.get(key):
                continue
            path = self.path_of(key)
            if not self._remove_quietly(path):
                continue  # cannot delete it; it still occupies the disk
            charged = self._lru.pop(key)
            self._used -= charged
            self._held -= charged
            self.stats.evictions += 1
            self._evicted[key] = None
            if len(self._evicted) > EVICTED_MEMORY:
                self._evicted.popitem(last=False)
            self._changed_locked(key, True)
        return self._used + need <= self.budget_bytes

    # ---- I/O ----------------------------------------------------------
    def put(self, key: bytes, data: Buffer | Sequence[Buffer]) -> bool:
        """Store one chunk (one buffer, or pieces written one after another); True
        when it is (now or already) on disk.

        Returns False when it does not fit (nothing evictable) and raises
        ``OSError`` when the disk refuses the write; the caller counts it.
        """
        pieces = data if isinstance(data, (list, tuple)) else [data]
        parts = [memoryview(p).cast("B") for p in pieces]
        nbytes = sum(len(p) for p in parts)
        expected = self.expected_size(key)
        if expected is not None and nbytes != expected:
            raise ValueError(f"chunk of {nbytes} bytes, tier holds {expected} for this key")
        reserve = self.charge(nbytes)
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return True
            if key in self._writing:
                return True  # a concurrent store of the same content
        # On a shared directory another instance may have written it already: do not
        # write it again (that would count one file in two budgets). A shared key
        # whose file its writer has evicted since is written here, as this one's.
        found = self._probe(key) if self.shared and self._max_shared > 0 else None
        with self._lock:
            if key in self._lru or key in self._writing:
                return True
            if found is not None:
                self._know_foreign_locked(key, found)
                return True
            if self._foreign.pop(key, None) is not None:
                self._publish_locked()
            if reserve > self.budget_bytes or not self._evict_locked(reserve):
                self._publish_locked()
                return False
            self._used += reserve
            self._writing.add(key)
            self._publish_locked()
        final = self.path_of(key)
        charged = self._write_file(key, final, parts, reserve)
        with self._lock:
            self._writing.discard(key)
            self._foreign.pop(key, None)
            self._used += charged - reserve
            self._held += charged
            self._lru[key] = charged
            self.stats.stores += 1
            self._changed_locked(key, False)
            # The filesystem allocated more than predicted: trim at once.
            self._evict_locked(0)
            self._publish_locked()
        if self._fsync:
            self._fsync_dir(os.path.dirname(final))
        return True

    def _write_file(self, key: bytes, final: str, parts: list[memoryview], reserve: int) -> int:
        """Write ``parts`` to a temporary name, fsync it and rename it to ``final``;
        returns the bytes the filesystem allocated. On any failure the temporary is
        deleted, the reservation given back, and the error raised."""
        tmp = self._tmp_path(key)
        charged = reserve
        published = False
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                for view in parts:
                    while view:
                        written = os.write(fd, view)
                        if written <= 0:
                            raise OSError(errno.EIO, "short write")
                        view = view[written:]
                if self._fsync:
                    os.fsync(fd)
                charged = max(reserve, os.fstat(fd).st_blocks * 512)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            published = True
        except BaseException:
            self._remove_quietly(tmp)
            with self._lock:
                self._used -= reserve
                self._writing.discard(key)
                self._publish_locked()
            raise
        finally:
            if not published:
                self._remove_quietly(tmp)
        return charged

    @staticmethod
    def _fsync_dir(path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def read_into(self, key: bytes, view: memoryview, offsets: Sequence[int], row: int) -> None:
        """Read one whole chunk into the ``row``-byte slices of ``view`` at ``offsets``,
        in order (one slice: vLLM's fs tier reader, which raises on a short file and
        removes it). Only renamed, complete files are ever named by ``path_of``.
        """
        path = self.path_of(key)
        if len(offsets) == 1:
            batch_load_block([path], view, list(offsets), row, False)
        else:
            flat = view.cast("B")
            slices = [flat[o : o + row] for o in offsets]
            if any(o < 0 or len(piece) != row for o, piece in zip(offsets, slices, strict=True)):
                raise ValueError(f"row offsets {list(offsets)} out of bounds")
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.readv(fd, slices)
            finally:
                os.close(fd)
            if got != row * len(offsets):
                raise OSError(errno.EIO, f"short read: {got} of {row * len(offsets)}")
        with contextlib.suppress(OSError):
            os.utime(self.path_of(key))  # keeps LRU order across a restart

    def get(self, key: bytes) -> bytes | None:
        """Whole chunk as bytes (tests and tools); None when not held."""
        if not self.pin(key):
            return None
        try:
            with open(self.path_of(key), "rb") as f:
                return f.read()
        except OSError:
            self.forget(key)
            return None
        finally:
            self.unpin(key)

    def disk_bytes(self) -> tuple[int, int]:
        """(sum of st_size, sum of allocated bytes) over the tier's files."""
        size = alloc = 0
        for dirpath, _dirs, files in os.walk(self.directory):
            for name in files:
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except OSError:
                    continue
                size += st.st_size
                alloc += st.st_blocks * 512
        return size, alloc
