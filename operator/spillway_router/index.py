"""Where each block lives: block key -> {(pod, tier): count}, fed by vLLM KV events.

Three tiers, by vLLM's event ``medium``: ``GPU``, the host pool (``CPU``) and
Spillway's disk tier under it (``STORAGE``). Where a deployment's pods share one disk
folder (the plan's ``disk.writers`` > 1, a ReadWriteMany volume), each replica reads
the chunk files the others wrote, and each announces only its own files: their disk
entries are kept under the folder's group (:meth:`PrefixIndex.set_disk_group`), so a
chunk one of them stored counts as on disk for every one of them, and its writer's
removal takes it away for all. A group's entries outlive a member's restart (the files
stay on the volume) and go when its last member leaves.

Counts, not flags: the offloading connector announces a hash once per chunk that
contains it and removes it as often (vLLM asks consumers to reference-count), and a
hash stored by two KV-cache groups is removed once per group. A key is held by
(pod, tier) while its count is positive.

Without events, :class:`ApproxTracker` feeds the same index from the router's own
decisions, bounded by each pod's planned capacity in tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .hashing import external_key

GPU = "GPU"
HOST = "CPU"  # vLLM's medium name for the host tier
DISK = "STORAGE"  # vLLM's medium name for a storage tier (Spillway's disk tier)
TIERS = (GPU, HOST, DISK)
#: the tiers vLLM's AllBlocksCleared empties (a prefix cache reset leaves disk files)
MEMORY_TIERS = (GPU, HOST)
#: holder name of a shared disk folder's entries (pod names have no ':')
_GROUP = "disk-group:"


class EventError(ValueError):
    """A KV event batch this router cannot read (dropped, counted, never fatal)."""


class OversizedBatch(EventError):
    """A batch past the bounds below (dropped, counted apart: a hostile or broken
    publisher, not a format this router misreads)."""


#: Bounds on one EventBatch. vLLM publishes one batch per scheduler step: a step that
#: stores a 1M-token prompt in 16-token blocks is 65,536 hashes, far under these.
MAX_BATCH_EVENTS = 1 << 16
MAX_BATCH_KEYS = 1 << 20
#: Bytes of one message's payload (its msgpack) the feed decodes at most.
MAX_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class Match:
    """A pod's cached prefix of one prompt, in hash units."""

    gpu_units: int = 0
    host_units: int = 0
    #: held only on disk (the pod's own disk tier, or its deployment's shared folder)
    disk_units: int = 0

    @property
    def units(self) -> int:
        return self.gpu_units + self.host_units + self.disk_units


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, dict[tuple[str, str], int]] = {}
        self._by_pod: dict[str, set[int]] = {}
        self._per_tier: dict[tuple[str, str], int] = {}  # keys held, by (pod, tier)
        self._disk_group: dict[str, str] = {}  # pod -> its shared folder's holder name
        self._members: dict[str, set[str]] = {}  # that holder -> its pods

    # ------------------------------------------------------------ disk groups

    def set_disk_group(self, pod: str, group: str | None) -> None:
        """``pod``'s disk tier is the shared folder ``group`` (None: a disk of its own,
        or none). Its STORAGE events then go to, and its matches read, the group's
        entries; a group whose last member leaves is forgotten."""
        holder = None if group is None else _GROUP + group
        old = self._disk_group.get(pod)
        if old == holder:
            return
        if old is not None:
            members = self._members.get(old, set())
            members.discard(pod)
            if not members:
                self._members.pop(old, None)
                self.clear(old)
            self._disk_group.pop(pod)
        else:
            self.clear(pod, DISK)  # its private disk entries are not the group's
        if holder is not None:
            self._disk_group[pod] = holder
            self._members.setdefault(holder, set()).add(pod)

    def disk_holder(self, pod: str) -> str:
        """Whose STORAGE entries are ``pod``'s: its shared folder's, else its own."""
        return self._disk_group.get(pod, pod)

    def _holder(self, pod: str, tier: str) -> str:
        return self.disk_holder(pod) if tier == DISK else pod

    # ------------------------------------------------------------ updates

    def store(self, pod: str, tier: str, keys: Iterable[int]) -> None:
        pod = self._holder(pod, tier)
        owned = self._by_pod.setdefault(pod, set())
        for key in keys:
            holders = self._holders.setdefault(key, {})
            count = holders.get((pod, tier), 0)
            if not count:
                self._per_tier[(pod, tier)] = self._per_tier.get((pod, tier), 0) + 1
            holders[(pod, tier)] = count + 1
            owned.add(key)

    def remove(self, pod: str, tier: str, keys: Iterable[int]) -> None:
        pod = self._holder(pod, tier)
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                continue
            count = holders.get((pod, tier), 0) - 1
            if count > 0:
                holders[(pod, tier)] = count
                continue
            if holders.pop((pod, tier), None) is not None:
                self._per_tier[(pod, tier)] -= 1
            self._drop_if_unheld(pod, key, holders)

    def clear(self, pod: str, tier: str | None = None) -> None:
        """Forget ``pod``'s own blocks in ``tier`` (every tier when None); a shared
        disk folder's entries stay (:meth:`set_disk_group` drops them)."""
        for key in list(self._by_pod.get(pod, ())):
            holders = self._holders.get(key, {})
            for t in TIERS if tier is None else (tier,):
                holders.pop((pod, t), None)
            self._drop_if_unheld(pod, key, holders)
        for t in TIERS if tier is None else (tier,):
            self._per_tier.pop((pod, t), None)
        if tier is None or not self._by_pod.get(pod, True):
            self._by_pod.pop(pod, None)

    def forget(self, pod: str) -> None:
        """The pod's caches are gone (it died or restarted): its entries go with it, but
        not its shared disk folder's (those files stay, and their writers remove them)."""
        self.clear(pod)

    def _drop_if_unheld(self, pod: str, key: int, holders: dict[tuple[str, str], int]) -> None:
        if not any(p == pod for p, _ in holders):
            self._by_pod.get(pod, set()).discard(key)
        if not holders:
            self._holders.pop(key, None)

    def apply_batch(self, pod: str, batch: Any) -> int:
        """Apply one decoded ``EventBatch``; the number of events in it (see
        :meth:`apply`)."""
        return sum(self.apply(pod, batch))

    def apply(self, pod: str, batch: Any) -> tuple[int, int]:
        """Apply one decoded ``EventBatch`` (``[ts, events, dp_rank]``); returns the
        events applied and those of a medium this index does not know (skipped).
        Raises :class:`EventError` for a malformed batch, and :class:`OversizedBatch`
        for one past :data:`MAX_BATCH_EVENTS` events or :data:`MAX_BATCH_KEYS` block
        hashes (nothing of either applied)."""
        if not isinstance(batch, Sequence) or len(batch) < 2:
            raise EventError("an EventBatch is an array [ts, events, ...]")
        events = batch[1]
        if not isinstance(events, Sequence) or isinstance(events, (str, bytes)):
            raise EventError("EventBatch events is not an array")
        if len(events) > MAX_BATCH_EVENTS:
            raise OversizedBatch(f"{len(events)} events in one batch (at most {MAX_BATCH_EVENTS})")
        parsed = [parse_event(e) for e in events]
        keys_in_batch = sum(len(keys) for _, _, keys in parsed)
        if keys_in_batch > MAX_BATCH_KEYS:
            raise OversizedBatch(
                f"{keys_in_batch} block hashes in one batch (at most {MAX_BATCH_KEYS})")
        unknown = 0
        for kind, tier, keys in parsed:
            if tier is not None and tier not in TIERS:
                unknown += 1
            elif kind == "BlockStored":
                self.store(pod, tier, keys)
            elif kind == "BlockRemoved":
                self.remove(pod, tier, keys)
            else:  # AllBlocksCleared: a prefix cache reset; disk files stay
                for t in MEMORY_TIERS:
                    self.clear(pod, t)
        return len(parsed) - unknown, unknown

    # ------------------------------------------------------------ queries

    def holders(self, key: int) -> Mapping[tuple[str, str], int]:
        return self._holders.get(key, {})

    def pods(self) -> set[str]:
        return {p for p in self._by_pod if not p.startswith(_GROUP)}

    def tier_size(self, pod: str, tier: str) -> int:
        """Keys ``pod`` holds in ``tier`` (on STORAGE: its shared folder's, if any)."""
        return self._per_tier.get((self._holder(pod, tier), tier), 0)

    def size(self, pod: str | None = None) -> int:
        if pod is None:
            return len(self._holders)
        return len(self._by_pod.get(pod, ()))

    def match(
        self, keys: Sequence[int], pods: Iterable[str], gap: int = 1, host_gap: int = 1
    ) -> dict[str, Match]:
        """Each pod's cached prefix of the prompt whose block keys are ``keys``.

        The prefix is the run of held keys from the start; up to ``gap - 1`` unheld
        keys may sit between held ones (a group whose blocks span ``gap`` hash
        units is keyed only at every ``gap``-th hash; the host and disk tiers, without
        self-describing events, announce one key per chunk: ``host_gap``). The GPU
        part is the run held on the GPU; the rest continues it with keys held in any
        tier, since vLLM takes its GPU hit first and loads the rest from the host pool
        or, for chunks the pool no longer holds, from disk. Of that rest, a key held
        on the GPU or the host counts as host (as do the unheld keys before it), one
        held only on disk as disk.
        """
        gap = max(1, gap)
        any_gap = max(gap, host_gap)
        wanted = list(pods)
        # per pod: [gpu_end, any_end, gpu_open, misses_gpu, misses_any, disk holder]
        state = {p: [0, 0, True, 0, 0, self.disk_holder(p)] for p in wanted}
        # per pod: the ends of the held keys of its run past the GPU, with their tier
        spans: dict[str, list[tuple[int, bool]]] = {p: [] for p in wanted}
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            live = False
            for pod, st in state.items():
                if st[4] >= any_gap:
                    continue
                on_gpu = bool(holders) and (pod, GPU) in holders
                in_memory = on_gpu or (bool(holders) and (pod, HOST) in holders)
                anywhere = in_memory or (bool(holders) and (st[5], DISK) in holders)
                if st[2]:
                    if on_gpu:
                        st[0], st[3] = i + 1, 0
                    else:
                        st[3] += 1
                        if st[3] >= gap:
                            st[2] = False
                if anywhere:
                    st[1], st[4] = i + 1, 0
                    spans[pod].append((i + 1, not in_memory))
                else:
                    st[4] += 1
                live = live or st[4] < any_gap
            if not live:
                break
        out = {}
        for pod, st in state.items():
            gpu_end, any_end = st[0], st[1]
            disk, start = 0, 0
            for end, on_disk in spans[pod]:
                if end > gpu_end and on_disk:
                    disk += end - max(start, gpu_end)
                start = end
            out[pod] = Match(gpu_end, any_end - gpu_end - disk, disk)
        return out


def parse_event(event: Any) -> tuple[str, str | None, list[int]]:
    """``(kind, tier, keys)`` of one decoded KV event (a map with a ``type`` tag)."""
    if not isinstance(event, Mapping):
        raise EventError("a KV event is a map")
    kind = event.get("type")
    if kind == "AllBlocksCleared":
        return kind, None, []
    if kind not in ("BlockStored", "BlockRemoved"):
        raise EventError(f"unknown KV event type {kind!r}")
    medium = event.get("medium") or GPU
    if not isinstance(medium, str):
        raise EventError("a KV event's medium is a string")
    if medium not in TIERS:
        # a medium this router does not score: not an error
        return kind, medium, []
    hashes = event.get("block_hashes")
    if not isinstance(hashes, Sequence) or isinstance(hashes, (str, bytes)):
        raise EventError("block_hashes is not an array")
    keys = []
    for h in hashes:
        if isinstance(h, bool) or not isinstance(h, (bytes, int)):
            raise EventError("a block hash is bytes or an int")
        keys.append(external_key(h))
    return kind, medium, keys


def decode_batch(payload: bytes) -> Any:
    """msgpack ``EventBatch`` -> plain Python (msgspec comes with vLLM)."""
    import msgspec

    try:
        return msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise EventError(f"undecodable EventBatch: {e}") from e


class ApproxTracker:
    """The router's own record of what it sent where, as a GPU LRU that spills into
    a host LRU, each bounded by the pod's planned capacity in hash units. Its stores
    and evictions go into a :class:`PrefixIndex` as if the pod had published them."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._lru: dict[str, tuple[OrderedDict[int, None], OrderedDict[int, None]]] = {}
        self._cap: dict[str, tuple[int, int]] = {}

    def set_capacity(self, pod: str, gpu_units: int, host_units: int) -> None:
        self._cap[pod] = (max(0, gpu_units), max(0, host_units))
        self._lru.setdefault(pod, (OrderedDict(), OrderedDict()))
        self._trim(pod)

    def forget(self, pod: str) -> None:
        self._lru.pop(pod, None)
        self._cap.pop(pod, None)
        self.index.forget(pod)

    def record(self, pod: str, keys: Sequence[int]) -> None:
        """``pod`` is serving a prompt with these keys: they are its newest blocks."""
        if pod not in self._cap:
            return
        gpu, host = self._lru[pod]
        fresh, back = [], []
        for key in keys:
            if key in gpu:
                gpu.move_to_end(key)
                continue
            if key in host:
                del host[key]
                back.append(key)
            gpu[key] = None
            fresh.append(key)
        self.index.remove(pod, HOST, back)
        self.index.store(pod, GPU, fresh)
        self._trim(pod)

    def _trim(self, pod: str) -> None:
        gpu, host = self._lru[pod]
        gcap, hcap = self._cap[pod]
        spilled = []
        while len(gpu) > gcap:
            key, _ = gpu.popitem(last=False)
            spilled.append(key)
            if hcap:
                host[key] = None
        self.index.remove(pod, GPU, spilled)
        if hcap:
            self.index.store(pod, HOST, spilled)
        gone = []
        while len(host) > hcap:
            key, _ = host.popitem(last=False)
            gone.append(key)
        self.index.remove(pod, HOST, gone)

    def held(self, pod: str) -> tuple[int, int]:
        gpu, host = self._lru.get(pod, ((), ()))
        return len(gpu), len(host)
