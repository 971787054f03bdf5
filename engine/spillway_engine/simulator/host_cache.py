"""The engine's host pool: lookups, the chunks a prefill stores, loads and stores on
the PCIe lanes, and the upstream pool of rows (Spillway's unit pool: ``unit_pool.py``).

Host pool (vLLM's ``OffloadingConnector`` + ``CPUOffloadingManager``, LRU policy)
    A chunk of group g is ``blocks_per_chunk_g`` of its blocks (``tpc_g`` tokens), named
    by the hash ending at its last token. Upstream plans: one pool of ``num_chunks``
    rows shared by all (chunk, group) keys, a key takes one row. Spillway plans: the
    shipped manager's unit pool (``offloader/manager.py``): ``num_units`` units, a key
    of group g takes ``units_g``, one LRU over every group's keys; a store is admitted
    whole or refused (``allocation_failures``), room is made by evicting LRU keys that
    are neither in the store's own offer nor pinned by an in-flight load or store, and
    keys are ranked like vLLM's LRU policy ranks them (a request's keys tail first,
    so a pool evicts a prefix's tail before its head). A merged class key is evicted
    member by member (highest group first); a key missing a member is no hit.
    When a prefill completes, its complete prompt chunks are stored (prompt only,
    like ``offload_prompt_only``): every chunk of full/MLA groups, the chunks of the
    last window before the replay boundary ``floor((P-1)/A)*A`` and before the shared-
    prefix junction for windowed groups (A = the full groups' chunk span, vLLM's
    ``alignment_tokens``), one state chunk at each of those points for Mamba groups.
    A Mamba state is offered only when this request named its GPU block (vLLM's
    boundary hand-off: not for a state it hit on the GPU, which is then neither stored
    nor refreshed), by a store call of its own before the chunk store; each call is
    admitted whole and protects only its own offer. A request that loaded from the
    host offers no chunk before the end of its hit (vLLM's ``CHUNK_LEVEL`` offload
    policy); without a load, a window chunk is not offered when a block of the
    connector's store mask (the window before the boundary, aligned on the full
    chunk span A) is null, as the window chunks inside a GPU hit are. Keys already
    present are refreshed; a full pool evicts its least recently used key.
    An evicted key that a later request needs again counts as *thrash*. Lookup happens
    when a waiting request is admitted, beyond the GPU hit, with the same per-kind rules
    at chunk granularity; a group that cannot extend the hit by a chunk makes the whole
    host hit 0. Hits are loaded asynchronously: the request waits
    (``num_requests_waiting``) until its load is done, then prefills the rest.

"""

from __future__ import annotations

from collections import OrderedDict

from spillway_engine.arith import cdiv
from spillway_engine.simulator.request import LOADING, SimRequest

_MAX_PENDING_OPS = 1 << 16  # transfer sizes kept for the exporter when nobody drains


class _HostPool:
    """Host rows under LRU; a key weighs ``w`` rows (its class's groups sharing a pool)."""

    __slots__ = ("capacity", "ghost_cap", "ghosts", "keys", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.keys: OrderedDict[int, int] = OrderedDict()  # key -> class index
        self.ghosts: OrderedDict[int, None] = OrderedDict()
        self.ghost_cap = max(4 * capacity, 1024)


class _UnitPool(_HostPool):
    """Spillway's unit pool: ``capacity`` and ``used`` count units.

    ``keys`` holds complete class keys (every member group's key present), in LRU
    order; ``broken`` those that lost members to eviction (key -> [class, members
    left]); they are no hit and go first. ``pins`` counts in-flight transfers per key.
    """

    __slots__ = ("broken", "pins")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.broken: OrderedDict[int, list[int]] = OrderedDict()
        self.pins: dict[int, int] = {}


class HostCache:
    """:class:`~spillway_engine.simulator.core.EngineCore`'s host half: lookups beyond the
    GPU hit, the chunks a prefill offers, upstream stores, and the transfers on the
    host-to-device and device-to-host lanes. Mixed into the core, whose ``__init__``
    sets the state (``self.pools``, ``self.key_weight``, the lanes and pins)."""

    def _chunk_keys(self, req: SimRequest, g) -> list[int]:
        bpc = g.blocks_per_chunk
        keys = req.bkeys[g.index]
        return keys if bpc == 1 else keys[bpc - 1 :: bpc]

    def _host_group_hit(self, req: SimRequest, g, low: int, cand: int) -> int:
        tpc = g.tokens_per_chunk
        pool = self.pools[self.pool_of[g.index]].keys
        ckeys = self._chunk_keys(req, g)
        top = min(cand // tpc, len(ckeys))
        if not g.windowed:
            i = start = low // tpc
            while i < top and ckeys[i] in pool:
                i += 1
            return i * tpc if i > start else 0
        if g.kind == "mamba":
            for c in range(top, low // tpc, -1):
                if ckeys[c - 1] in pool:
                    return c * tpc
            return 0
        need = g.window_chunks
        count = 0
        for c in range(top - 1, -1, -1):
            if ckeys[c] in pool:
                count += 1
                if count == need:
                    return (c + need) * tpc
            else:
                count = 0
        return count * tpc

    def _host_hit(self, req: SimRequest, low: int) -> int:
        """Tokens (from 0) the host pool can supply beyond ``low``; 0 if none."""
        if not self.plan.num_chunks:
            return 0
        cand = min(req.prompt_len - 1, len(req.hashes) * self.tph)
        while True:
            new = cand
            for g in self.groups:
                new = min(new, self._host_group_hit(req, g, low, new))
                if new <= low:
                    return 0
            if new == cand:
                return cand
            cand = new

    def _request_store_keys(self, req: SimRequest) -> list[tuple[int, list[int], int]]:
        """The chunks a finished prefill stores, as runs of consecutive chunks:
        (class index, their keys, index of the first chunk)."""
        if req.store_keys is not None:
            return req.store_keys
        out: list[tuple[int, list[int], int]] = []
        p = min(req.prompt_len, len(req.hashes) * self.tph)
        boundary = min((req.prompt_len - 1) // self.store_align * self.store_align, p)
        ends = [boundary]
        if req.junction and req.junction < boundary:
            ends.append(req.junction // self.store_align * self.store_align)
        for g in self.groups:
            tpc = g.tokens_per_chunk
            ckeys = self._chunk_keys(req, g)
            if not g.windowed:
                n = min(p // tpc, len(ckeys))
                if n:
                    out.append((g.index, ckeys[:n], 0))
                continue
            need = 1 if g.kind == "mamba" else g.window_chunks
            runs: list[tuple[int, int]] = []
            for point in sorted(ends):
                end = min(point // tpc, len(ckeys))
                first = max(0, end - need)
                if runs and first <= runs[-1][1]:
                    runs[-1] = (runs[-1][0], max(end, runs[-1][1]))
                elif end > first:
                    runs.append((first, end))
            out.extend((g.index, ckeys[a:b], a) for a, b in runs)
        req.store_keys = out
        return out

    def _offered_from(self, req: SimRequest, gi: int, first: int) -> int:
        """Index in a run of chunks from which the store offers keys; the keys before
        it are neither stored nor refreshed. vLLM's connector offers a Mamba state
        only when this request named its GPU block (a boundary hand-off), never for a
        state it hit on the GPU. A request that loaded from the host offers no chunk
        before the end of its hit (``update_state_after_alloc`` moves every group's
        ``next_stored_chunk_idx`` there, ``OffloadPolicy.CHUNK_LEVEL``): neither the
        loaded chunks nor the ones it hit on the GPU are refreshed by a store.
        Without a load, a window group's chunk is skipped when its last block, or a
        block of the connector's store mask (``reachable_block_mask`` aligned on the
        full-attention chunk), is the null block: a request that hit a prefix holds
        only the window's blocks before the hit point, so the window chunks inside a
        hit are not offered again (their host copies age) while full-attention chunks
        are. Other chunks are offered again."""
        g = self.groups[gi]
        if g.kind == "mamba":
            return max(0, req.local_hit // g.tokens_per_chunk - first)
        if req.external_hit:
            hit_chunks = cdiv(req.local_hit + req.external_hit, g.tokens_per_chunk)
            return max(0, hit_chunks - first)
        null = req.null_upto[gi] if req.null_upto else 0
        if not g.windowed or not null:
            return 0
        bpc = g.blocks_per_chunk
        # the connector's store mask (its alignment: the full-attention chunk), not
        # the GPU's naming mask: a window wider than the hit's held blocks reaches
        # back into a chunk whose first blocks are null, and that chunk is skipped
        reach = self._swa_reachable(req, g, self.store_align)
        skip = 0
        for c in range(first, null // bpc + 1):
            blocks = range(c * bpc, (c + 1) * bpc)
            named = blocks if reach is None else [b for b in blocks if b in reach]
            if blocks[-1] >= null and all(b >= null for b in named):
                break
            skip += 1
        return skip

    def _store_prompt(self, req: SimRequest) -> None:
        c = self.counters
        if not self.plan.num_chunks:
            c.allocation_failures += 1
            return
        if self.unit_pool:
            self._store_units(req)
            return
        stored_rows = 0
        stored_bytes = 0
        groups = self.groups
        for gi, run, first in self._request_store_keys(req):
            run = run[self._offered_from(req, gi, first) :]
            pool = self.pools[self.pool_of[gi]]
            keys = pool.keys
            ghosts = pool.ghosts
            w = self.key_weight[gi]
            if w > pool.capacity:
                c.allocation_failures += 1
                continue
            g = groups[gi]
            added = 0
            for key in run:
                if key in keys:
                    keys.move_to_end(key)
                    continue
                while pool.used + w > pool.capacity:
                    old, old_class = keys.popitem(last=False)
                    pool.used -= self.key_weight[old_class]
                    self.host_class_keys[old_class] -= 1
                    c.host_evictions += groups[old_class].weight
                    ghosts[old] = None
                    if len(ghosts) > pool.ghost_cap:
                        ghosts.popitem(last=False)
                keys[key] = gi
                pool.used += w
                added += 1
                if ghosts:
                    ghosts.pop(key, None)
            if added:
                self.host_class_keys[gi] += added
                stored_rows += added * g.weight
                stored_bytes += added * g.blocks_per_chunk * g.block_bytes
        if stored_rows:
            self._queue_store(stored_rows, stored_bytes, [])

    def _count_thrash(self, req: SimRequest, reused_upto: int) -> None:
        """Count the evicted chunks this request needs again (beyond what it reuses)."""
        for gi, run, first in self._request_store_keys(req):
            ghosts = self.pools[self.pool_of[gi]].ghosts
            if not ghosts:
                continue
            tpc = self.groups[gi].tokens_per_chunk
            # chunk c ends at (c + 1) * tpc; only chunks ending past reused_upto count
            skip = max(0, reused_upto // tpc - first)
            # the manager counts anchor-group keys only (one each); upstream every row
            weight = 1 if self.unit_pool else self.groups[gi].weight
            for key in run[skip:]:
                if key in ghosts:
                    del ghosts[key]
                    self.counters.host_thrash += weight

    def _touch_host(self, req: SimRequest, low: int, high: int) -> list[int]:
        """Refresh the keys a load reads; the unit pool pins them (returned)."""
        if self.unit_pool:
            return self._load_units(req, low, high)
        for g in self.groups:
            keys = self.pools[self.pool_of[g.index]].keys
            tpc = g.tokens_per_chunk
            ckeys = self._chunk_keys(req, g)
            for c in range(low // tpc, min(high // tpc, len(ckeys))):
                key = ckeys[c]
                if key in keys:
                    keys.move_to_end(key)
        return []

    def _start_load(self, req: SimRequest, low: int, high: int) -> None:
        loaded_bytes = 0
        rows = 0
        for g in self.groups:
            tpb = g.tokens_per_block
            if g.kind == "mamba":
                blocks = 1
            else:
                first = low // tpb
                if g.window is not None:
                    first = max(first, high // tpb - g.window_blocks)
                blocks = max(0, high // tpb - first)
            loaded_bytes += blocks * g.block_bytes
            rows += cdiv(blocks, g.blocks_per_chunk) * g.weight
        pinned = self._touch_host(req, low, high)
        seconds = loaded_bytes / self.plan.copies / self.latency.pcie_bytes_per_s
        self.h2d_free_at = max(self.now, self.h2d_free_at) + seconds
        req.ready_at = self.h2d_free_at
        req.state = LOADING
        self._inflight_loads.append((req.ready_at, rows, pinned))
        self._pinned_loads += rows
        c = self.counters
        c.load_bytes += loaded_bytes
        c.load_time += seconds * self.plan.copies
        self.load_ops.append(loaded_bytes)
        if len(self.load_ops) > _MAX_PENDING_OPS:
            del self.load_ops[: _MAX_PENDING_OPS // 2]
        # The loaded blocks hold valid KV: name them so others can hit them.
        self._cache_computed(req)

    def _queue_store(self, rows: int, nbytes: int, pinned: list[int]) -> None:
        """Put a store on the device-to-host lane; its keys stay pinned until it lands."""
        c = self.counters
        seconds = nbytes / self.plan.copies / self.latency.pcie_bytes_per_s
        self.d2h_free_at = max(self.now, self.d2h_free_at) + seconds
        self._inflight_stores.append((self.d2h_free_at, rows, pinned))
        self._pinned_stores += rows
        c.store_bytes += nbytes
        c.store_time += seconds * self.plan.copies
        self.store_ops.append(nbytes)
        if len(self.store_ops) > _MAX_PENDING_OPS:
            del self.store_ops[: _MAX_PENDING_OPS // 2]

    def _expire_transfers(self) -> None:
        now = self.now
        for inflight in (self._inflight_loads, self._inflight_stores):
            while inflight and inflight[0][0] <= now:
                _, rows, keys = inflight.popleft()
                if inflight is self._inflight_loads:
                    self._pinned_loads -= rows
                else:
                    self._pinned_stores -= rows
                if keys:
                    self._unpin(keys)
