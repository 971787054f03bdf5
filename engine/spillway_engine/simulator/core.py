"""The simulator's pure, synchronous core: one vLLM 0.33.0 replica in virtual time.

Nothing here sleeps, reads a clock or does I/O. :class:`EngineCore` holds the state of
one engine (GPU KV blocks, host pool, queues) and :meth:`EngineCore.step` runs one
scheduler iteration and advances the virtual clock ``now`` by the modelled duration of
that iteration. The HTTP server (``simulator.server``) paces the same core against the
wall clock; tests and benchmarks drive it directly (:func:`replay`) far faster than
real time. Everything is deterministic for a given plan, configuration, seed and input.


The engine's parts, each in a module of its own and mixed into :class:`EngineCore`:

- :mod:`.gpu_cache` -- the GPU KV cache (block pool, prefix hits, naming, windows, Mamba
  states);
- :mod:`.host_cache` -- the host pool (lookups, the chunks a prefill stores, loads and
  stores on the PCIe lanes), with Spillway's unit pool in :mod:`.unit_pool`;
- :mod:`.scheduling` -- one scheduler step, admission and preemption;
- :mod:`.config` -- the latency model and the scheduler's limits; :mod:`.counters` --
  the cumulative counters; :mod:`.request` -- a request's state and the trace entry.

Each module's docstring gives the rules it models.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import Any

from spillway_engine.arith import cdiv
from spillway_engine.simulator.config import LatencyModel, SchedulerConfig
from spillway_engine.simulator.counters import Counters
from spillway_engine.simulator.gpu_cache import GpuCache, _GpuPool, _group_salt
from spillway_engine.simulator.host_cache import HostCache, _HostPool, _UnitPool
from spillway_engine.simulator.plan_input import (
    PREFIX_KINDS,
    SimPlan,
    default_gpu_blocks,
    merge_groups,
)
from spillway_engine.simulator.request import (
    FINISHED,
    LOADING,
    RUNNING,
    WAITING,
    Observer,
    ReplayItem,
    RequestRejected,
    SimRequest,
)
from spillway_engine.simulator.scheduling import Scheduler
from spillway_engine.simulator.unit_pool import UnitPoolCache

__all__ = [
    "FINISHED",
    "LOADING",
    "RUNNING",
    "WAITING",
    "Counters",
    "EngineCore",
    "LatencyModel",
    "Observer",
    "ReplayItem",
    "RequestRejected",
    "SchedulerConfig",
    "SimRequest",
    "_group_salt",
    "replay",
]


class EngineCore(Scheduler, HostCache, UnitPoolCache, GpuCache):
    """One simulated engine. Drive with add_request / step / advance_to, or replay()."""

    def __init__(
        self,
        plan: SimPlan,
        *,
        gpu_blocks: int | None = None,
        latency: LatencyModel | None = None,
        scheduler: SchedulerConfig | None = None,
        seed: int = 0,
        observer: Observer | None = None,
    ) -> None:
        self.plan = plan
        self.latency = latency or LatencyModel()
        self.sched = scheduler or SchedulerConfig()
        self.max_model_len = self.sched.max_model_len or plan.max_model_len
        self.rng = random.Random(seed)
        self.observer = observer
        self.now = 0.0
        self.gpu = _GpuPool(gpu_blocks or default_gpu_blocks(plan))
        self.groups = merge_groups(plan.groups)
        self.tph = plan.tokens_per_hash
        self.align = plan.align_tokens
        full_tpcs = {g.tokens_per_chunk for g in self.groups if g.kind in PREFIX_KINDS}
        if len(full_tpcs) == 1:
            self.store_align = full_tpcs.pop()
        elif not full_tpcs:
            self.store_align = max(g.tokens_per_chunk for g in self.groups)
        else:
            self.store_align = self.align
        self.windowed = any(g.windowed for g in self.groups)
        self.full_groups = [g for g in self.groups if not g.windowed]
        self.tpb_gcd = math.gcd(*(g.tokens_per_block for g in self.groups))
        #: vLLM's Mamba groups share one block size (0: no Mamba group)
        self.mamba_tpb = next((g.tokens_per_block for g in self.groups if g.kind == "mamba"), 0)
        #: (tpb, r): a window group frees a block when computed % tpb == r
        self.window_phases = sorted(
            {
                (g.tokens_per_block, (g.window - 1) % g.tokens_per_block)
                for g in self.groups
                if g.window is not None
            }
        )
        self.pool_of = [0 for _ in self.groups]
        self.host_class_keys = [0 for _ in self.groups]
        self._init_host_pool(plan)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counters = Counters()
        #: payload bytes of each store / load operation since the exporter last drained
        self.store_ops: list[int] = []
        self.load_ops: list[int] = []
        self.h2d_free_at = 0.0
        self.d2h_free_at = 0.0
        #: (done at, keys pinned x member groups, the unit pool's pinned class keys)
        self._inflight_loads: deque[tuple[float, int, list[int]]] = deque()
        self._inflight_stores: deque[tuple[float, int, list[int]]] = deque()
        self._pinned_loads = 0
        self._pinned_stores = 0
        self._next_id = 0

    def _init_host_pool(self, plan: SimPlan) -> None:
        """The host pool the plan names: Spillway's unit pool, or upstream's rows."""
        token_group = next((g for g in self.groups if g.kind in PREFIX_KINDS), self.groups[0])
        self.token_group = token_group.index
        layout = plan.host_layout
        self.unit_pool = layout is not None
        if layout is not None:
            # Spillway: one pool of units; a class key takes its members' units.
            self.pools = [_UnitPool(layout.num_units)]
            self.key_weight = [g.units for g in self.groups]
            #: units an entry of class c holds with m members left: held_units[c][m]
            self.held_units = [list(accumulate(g.member_units, initial=0)) for g in self.groups]
            #: units of one chunk of every group (the manager's used_chunks divisor)
            self.chunk_set_units = sum(gs.units for gs in layout.groups)
            # the layout's anchor rule (first full-attention group) for pool tokens
            anchor = layout.anchor_group
            self.token_group = next(g.index for g in self.groups if anchor in g.members)
            # vLLM's cache gauges count keys over num_units // the smallest key
            self.host_slots = layout.num_units // min(gs.units for gs in layout.groups)
            #: within one chunk position, vLLM's LRU ranks higher groups older
            self.class_rank = [max(g.members) for g in self.groups]
        else:
            # Upstream: one pool of num_chunks rows, a class key weighs one row per group.
            self.pools = [_HostPool(plan.num_chunks)]
            self.key_weight = [g.weight for g in self.groups]
            self.host_slots = plan.num_chunks

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        arrival: float | None = None,
        rid: Any = None,
    ) -> SimRequest:
        """Queue a request (arrival defaults to ``now``); RequestRejected if vLLM would
        refuse it (too long for max_model_len or for the whole GPU KV cache)."""
        p = len(prompt)
        if p == 0:
            raise RequestRejected("the prompt is empty")
        if max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1")
        if p + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the request has {p} prompt tokens and max_tokens={max_tokens}"
            )
        need = self._blocks_for_length(p + max_tokens)
        if need > self.gpu.total:
            raise RequestRejected(
                f"the request needs {need} KV blocks but the GPU KV cache has {self.gpu.total}"
            )
        if rid is None:
            rid = self._next_id
        self._next_id += 1
        req = SimRequest(rid, prompt, max_tokens, self.now if arrival is None else arrival)
        hashes = self._hash_prompt(prompt)
        req.hashes = hashes
        bkeys = []
        for g in self.groups:
            hpb, salt = g.hashes_per_block, _group_salt(g.index)
            src = hashes if hpb == 1 else hashes[hpb - 1 :: hpb]
            bkeys.append([h ^ salt for h in src])
        req.bkeys = bkeys
        self.waiting.append(req)
        return req

    def _blocks_for_length(self, length: int) -> int:
        total = 0
        chunk = self.sched.max_num_batched_tokens
        for g in self.groups:
            blocks = cdiv(length, g.tokens_per_block)
            if g.kind == "mamba":
                blocks = 2
            elif g.window_blocks is not None:
                blocks = min(blocks, g.window_blocks + 2 + cdiv(chunk, g.tokens_per_block))
            total += blocks * g.weight
        return total

    # ------------------------------------------------------------------ queries

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def kv_cache_usage(self) -> float:
        return 1.0 - self.gpu.num_free / self.gpu.total

    def host_used_chunks(self) -> int:
        """Rows in use: a class key holds one row for each of its groups. Unit pool: the
        manager's figure, units in use // units of one chunk of every group."""
        if self.unit_pool:
            return self.pools[0].used // self.chunk_set_units
        return sum(n * g.weight for n, g in zip(self.host_class_keys, self.groups, strict=False))

    def host_tokens(self) -> int:
        g = self.groups[self.token_group]
        return self.host_class_keys[g.index] * g.tokens_per_chunk

    def host_pinned_fraction(self) -> tuple[float, float]:
        """(pinned by stores, pinned by loads) as fractions of the host rows."""
        self._expire_transfers()
        if not self.host_slots:
            return 0.0, 0.0
        return self._pinned_stores / self.host_slots, self._pinned_loads / self.host_slots

    def next_event_time(self) -> float | None:
        """When a waiting-on-load request becomes ready (None if none is loading)."""
        times = [r.ready_at for r in self.waiting if r.state == LOADING]
        return min(times) if times else None

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t

    # ------------------------------------------------------------------ helpers

    def run_until(self, t: float, *, break_stalls: bool = False) -> int:
        """Step up to virtual time ``t`` (a step may end past it), advancing over load
        waits, then set the clock to at least ``t``. A stall (waiting requests cannot
        be admitted and nothing runs) raises RuntimeError, or with ``break_stalls`` is
        broken by ``break_stall``. Returns the number of stalls broken."""
        broken = 0
        while self.has_work() and self.now < t:
            if self.step() == 0.0:
                nxt = self.next_event_time()
                if nxt is None or nxt > t:
                    break
                if nxt <= self.now:
                    if not break_stalls:
                        raise RuntimeError(
                            "simulator stalled: waiting requests cannot be admitted"
                        )
                    if not self.break_stall():
                        break
                    broken += 1
                    continue
                self.advance_to(nxt)
        self.advance_to(t)
        return broken

    def run_until_idle(self, limit_steps: int = 10_000_000) -> None:
        """Step until no request is left (advancing over load waits)."""
        for _ in range(limit_steps):
            if not self.has_work():
                return
            if self.step() == 0.0:
                nxt = self.next_event_time()
                if nxt is None or nxt <= self.now:
                    raise RuntimeError("simulator stalled: waiting requests cannot be admitted")
                self.advance_to(nxt)
        raise RuntimeError("simulator did not drain within the step limit")


def replay(
    core: EngineCore,
    items: Iterable[ReplayItem],
    *,
    until: float | None = None,
    on_reject: Callable[[ReplayItem, RequestRejected], None] | None = None,
) -> list[SimRequest]:
    """Feed ``items`` (sorted by arrival) into ``core`` at their arrival times and step
    until all finished (or the clock passes ``until``). Returns the requests added."""
    pending = deque(sorted(items, key=lambda it: it.arrival))
    added: list[SimRequest] = []
    while True:
        while pending and pending[0].arrival <= core.now:
            item = pending.popleft()
            try:
                added.append(core.add_request(item.prompt, item.max_tokens, item.arrival, item.rid))
            except RequestRejected as e:
                if on_reject is None:
                    raise
                on_reject(item, e)
        if until is not None and core.now >= until:
            break
        if core.has_work() and core.step() > 0.0:
            continue
        # Nothing ran: jump to the next arrival or the next load completion.
        candidates = [pending[0].arrival] if pending else []
        nxt = core.next_event_time()
        if nxt is not None and nxt > core.now:
            candidates.append(nxt)
        if not candidates:
            if core.has_work():
                raise RuntimeError("simulator stalled: waiting requests cannot be admitted")
            break
        core.advance_to(min(candidates))
    return added
