"""A bounded disk tier under the host pool (issue 31), for vLLM 0.33's tiering.

vLLM 0.33 ships multi-tier offloading (``vllm/v1/kv_offload/tiering``): the CPU
pool is the primary tier and secondary tiers hang under it. Its ``fs`` tier
writes one file per chunk and never evicts, so nothing bounds it. This module
adds a secondary tier that does:

* a byte budget: least recently used chunk files are deleted *before* a store
  would go over it, so the files of the tier never hold more than the budget
  (counted as the bytes the filesystem allocates for them, page rounded);
* crash safety: a chunk is written to a hidden temporary name, fsynced and
  renamed into place; at start leftover temporaries (and complete-looking files
  of the wrong size) are deleted and the LRU index and byte count are rebuilt
  from the complete files already there, so a restarted pod, or a second
  replica on a shared volume, finds them;
* a namespace directory derived from a plan key (and from the chunk size and,
  where vLLM's spec says so, the model's storage identity), so files written
  under another plan are never read;
* clean failure: ENOSPC, EROFS, EACCES or any other ``OSError`` fails the
  store job (``success=False``, which feeds vLLM's back-pressure detector
  through ``TieringOffloadingManager._update_backpressure``), is counted, is
  logged once per episode, and starts a short backoff during which stores are
  dropped without touching the disk. Nothing raises into a request.

Use it from ``kv_connector_extra_config`` of ``TieringOffloadingSpec``::

    "secondary_tiers": [{
        "type": "SpillwayDiskTier",
        "module_path": "spillway_engine.offloader.disk_tier",
        "root_dir": "/var/cache/spillway/kv",
        "budget_bytes": 200 * 2**30,
        "plan_key": "<the plan hash>",
        "backpressure": {"backpressure_cls": "EMABackpressureDetector",
                         "failure_threshold": 3}
    }]

(vLLM gives ``failure_threshold`` by default only to its own ``fs``/``obj``
tier types, so it is named here; its LOCAL water marks assume NVMe, and an
fsynced small chunk on a slow disk can trip them, which drops cascades.)

A cache shared by replicas (a ReadWriteMany volume mounted by every replica,
one plan key, so one namespace directory): the budget is per instance. Each
counts, and evicts, the files it saw at start (so a replacement pod adopts a
dead pod's files and the total stays bounded) plus the files it wrote itself.
A chunk another replica wrote later is found on an index miss by a ``stat`` of
its path (a complete file of the right size; temporaries have other names),
served as a hit (``shared_hits``) and remembered in a bounded LRU of shared
keys (``max_shared_keys``), but never counted against this budget nor evicted
here: its writer bounds it. So the files on the volume take no more than the
replicas' budgets together (a replica that goes away leaves its files, which
replicas already running do not count, until a replica that starts adopts
them). A store of a chunk whose file is already
there writes nothing. A replica may delete a file another one knows of: the
load fails cleanly and the key is forgotten. ``shared=False`` turns the
``stat`` off (a private disk). On a shared volume set ``stale_temp_s`` so that
start-up cleanup spares another replica's write in flight.

KV events: when vLLM's KV cache events are on (``kv_events_config`` of the
offloading spec; ``enable_kv_events`` turns the tier's off, or on where no spec is
given), :meth:`SpillwayDiskTier.take_events` yields ``OffloadingEvent`` s of medium
``STORAGE``: a store for each chunk file this instance wrote, a removal for each of
its own files it deleted, in order. Chunks of other replicas it finds on a shared
directory are never announced by it (their writer does), so a router that counts a
shared folder's chunks once for all its replicas stays exact.

Counters: :meth:`SpillwayDiskTier.snapshot` (a dict), and the
``spillway_disk_tier_*`` series of Spillway's metric catalogue
(``spillway_engine.metrics.DISK_TIER_METRICS``), reported through vLLM's tier
``get_stats``/``build_metric_definitions`` hooks.

vLLM's primary gives a tier one row per key. Under Spillway's unit pool as the
primary (a key of group g takes ``units_g`` rows), pass ``group_units`` ({group:
units}); a job whose rows do not add up fails whole rather than store bytes
under the wrong key.
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
from typing import TYPE_CHECKING, Any, ClassVar, Union

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.kv_offload.tiering.fs.io import batch_load_block
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

from spillway_engine.metrics import (
    DISK_TIER_BUDGET_BYTES,
    DISK_TIER_CHUNKS,
    DISK_TIER_METRICS,
    DISK_TIER_USED_BYTES,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)

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


#: Prometheus series the tier exports through vLLM's offloading stats (name: kind,
#: help), from Spillway's metric catalogue (:data:`~spillway_engine.metrics.DISK_TIER_METRICS`);
#: vLLM registers them from ``build_metric_definitions``.
DISK_METRICS: dict[str, tuple[str, str]] = {m.name: (m.kind, m.help) for m in DISK_TIER_METRICS}
#: series -> the :class:`DiskTierStats` field it reports.
_STAT_FIELDS: dict[str, str] = {
    DISK_TIER_BUDGET_BYTES.name: "budget_bytes",
    DISK_TIER_USED_BYTES.name: "bytes_used",
    DISK_TIER_CHUNKS.name: "chunks_held",
    **{
        m.name: m.name.removeprefix("spillway_disk_tier_")
        for m in DISK_TIER_METRICS
        if m.kind == "counter"
    },
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


class SpillwayDiskTier(SecondaryTierManager):
    """vLLM 0.33 ``SecondaryTierManager`` over a bounded :class:`ChunkDir`.

    Every vLLM chunk is one primary-tier row of ``block_size_bytes``; a store
    copies rows out of the primary memoryview, a load copies a file back into
    the row the tiering manager allocated. The I/O runs on vLLM's fs tier
    thread pool; the scheduler-thread methods only touch the in-memory index.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec | None,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        budget_bytes: int,
        plan_key: str,
        n_read_threads: int = 4,
        n_write_threads: int = 4,
        fsync: bool = True,
        stale_temp_s: float = 0.0,
        failure_backoff_s: float = 1.0,
        max_failure_backoff_s: float = 30.0,
        group_units: dict[int, int] | None = None,
        anchor_group: int | None = None,
        locality: str | None = None,
        shared: bool = True,
        max_shared_keys: int = 1 << 16,
        enable_kv_events: bool | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality.upper()) if locality else None
        # KV events of this tier's own files (medium STORAGE), in the order they happened;
        # None when events are off. Written from the I/O threads, drained by take_events.
        self._events_lock = threading.Lock()
        self._events: list[tuple[bytes, bool]] | None = (
            [] if _kv_events_on(offloading_spec, enable_kv_events, tier_type) else None
        )
        # vLLM's contract is one primary row per key. Spillway's unit pool gives a
        # key of group g ``group_units[g]`` rows (its units, in order), so a job's
        # chunk_ids are the keys' rows back to back; each key's file holds them all.
        self.group_units = {int(g): int(n) for g, n in group_units.items()} if group_units else None
        if not plan_key:
            raise ValueError("SpillwayDiskTier needs a non-empty plan_key")
        units = "" if self.group_units is None else f"units={sorted(self.group_units.items())}"
        self.namespace = plan_namespace(
            plan_key, self.block_size_bytes, _spec_identity(offloading_spec) + units
        )
        self.chunks = ChunkDir(
            os.path.join(root_dir, self.namespace),
            budget_bytes,
            chunk_bytes=self.block_size_bytes,
            fsync=fsync,
            stale_temp_s=stale_temp_s,
            size_of=None if self.group_units is None else self._key_bytes,
            shared=shared,
            max_shared_keys=max_shared_keys,
            on_change=None if self._events is None else self._record_event,
        )
        # thrash counts one key per chunk of prefix: the anchor group's (all keys when
        # None, as with one group)
        self.anchor_group = anchor_group
        self._mismatch_logged = False
        self.stats = self.chunks.stats
        self._reported: dict[str, int] = {}
        self._failure_backoff_s = failure_backoff_s
        self._max_failure_backoff_s = max_failure_backoff_s
        self._backoff = 0.0
        self._backoff_until = 0.0
        self._failing = False  # inside a write-failure episode
        self._episode_failures = 0
        self._state_lock = threading.Lock()
        self._results: dict[JobId, JobResult] = {}
        self._immediate: list[JobResult] = []
        self._pool = DualQueueThreadPool(
            n_read_threads, n_write_threads, thread_name_prefix="spillway_disk"
        )

    # ---- scheduler-thread interface ----------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        where = self.chunks.locate(key)
        if where is None:
            self.chunks.count("misses")
            anchor = self.anchor_group is None or get_offload_group_idx(key) == self.anchor_group
            if anchor and self.chunks.evicted_lately(key):
                self.chunks.count("thrash")
            return LookupResult.MISS
        self.chunks.count("hits")
        if where == SHARED:
            self.chunks.count("shared_hits")
        return LookupResult.HIT

    def touch(self, keys, req_context: ReqContext) -> None:
        self.chunks.touch(keys)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job_id = job_metadata.job_id
        if not self.chunks.usable or time.monotonic() < self._backoff_until:
            self.chunks.count("stores_dropped", len(keys))
            self._immediate.append(JobResult(job_id=job_id, success=False))
            return
        offsets = self._key_offsets(keys, job_metadata.chunk_ids)
        if offsets is None:
            self._immediate.append(JobResult(job_id=job_id, success=False))
            return
        self._pool.enqueue_store(job_id, 1, [lambda: self._store_task(job_id, keys, offsets)])

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job_id = job_metadata.job_id
        offsets = self._key_offsets(keys, job_metadata.chunk_ids)
        if offsets is None:
            self._immediate.append(JobResult(job_id=job_id, success=False))
            return
        pinned = [self.chunks.pin(k) for k in keys]
        self._pool.enqueue_load(job_id, 1, [lambda: self._load_task(job_id, keys, offsets, pinned)])

    # ---- rows of a key ------------------------------------------------
    def _rows_of(self, key: bytes) -> int | None:
        if self.group_units is None:
            return 1
        return self.group_units.get(get_offload_group_idx(key))

    def _key_bytes(self, key: bytes) -> int | None:
        rows = self._rows_of(key)
        return None if rows is None else rows * self.block_size_bytes

    def _key_offsets(self, keys: list, chunk_ids: Iterable[int]) -> list[list[int]] | None:
        """Byte offsets of each key's rows in the primary view, or None when the job's
        chunk ids do not add up (then it fails whole, rather than store misaligned
        bytes under the wrong keys)."""
        ids = [int(c) for c in chunk_ids]
        out: list[list[int]] = []
        pos = 0
        for key in keys:
            rows = self._rows_of(key)
            if rows is None or pos + rows > len(ids):
                break
            out.append([c * self.block_size_bytes for c in ids[pos : pos + rows]])
            pos += rows
        else:
            if pos == len(ids):
                return out
        if not self._mismatch_logged:
            self._mismatch_logged = True
            logger.error(
                "spillway disk tier: a job of %d keys came with %d primary rows (%s); "
                "set group_units to the primary's units per group",
                len(keys),
                len(ids),
                "one row per key" if self.group_units is None else self.group_units,
            )
        return None

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self._immediate = self._immediate, []
        for job_id, _ok, transfer_time in self._pool.get_finished():
            result = self._results.pop(job_id, None)
            if result is None:  # the task itself died; should not happen
                result = JobResult(job_id=job_id, success=False)
            result.transfer_time = transfer_time
            done.append(result)
        return done

    def has_pending_work(self) -> bool:
        return bool(self._immediate)

    # ---- KV events ----------------------------------------------------
    @property
    def kv_events_enabled(self) -> bool:
        return self._events is not None

    def _record_event(self, key: bytes, removed: bool) -> None:
        with self._events_lock:
            if self._events is not None:
                self._events.append((key, removed))

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The tier's KV events since the last call (vLLM's ``TieringOffloadingManager``
        yields them after the primary's): ``removed=False`` for each chunk file this
        instance wrote (a store that completed, whatever became of the rest of its job),
        ``removed=True`` for each of its own files it deleted (evicted, or found broken
        on a load), in the order they happened, consecutive ones of a kind in one event.
        Another instance's files on a shared directory, which this one only finds,
        serves and never deletes, are never announced here: their writer announces them.

        Stores say ``removal_expected``, so vLLM's event tracker keeps a chunk's
        payload until this tier's removal and fans it out to the same block hashes.
        """
        if self._events is None:
            return
        with self._events_lock:
            taken, self._events = self._events, []
        run: list = []
        removed = False
        for key, gone in taken:
            if run and gone != removed:
                yield self._event(run, removed)
                run = []
            run.append(key)
            removed = gone
        if run:
            yield self._event(run, removed)

    def _event(self, keys: list, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys,
            medium=self.medium,
            removed=removed,
            locality=self.locality,
            removal_expected=not removed,
        )

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def config_info(self):
        return {}

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        kinds = {"gauge": OffloadingGaugeMetadata, "counter": OffloadingCounterMetadata}
        return {m.name: kinds[m.kind](documentation=m.help) for m in DISK_TIER_METRICS}

    def get_stats(self) -> OffloadingConnectorStats:
        """The counters since the last call and the gauges now (vLLM's per-step pull)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        snap = self.snapshot()
        stats = OffloadingConnectorStats()
        for m in DISK_TIER_METRICS:
            name, field = m.name, _STAT_FIELDS[m.name]
            if m.kind == "gauge":
                stats.set_gauge(name, snap[field])
                continue
            delta = snap[field] - self._reported.get(field, 0)
            self._reported[field] = snap[field]
            stats.increase_counter(name, delta)
        return stats

    def snapshot(self) -> dict[str, int]:
        return self.chunks.snapshot()

    # ---- pool-thread work --------------------------------------------
    def _store_task(self, job_id: JobId, keys: list, offsets: list[list[int]]) -> None:
        size = self.block_size_bytes
        flat = self._primary_kv_view.cast("B")
        ok = True
        written = 0
        for key, rows in zip(keys, offsets, strict=True):
            try:
                stored = self.chunks.put(key, [flat[off : off + size] for off in rows])
            except OSError as exc:
                self._on_write_failure(exc)
                ok = False
                break
            except Exception as exc:  # never into a request
                logger.exception("spillway disk tier: store failed: %s", exc)
                ok = False
                break
            if stored:
                written += size * len(rows)
            else:
                self.chunks.count("stores_dropped")
        if ok:
            self._on_write_success()
        self._results[job_id] = JobResult(job_id=job_id, success=ok, transfer_bytes=written or None)

    def _load_task(
        self, job_id: JobId, keys: list, offsets: list[list[int]], pinned: list[bool]
    ) -> None:
        size = self.block_size_bytes
        loaded: list = []  # a prefix of keys: loading stops at the first failure
        loaded_bytes = 0
        failed = False
        try:
            for key, rows, pin in zip(keys, offsets, pinned, strict=True):
                if failed or not pin:
                    failed = True
                    continue
                try:
                    self.chunks.read_into(key, self._primary_kv_view, rows, size)
                except (OSError, ValueError) as exc:
                    logger.debug("spillway disk tier: load %s: %s", key.hex(), exc)
                    self.chunks.count("load_failures")
                    self.chunks.forget(key)
                    failed = True
                    continue
                self.chunks.count("loads")
                loaded.append(key)
                loaded_bytes += size * len(rows)
        finally:
            for key, pin in zip(keys, pinned, strict=True):
                if pin:
                    self.chunks.unpin(key)
        if not failed:
            result = JobResult(job_id=job_id, success=True, transfer_bytes=loaded_bytes or None)
        else:
            # The loaded prefix is kept, as vLLM's fs tier does.
            result = JobResult(
                job_id=job_id,
                success=False,
                successful_keys=tuple(loaded) or None,
                transfer_bytes=loaded_bytes or None,
            )
        self._results[job_id] = result

    def _on_write_failure(self, exc: OSError) -> None:
        self.chunks.count("write_failures")
        with self._state_lock:
            self._episode_failures += 1
            self._backoff = min(
                self._max_failure_backoff_s,
                max(self._failure_backoff_s, self._backoff * 2),
            )
            self._backoff_until = time.monotonic() + self._backoff
            first = not self._failing
            self._failing = True
        if first:
            logger.warning(
                "spillway disk tier: disk is %s (%s); stores fail and back off "
                "until a write succeeds",
                _describe(exc),
                exc,
            )

    def _on_write_success(self) -> None:
        with self._state_lock:
            if not self._failing:
                return
            n, self._episode_failures = self._episode_failures, 0
            self._failing = False
            self._backoff = 0.0
        logger.warning("spillway disk tier: writes recovered after %d failures", n)


def _kv_events_on(offloading_spec: Any, flag: bool | None, tier_type: str) -> bool:
    """Whether the tier publishes KV events: with a spec, when vLLM's KV cache events
    are on (``flag=False`` turns the tier's off); without one (tests, tools), ``flag``."""
    config = getattr(offloading_spec, "kv_events_config", None)
    if offloading_spec is None or config is None:
        return bool(flag)
    on = bool(getattr(config, "enable_kv_cache_events", False))
    if flag and not on:
        logger.warning(
            "spillway disk tier %s: enable_kv_events is set but vLLM's KV cache events "
            "are off; the tier emits none",
            tier_type,
        )
    return on and flag is not False


def _spec_identity(offloading_spec: Any) -> str:
    """The storage identity vLLM's fs tier would use, when a spec is given."""
    if offloading_spec is None or getattr(offloading_spec, "config", None) is None:
        return ""
    try:
        from vllm.v1.kv_offload.file_mapper import FileMapper

        mapper = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=offloading_spec,
            blocks_per_file=getattr(offloading_spec, "blocks_per_chunk", 1),
        )
        return f"{sorted(mapper.get_run_config().items())!r} rank={mapper.rank}"
    except Exception:  # a spec this vLLM does not describe: plan key only
        return ""


__all__ = [
    "DISK_METRICS",
    "ChunkDir",
    "DiskTierStats",
    "SpillwayDiskTier",
    "plan_namespace",
]
