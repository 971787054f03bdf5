"""Spillway's unit pool in the simulator: the shipped manager's (``offloader/manager.py``)
admission, eviction, pins and LRU ranking, over ``EngineCore.pools[0]``."""

from __future__ import annotations

from spillway_engine.simulator.request import SimRequest


class UnitPoolCache:
    """:class:`~spillway_engine.simulator.core.EngineCore`'s unit-pool stores, loads and
    evictions (a plan with a host layout). Mixed into the core, beside
    :class:`~spillway_engine.simulator.host_cache.HostCache`."""

    def _rank_tail_first(self, entries: list[tuple[int, int, int]]) -> None:
        """Make (end token, class, key) entries the newest, tail first: vLLM's LRU
        re-ranks a request's keys so that its tail is evicted before its head, and at
        one position the highest group first."""
        keys = self.pools[0].keys
        rank = self.class_rank
        for _, _, key in sorted(entries, key=lambda e: (-e[0], -rank[e[1]])):
            if key in keys:
                keys.move_to_end(key)

    def _held(self, key: int) -> int:
        pool = self.pools[0]
        gi = pool.keys.get(key)
        if gi is not None:
            return self.key_weight[gi]
        gi, members = pool.broken[key]
        return self.held_units[gi][members]

    def _unpin(self, keys: list[int]) -> None:
        pins = self.pools[0].pins
        for key in keys:
            n = pins[key] - 1
            if n:
                pins[key] = n
            else:
                del pins[key]

    def _load_units(self, req: SimRequest, low: int, high: int) -> list[int]:
        pool = self.pools[0]
        entries = []
        for g in self.groups:
            tpc = g.tokens_per_chunk
            ckeys = self._chunk_keys(req, g)
            for c in range(low // tpc, min(high // tpc, len(ckeys))):
                if ckeys[c] in pool.keys:
                    entries.append(((c + 1) * tpc, g.index, ckeys[c]))
        self._rank_tail_first(entries)
        req.loaded = entries
        pinned = [key for _, _, key in entries]
        for key in pinned:
            pool.pins[key] = pool.pins.get(key, 0) + 1
        return pinned

    def _store_units(self, req: SimRequest) -> None:
        """Store the prompt's chunks in the unit pool. Like vLLM's connector, a
        Mamba state is stored by a call of its own (a boundary hand-off, offered
        before the step's chunk store), then the other groups' chunks by one call;
        each call is admitted whole or refused, and its offer alone is protected
        from its evictions."""
        c = self.counters
        pool = self.pools[0]
        keys, broken = pool.keys, pool.broken
        groups = self.groups
        entries: list[tuple[int, int, int]] = []  # (end token, class, key) offered
        # calls: (end token, offered keys as (class, key), offer); a call's missing
        # keys are found when it runs (an earlier call may have evicted some)
        states: list[tuple[int, list[tuple[int, int]], set[int]]] = []
        chunks: list[tuple[int, int]] = []
        chunk_offer: set[int] = set()
        for gi, run, first in self._request_store_keys(req):
            tpc = groups[gi].tokens_per_chunk
            mamba = groups[gi].kind == "mamba"
            skip = self._offered_from(req, gi, first)
            for i, key in enumerate(run[skip:], skip):
                end = (first + i + 1) * tpc
                entries.append((end, gi, key))
                if mamba:
                    states.append((end, [(gi, key)], {key}))
                else:
                    chunks.append((gi, key))
                    chunk_offer.add(key)
        states.sort(key=lambda call: call[0])
        stored_rows = stored_bytes = 0
        stored: list[int] = []
        held = self.held_units
        for _, offered, offer in [*states, (0, chunks, chunk_offer)]:
            fresh = [
                (gi, key, self.key_weight[gi] - (held[gi][broken[key][1]] if key in broken else 0))
                for gi, key in offered
                if key not in keys
            ]
            if not fresh:
                continue
            short = sum(missing for _, _, missing in fresh) - (pool.capacity - pool.used)
            if short > 0 and not self._make_room(short, offer):
                # vLLM's refusal: nothing evicted, nothing stored; the offer's
                # resident keys were still accessed by this request
                c.allocation_failures += 1
                continue
            for gi, key, missing in fresh:
                g = groups[gi]
                if key in broken:
                    members = broken.pop(key)[1]
                    rows = g.weight - members
                else:
                    self.host_class_keys[gi] += 1
                    rows = g.weight
                    if pool.ghosts:
                        pool.ghosts.pop(key, None)
                keys[key] = gi
                pool.used += missing
                pool.pins[key] = pool.pins.get(key, 0) + 1
                stored.append(key)
                stored_rows += rows
                stored_bytes += g.blocks_per_chunk * g.block_bytes * missing // self.key_weight[gi]
        # vLLM re-ranks every key the request accessed (loaded or offered) together,
        # tail first, when it finishes: a load's keys rank with the offer's
        self._rank_tail_first(entries + req.loaded)
        if stored_rows:
            self._queue_store(stored_rows, stored_bytes, stored)

    def _make_room(self, short: int, offer: set[int]) -> bool:
        """Evict LRU keys (not offered, not pinned) until ``short`` units are free; False,
        having evicted nothing, when the evictable units cannot cover it."""
        pool = self.pools[0]
        pins = pool.pins
        held = self._held
        locked = sum(held(k) for k in pins if k in pool.keys or k in pool.broken)
        locked += sum(
            held(k) for k in offer if k not in pins and (k in pool.keys or k in pool.broken)
        )
        if short > pool.used - locked:
            return False
        # Pick the victims first (no mutation while iterating), oldest first: keys
        # that already lost members, then the LRU.
        victims: list[int] = []
        left = short
        for od in (pool.broken, pool.keys):
            for key in od:
                if key in pins or key in offer:
                    continue
                victims.append(key)
                left -= held(key)
                if left <= 0:
                    break
            if left <= 0:
                break
        c = self.counters
        anchor = self.token_group
        for key in victims:
            if key in pool.keys:
                gi = pool.keys.pop(key)
                members = self.groups[gi].weight
            else:
                gi, members = pool.broken.pop(key)
            units = self.held_units[gi]
            # members go highest group first, as vLLM's LRU ranks one position's keys
            while members and short > 0:
                short -= units[members] - units[members - 1]
                pool.used -= units[members] - units[members - 1]
                members -= 1
                c.host_evictions += 1
            if members:
                pool.broken[key] = [gi, members]
                continue
            self.host_class_keys[gi] -= 1
            if gi == anchor:  # the manager remembers anchor-group keys for thrash
                pool.ghosts[key] = None
                if len(pool.ghosts) > pool.ghost_cap:
                    pool.ghosts.popitem(last=False)
        return True
