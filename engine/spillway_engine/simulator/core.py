"""The simulator's pure, synchronous core: one vLLM 0.33.0 replica in virtual time.

Nothing here sleeps, reads a clock or does I/O. :class:`EngineCore` holds the state of
one engine (GPU KV blocks, host pool, queues) and :meth:`EngineCore.step` runs one
scheduler iteration and advances the virtual clock ``now`` by the modelled duration of
that iteration. The HTTP server (``simulator.server``) paces the same core against the
wall clock; tests and benchmarks drive it directly (:func:`replay`) far faster than
real time. Everything is deterministic for a given plan, configuration, seed and input.

GPU KV cache (vLLM's ``BlockPool`` + hybrid ``KVCacheCoordinator``)
    ``gpu_blocks`` blocks shared by every KV group; a block belongs to one group at a
    time. Prompt tokens are hashed in chained units of ``tokens_per_hash`` tokens
    (``h_i = hash((h_{i-1}, tokens[i*tph:(i+1)*tph]))``); a group's block ``b`` is named by the
    hash ending at its last token, ``hashes[(b+1)*tpb/tph - 1]``, plus the group index
    (``hash XOR a per-group constant``). Full blocks of the prompt are cached; blocks
    with no holder stay cached in an LRU free queue until a new allocation evicts them
    (a finished request's blocks are freed tail first, so a shared head outlives its
    tails, as in vLLM); blocks freed unnamed are reused before any cached one (vLLM
    puts them at the head of its free queue). A block computed or loaded again while
    an older block of its key is still cached is named too (vLLM's prefix cache keeps
    both: a hit takes the older, each leaves the LRU on its own). Usage
    (``vllm:kv_cache_usage_perc``) is held blocks / all blocks.

    Hit length (never the last prompt token; a multiple of every group's block): full-
    attention / MLA groups need every block of the prefix; sliding-window and chunked-
    local groups only the ``cdiv(window-1, tpb)`` blocks before the hit point; Mamba
    groups one cached state at exactly the hit point. The groups are asked in turn with
    the smallest answer so far until the answer stops changing.

    Retention (vLLM's default ``prefix_cache_retention_interval = 0``): a sliding-
    window group names only the ``cdiv(window-1, tpb)`` blocks ending at the replay
    boundary ``floor((P-1)/A)*A`` (A = the lcm of the groups' blocks, vLLM's scheduler
    block) and at the shared-prefix junction (vLLM's ``shared_prefix_boundary``: the
    full-attention GPU hit when a sparse group stopped short of it); its other blocks
    are freed unnamed as they slide out of the window (``reachable_block_mask``).
    Chunked-local groups (treated as a window of the attention chunk) name every
    block. A Mamba group ("align" mode, no prefill checkpoint blocks) holds, while a
    request prefills, its running state plus one more block: the state its GPU hit
    touched, the state loaded from the host, or the block whose state vLLM caches at
    the prompt's last block boundary L (vLLM ends a prefill chunk there). When the
    prefill completes, the state at L is named and that block released to the LRU
    (vLLM frees it on the next step); the running state is held until the request
    finishes; a state is also kept at the junction. Generated (decode) tokens are not
    hashed, so only prompts are reusable. Groups of identical geometry (kind, block,
    window, chunk) are tracked as one class whose blocks and host keys weigh one block
    / row per member group (Gemma 3's six window groups act together, as they would
    in vLLM; evicting a merged block frees its members together, which loses the
    same hits as vLLM evicting them one at a time).

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

Scheduler (vLLM V1, FCFS, chunked prefill)
    Each step has a budget of ``max_num_batched_tokens`` tokens and at most
    ``max_num_seqs`` running requests. Running requests go first (1 token when
    decoding, the rest of the prompt up to the budget when prefilling); if their new
    blocks do not fit, the last running request is preempted (blocks freed, all of its
    tokens recomputed later; ``vllm:num_preemptions``). Then waiting requests are
    admitted in order while the budget, seat count and free blocks allow (none in a
    step that preempted). A prefill's last chunk yields the first token.

Latency model (all in seconds of modelled time; constants in :class:`LatencyModel`)
    step      = (step_overhead_s + max(prefill_s_per_token * prefill_tokens
                 + decode_s_per_seq * decoding_requests, memory_floor_s))
                * (1 + U(-jitter, +jitter))
    host load = bytes_per_rank / pcie_bytes_per_s, serialised on the host-to-device
                link (bytes_per_rank = blocks loaded * page_bytes * layers of the group);
                the request waits for it, other requests keep running
    host store= the same on the device-to-host link; it delays nobody
    TTFT      = first token time - arrival (queueing + loads + prefill steps)
    queue     = first admission - arrival;  ITL = time between a request's tokens
    Defaults approximate an 8B dense model on one H100: 4 ms per step, 60 us per prefill
    token (~16.7k tokens/s), 50 us per decoding sequence, 25 GB/s effective PCIe, 2%
    jitter. A host hit of T tokens therefore costs T * bytes_per_token / 25e9 s instead
    of 60e-6 * T s of prefill (~23x cheaper at Llama-3.1-8B's 131 kB/token).
    Transfers in metrics are summed over the plan's copies (TP workers), as vLLM does:
    bytes x copies, seconds x copies. The constants are not scaled by model size.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Protocol

from spillway_engine.arith import cdiv
from spillway_engine.simulator.plan_input import (
    PREFIX_KINDS,
    SimPlan,
    default_gpu_blocks,
    merge_groups,
)

WAITING, LOADING, RUNNING, FINISHED = "waiting", "loading", "running", "finished"
_HASH_SEED = 0x5EED_5B11
_GOLDEN = 0x9E3779B97F4A7C15


def _group_salt(index: int) -> int:
    """Per-group constant XORed into block hashes: (hash, group) keys stay small ints."""
    return ((index + 1) * _GOLDEN) & 0x7FFF_FFFF_FFFF_FFFF


_MAX_PENDING_OPS = 1 << 16  # transfer sizes kept for the exporter when nobody drains


@dataclass(frozen=True)
class LatencyModel:
    step_overhead_s: float = 0.004
    prefill_s_per_token: float = 60e-6
    decode_s_per_seq: float = 50e-6
    pcie_bytes_per_s: float = 25e9
    jitter: float = 0.02
    #: A step never computes faster than the GPU reads the weights once (a roofline's
    #: memory side); 0 keeps the additive model above.
    memory_floor_s: float = 0.0

    @classmethod
    def emulating(cls, gpu: Any, cost: Any, speed: float, overhead_s: float = 0.0,
                  jitter: float = 0.0) -> LatencyModel:
        """The emulated GPU worker's step times (``spillway_engine.emulator.latency``:
        the larger of compute and one weight read, times ``speed``), plus the engine's
        own CPU time per step (``overhead_s``, measured: the emulator does not sleep
        it out). KV reads are left out (tiny next to the weights of the modelled size)."""
        from spillway_engine.emulator.latency import memory_s, prefill_tokens_per_s, transfer_s

        per_token = speed / prefill_tokens_per_s(gpu, cost)
        link = 1.0 / (transfer_s(1.0, gpu) * speed) if speed > 0 else float("inf")
        return cls(step_overhead_s=overhead_s, prefill_s_per_token=per_token,
                   decode_s_per_seq=per_token, pcie_bytes_per_s=link, jitter=jitter,
                   memory_floor_s=memory_s(gpu, cost) * speed)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: None: the plan's max_model_len
    max_model_len: int | None = None


class RequestRejected(ValueError):
    """vLLM would answer this request with HTTP 400."""


class Observer(Protocol):
    def on_finished(self, req: SimRequest) -> None: ...
    def on_token(self, req: SimRequest, itl: float | None) -> None: ...


#: A GPU block (one block of every group in a class) as a mutable triple, for speed:
#: [key (int hash, or None while unnamed), ref (holders), w (pool blocks it weighs)]
_Block = list


class SimRequest:
    """One request's state; timing fields are filled as it progresses."""

    __slots__ = (
        "admitted",
        "arrival",
        "bkeys",
        "blocks",
        "cached_upto",
        "external_hit",
        "finish_time",
        "first_scheduled",
        "first_token_time",
        "freed_upto",
        "hashes",
        "junction",
        "last_token_time",
        "loaded",
        "local_hit",
        "mamba_want",
        "max_tokens",
        "null_upto",
        "num_computed",
        "num_output",
        "num_preemptions",
        "output_ids",
        "prefill_counted",
        "prompt",
        "prompt_len",
        "ready_at",
        "rid",
        "sink",
        "state",
        "store_keys",
        "target",
        "user_data",
    )

    def __init__(self, rid: Any, prompt: Sequence[int], max_tokens: int, arrival: float):
        self.rid = rid
        self.prompt = prompt
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.state = WAITING
        self.hashes: list[int] = []
        self.bkeys: list[list[int]] = []  # per class: key of block b (hash of its end)
        self.blocks: list[list[_Block | None]] = []
        self.cached_upto: list[int] = []
        self.freed_upto: list[int] = []
        #: per class: blocks before this index were null at admission (a window
        #: group's blocks before its window at the hit point)
        self.null_upto: list[int] = []
        self.num_computed = 0
        self.num_output = 0
        self.target = self.prompt_len  # tokens to prefill (prompt + outputs after preemption)
        self.admitted = False
        self.ready_at = 0.0
        self.local_hit = 0
        self.external_hit = 0
        self.num_preemptions = 0
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.output_ids: list[int] = []
        self.store_keys: list[tuple[int, list[int], int]] | None = None
        #: shared-prefix junction whose window tail / state is retained (vLLM's
        #: ``shared_prefix_boundary``): the GPU full-attention hit when a sparse group
        #: stopped short of it at admission, else 0
        self.junction = 0
        #: the unit pool's keys this request loaded, as (end token, class, key)
        self.loaded: list[tuple[int, int, int]] = []
        #: GPU blocks each Mamba group holds while prefilling (see EngineCore._mamba_want)
        self.mamba_want = 1
        self.prefill_counted = False
        self.sink: Callable[[SimRequest, int, bool], None] | None = None
        self.user_data: Any = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival


@dataclass
class Counters:
    """Cumulative counters (what vLLM's and Spillway's counters export)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    cached_device: int = 0
    cached_host: int = 0
    by_source_local_compute: int = 0
    by_source_local_cache_hit: int = 0
    by_source_external: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    store_bytes: int = 0
    store_time: float = 0.0
    load_bytes: int = 0
    load_time: float = 0.0
    allocation_failures: int = 0
    host_evictions: int = 0
    host_thrash: int = 0
    host_lookup_tokens: int = 0
    host_hit_tokens: int = 0
    gpu_evictions: int = 0
    steps: int = 0


class _GpuPool:
    """The GPU block pool: fresh capacity plus an LRU queue of cached, unheld blocks.

    Like vLLM's ``BlockHashToBlockMap``, a key may name several blocks: a block
    computed or loaded again while an older copy is still cached (a host load whose
    full-attention blocks were still on the GPU, with the window's blocks gone) is
    named too. ``cached`` maps a key to the block a hit takes (the first named of those
    still cached, vLLM's ``get_one_block``), ``dups`` to the later ones in order; the
    LRU queue holds blocks (by identity), each evicted on its own."""

    __slots__ = ("cached", "dups", "evictable", "evictable_w", "evictions", "free_fresh", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        self.free_fresh = total
        #: id(block) -> block, unheld cached blocks in LRU order
        self.evictable: OrderedDict[int, _Block] = OrderedDict()
        self.evictable_w = 0
        self.cached: dict[int, _Block] = {}
        self.dups: dict[int, list[_Block]] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return self.free_fresh + self.evictable_w

    def name(self, blk: _Block, key: int) -> None:
        """Name an unnamed block ``key`` (after any block already named so)."""
        blk[0] = key
        if key in self.cached:
            self.dups.setdefault(key, []).append(blk)
        else:
            self.cached[key] = blk

    def _unname(self, blk: _Block) -> None:
        """Drop an evicted block's name; the key stays cached while another holds it."""
        key = blk[0]
        blk[0] = None
        more = self.dups.get(key)
        if more is None:
            del self.cached[key]
            return
        if self.cached[key] is blk:
            self.cached[key] = more.pop(0)
        else:
            # by identity: blocks are lists, and equal ones are other blocks
            del more[next(i for i, b in enumerate(more) if b is blk)]
        if not more:
            del self.dups[key]

    def reserve(self, w: int) -> None:
        """Take ``w`` blocks of fresh capacity, evicting LRU cached blocks as needed."""
        if self.free_fresh < w:
            evictable = self.evictable
            fresh = self.free_fresh
            evicted = 0
            while fresh < w:
                _, old = evictable.popitem(last=False)
                self._unname(old)
                fresh += old[2]
                evicted += old[2]
            self.free_fresh = fresh
            self.evictable_w -= evicted
            self.evictions += evicted
        self.free_fresh -= w

    def free(self, blk: _Block) -> None:
        blk[1] -= 1
        if blk[1] == 0:
            if blk[0] is None:
                self.free_fresh += blk[2]
            else:
                self.evictable[id(blk)] = blk
                self.evictable_w += blk[2]


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


class EngineCore:
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

    def _hash_prompt(self, prompt: Sequence[int]) -> list[int]:
        tph = self.tph
        h = _HASH_SEED
        t = tuple(prompt)
        return [h := hash((h, t[i : i + tph])) for i in range(0, len(t) - tph + 1, tph)]

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

    # ------------------------------------------------------------------ lookups

    def _gpu_group_hit(self, req: SimRequest, g, cand: int, memo: dict) -> int:
        tpb = g.tokens_per_block
        top = cand // tpb
        cached = self.gpu.cached
        keys = req.bkeys[g.index]
        if not g.windowed:
            n = memo.get(g.index)
            if n is None:
                n = 0
                for key in keys:
                    if key not in cached:
                        break
                    n += 1
                memo[g.index] = n
            return min(n, top) * tpb
        if g.kind == "mamba":
            for b in range(min(top, len(keys)), 0, -1):
                if keys[b - 1] in cached:
                    return b * tpb
            return 0
        need = g.window_blocks
        count = 0
        for b in range(min(top, len(keys)) - 1, -1, -1):
            if keys[b] in cached:
                count += 1
                if count == need:
                    return (b + need) * tpb
            else:
                count = 0
        return count * tpb

    def _gpu_hit(self, req: SimRequest) -> int:
        """vLLM's hybrid coordinator: the longest hit every group agrees on. Also sets
        ``req.junction`` (vLLM's ``shared_prefix_boundary``): the full-attention
        hit when a sparse group stopped short of it, else 0."""
        cap = min(req.prompt_len - 1, len(req.hashes) * self.tph)
        cand = start = cap // self.align * self.align
        memo: dict = {}
        req.junction = 0
        while cand > 0:
            new = cand
            for g in self.groups:
                new = min(new, self._gpu_group_hit(req, g, new, memo))
                if new == 0:
                    break
            if new == cand:
                break
            cand = new
        cand = max(cand, 0)
        if self.windowed and self.full_groups:
            reach = start
            for g in self.full_groups:
                reach = min(reach, self._gpu_group_hit(req, g, start, memo))
            reach = reach // self.align * self.align
            if reach > cand:
                req.junction = reach
        return cand

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

    # ------------------------------------------------------------------ blocks

    def _new_blocks_needed(self, req: SimRequest, upto: int) -> int:
        need = 0
        for g, blocks in zip(self.groups, req.blocks, strict=False):
            if g.kind == "mamba":
                if req.mamba_want > len(blocks):
                    need += (req.mamba_want - len(blocks)) * g.weight
            else:
                more = cdiv(upto, g.tokens_per_block) - len(blocks)
                if more > 0:
                    need += more * g.weight
        return need

    def _grow(self, req: SimRequest, upto: int) -> None:
        gpu = self.gpu
        for g, blocks in zip(self.groups, req.blocks, strict=False):
            w = g.weight
            k = (
                req.mamba_want - len(blocks)
                if g.kind == "mamba"
                else cdiv(upto, g.tokens_per_block) - len(blocks)
            )
            if k <= 0:
                continue
            gpu.reserve(k * w)
            blocks.extend([[None, 1, w] for _ in range(k)])

    def _free_all(self, req: SimRequest) -> None:
        """Release every block, tail first (so heads stay cached the longest)."""
        gpu = self.gpu
        evictable = gpu.evictable
        fresh = cached_w = 0
        for blocks in req.blocks:
            for blk in reversed(blocks):
                if blk is None:
                    continue
                ref = blk[1] - 1
                blk[1] = ref
                if not ref:
                    if blk[0] is None:
                        fresh += blk[2]
                    else:
                        evictable[id(blk)] = blk
                        cached_w += blk[2]
        gpu.free_fresh += fresh
        gpu.evictable_w += cached_w
        req.blocks = []

    def _cache_computed(self, req: SimRequest) -> None:
        """Name full prompt blocks now computed; drop blocks that slid out of windows."""
        done = req.num_computed
        name = self.gpu.name
        for g, blocks in zip(self.groups, req.blocks, strict=False):
            if g.kind == "mamba":
                continue
            keys = req.bkeys[g.index]
            upto = min(done // g.tokens_per_block, len(blocks), len(keys))
            b = req.cached_upto[g.index]
            if b < upto:
                reach = self._swa_reachable(req, g)
                while b < upto:
                    blk = blocks[b]
                    if blk is not None and blk[0] is None and (reach is None or b in reach):
                        # named even when an older block of this key is still cached
                        name(blk, keys[b])
                    b += 1
                req.cached_upto[g.index] = b
            if g.window is not None:
                first = min(max(0, done - g.window + 1) // g.tokens_per_block, len(blocks))
                i = req.freed_upto[g.index]
                if i < first:
                    free = self.gpu.free
                    while i < first:
                        blk = blocks[i]
                        if blk is not None:
                            free(blk)
                            blocks[i] = None
                        i += 1
                    req.freed_upto[g.index] = first

    def _swa_reachable(self, req: SimRequest, g, align: int = 0) -> set[int] | None:
        """Blocks of a sliding-window group that vLLM names (``reachable_block_mask``
        at the default ``prefix_cache_retention_interval = 0``): the window's blocks
        ending at the replay boundary ``floor((P-1)/A)*A`` and at the shared-prefix
        junction; the rest are freed unnamed (reused first). None: every block.
        A is the scheduler's block (GPU naming) unless ``align`` is given: the
        connector's store mask aligns on the full-attention chunk (``store_align``)."""
        tpb = g.tokens_per_block
        align = align or self.align
        if g.kind != "sliding_window" or align % tpb:
            return None
        need = g.window_blocks
        out: set[int] = set()
        for point in (req.prompt_len - 1, req.junction):
            end = point // align * align // tpb
            out.update(range(max(0, end - need), end))
        return out

    # ------------------------------------------------------------------ host pool

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

    # ------------------------------------------------------------------ unit pool

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

    # ------------------------------------------------------------------ admission

    def _admit(self, req: SimRequest, budget: int) -> int:
        """Try to admit a waiting request. Returns the tokens scheduled now, -1 when
        an asynchronous host load was started, -2 when its blocks do not fit."""
        local = self._gpu_hit(req)
        host_upto = self._host_hit(req, local)
        external = host_upto - local if host_upto > local else 0
        computed = local + external
        n = 0 if external else min(req.target - computed, budget)
        upto = computed + n
        # Blocks: touch the GPU hit blocks the request keeps, allocate the rest.
        ngroups = len(self.groups)
        kept: list[list[_Block]] = []
        firsts = [0] * ngroups
        cached = self.gpu.cached
        need = 0
        for g in self.groups:
            tpb = g.tokens_per_block
            if g.kind == "mamba":
                # vLLM touches the hit's state block and holds it until the step
                # after; the running state takes a block of its own
                key = req.bkeys[g.index][local // tpb - 1] if local >= tpb else None
                hit = [cached[key]] if key in cached else []
                kept.append(hit)
                need += (self._mamba_want(req, computed) - len(hit)) * g.weight
                need += sum(1 for blk in hit if not blk[1]) * g.weight
                continue
            hit_blocks = local // tpb
            first = 0 if g.window is None else max(0, computed // tpb - g.window_blocks)
            firsts[g.index] = first
            hit = [cached[k] for k in req.bkeys[g.index][first:hit_blocks]]
            kept.append(hit)
            need += (cdiv(upto, tpb) - max(hit_blocks, first)) * g.weight
            need += sum(1 for blk in hit if not blk[1]) * g.weight
        if need > self.gpu.num_free:
            return -2
        evictable = self.gpu.evictable
        req.blocks = []
        for g, hit in zip(self.groups, kept, strict=False):
            first = firsts[g.index]
            for blk in hit:
                if not blk[1]:
                    del evictable[id(blk)]
                    self.gpu.evictable_w -= blk[2]
                blk[1] += 1
            req.blocks.append([None] * first + hit if first else hit)
        req.cached_upto = [local // g.tokens_per_block for g in self.groups]
        req.freed_upto = firsts
        req.null_upto = list(firsts)
        req.mamba_want = self._mamba_want(req, computed)
        self._grow(req, upto)
        req.admitted = True
        req.num_computed = computed
        req.local_hit = local
        req.external_hit = external
        req.loaded = []
        if req.num_preemptions == 0:
            c = self.counters
            p = req.prompt_len
            c.prefix_queries += p
            c.prefix_hits += local
            c.cached_device += local
            c.external_queries += p - local
            c.external_hits += external
            c.cached_host += external
            c.host_lookup_tokens += p - local
            c.host_hit_tokens += external
        self._count_thrash(req, computed)
        if external:
            self._start_load(req, local, computed)
            return -1
        return n

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

    def _release(self, req: SimRequest) -> None:
        """Preempt ``req`` where it is: free its blocks, and it recomputes (or reloads)
        every token later; counted in ``vllm:num_preemptions``."""
        self._free_all(req)
        req.state = WAITING
        req.admitted = False
        req.num_computed = 0
        req.target = req.prompt_len + req.num_output
        req.num_preemptions += 1
        self.counters.preemptions += 1

    def _preempt(self, req: SimRequest) -> None:
        """A running request preempted by the scheduler goes back to the queue's head."""
        self._release(req)
        self.waiting.appendleft(req)

    def break_stall(self) -> bool:
        """Release the youngest waiting request that holds GPU blocks (it keeps its
        place in the queue). Under overload the core can stall: requests whose host
        load finished hold blocks but wait for more to prefill the rest, nothing runs,
        so nothing frees blocks; this preempts one of them, as vLLM's scheduler would
        preempt to make room. Returns False when no waiting request holds blocks."""
        for req in reversed(self.waiting):
            if req.admitted and req.blocks:
                self._release(req)
                return True
        return False

    # ------------------------------------------------------------------ the step

    def step(self) -> float:
        """Run one scheduler iteration at ``now``; return the modelled seconds it took
        (0.0 when nothing could run: advance the clock with advance_to)."""
        self._expire_transfers()
        budget = self.sched.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        prefill_tokens = 0
        decodes = 0
        preempted = False
        running = self.running
        gpu = self.gpu
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            decoding = req.num_computed >= req.target
            n = 1 if decoding else min(req.target - req.num_computed, budget)
            upto = req.num_computed + n
            if decoding and (upto - 1) % self.tpb_gcd:
                # Mid-block decode: no group needs a new block.
                scheduled.append((req, 1))
                budget -= 1
                decodes += 1
                i += 1
                continue
            while self._new_blocks_needed(req, upto) > gpu.num_free:
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self._grow(req, upto)
                scheduled.append((req, n))
                budget -= n
                if decoding:
                    decodes += 1
                else:
                    prefill_tokens += n
                i += 1
                continue
            break  # the request itself was preempted
        if not preempted:
            before = len(scheduled)
            self._admit_waiting(budget, scheduled)
            for _req, n in scheduled[before:]:
                prefill_tokens += n
        if not scheduled:
            return 0.0
        lat = self.latency
        compute = lat.prefill_s_per_token * prefill_tokens + lat.decode_s_per_seq * decodes
        duration = lat.step_overhead_s + max(compute, lat.memory_floor_s)
        if lat.jitter:
            duration *= 1.0 + self.rng.uniform(-lat.jitter, lat.jitter)
        self.now += duration
        self.counters.steps += 1
        self._finish_step(scheduled)
        return duration

    def _admit_waiting(self, budget: int, scheduled: list[tuple[SimRequest, int]]) -> None:
        waiting = self.waiting
        max_seqs = self.sched.max_num_seqs
        skipped: list[SimRequest] = []
        while waiting and budget > 0 and len(self.running) < max_seqs:
            req = waiting.popleft()
            if req.state == LOADING:
                if req.ready_at > self.now:
                    skipped.append(req)
                    continue
                n = min(req.target - req.num_computed, budget)
                if self._new_blocks_needed(req, req.num_computed + n) > self.gpu.num_free:
                    skipped.append(req)
                    break
                self._grow(req, req.num_computed + n)
            else:
                n = self._admit(req, budget)
                if n == -1:
                    skipped.append(req)
                    continue
                if n < 0:
                    skipped.append(req)
                    break
            req.state = RUNNING
            if req.first_scheduled is None:
                req.first_scheduled = self.now
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        if skipped:
            waiting.extendleft(reversed(skipped))

    def _finish_step(self, scheduled: list[tuple[SimRequest, int]]) -> None:
        now = self.now
        c = self.counters
        observer = self.observer
        windowed = self.windowed
        finished = False
        rng = self.rng
        for req, n in scheduled:
            if req.num_computed < req.target:
                req.num_computed += n
                self._cache_computed(req)
                if req.num_computed < req.target:
                    continue
                # Prefill done: its last chunk samples a token.
                if not req.prefill_counted:
                    req.prefill_counted = True
                    p = req.prompt_len
                    c.prompt_tokens += p
                    c.by_source_local_cache_hit += req.local_hit
                    c.by_source_external += req.external_hit
                    c.by_source_local_compute += p - req.local_hit - req.external_hit
                    self._key_mamba_state(req)
                    self._store_prompt(req)
            else:
                req.num_computed += 1
                if windowed:
                    done = req.num_computed
                    for tpb, phase in self.window_phases:
                        if done % tpb == phase:  # a window slid past a block boundary
                            self._cache_computed(req)
                            break
            token = 16 + int(rng.random() * 31984)
            req.output_ids.append(token)
            req.num_output += 1
            c.generation_tokens += 1
            itl = None
            if req.first_token_time is None:
                req.first_token_time = now
            else:
                itl = now - req.last_token_time  # type: ignore[operator]
            req.last_token_time = now
            done = req.num_output >= req.max_tokens or (
                req.prompt_len + req.num_output >= self.max_model_len
            )
            if observer is not None:
                observer.on_token(req, itl)
            if done:
                req.state = FINISHED
                req.finish_time = now
                self._free_all(req)
                c.requests_finished += 1
                finished = True
                if observer is not None:
                    observer.on_finished(req)
            if req.sink is not None:
                req.sink(req, token, done)
        if finished:
            self.running = [r for r in self.running if r.state == RUNNING]

    def _mamba_want(self, req: SimRequest, computed: int) -> int:
        """Blocks a Mamba group holds while prefilling, as vLLM's "align" mode does
        (no prefill checkpoint blocks, no partial hits): the running state, plus the
        hit's (or loaded) state block, or the block whose state is cached at the
        prompt's last block boundary (vLLM ends a prefill chunk there)."""
        mamba = self.mamba_tpb
        if not mamba:
            return 1
        last = (req.prompt_len - 1) // mamba * mamba
        return 2 if computed or last else 1

    def _key_mamba_state(self, req: SimRequest) -> None:
        """At the end of a prefill: the state at the prompt's last block boundary L is
        cached (vLLM's replay boundary) and released, like vLLM releasing it on the
        next step (LRU tail, before the request's attention blocks at its finish);
        the running state stays held until the request finishes."""
        cached = self.gpu.cached
        gpu = self.gpu
        for g, blocks in zip(self.groups, req.blocks, strict=False):
            if g.kind != "mamba" or not blocks or blocks[0] is None:
                continue
            b = (req.prompt_len - 1) // g.tokens_per_block
            keys = req.bkeys[g.index]
            j = req.junction // g.tokens_per_block
            if 1 <= j < b and keys[j - 1] not in cached and gpu.num_free >= 2 * g.weight:
                # vLLM ends a chunk at the shared-prefix junction and keeps its state
                self._cached_state(keys[j - 1], g.weight)
            key = keys[b - 1] if 1 <= b <= len(keys) else None
            if len(blocks) < 2:
                blk = blocks[0]
                if key is not None and blk[0] is None and key not in cached:
                    gpu.name(blk, key)
                continue
            first = blocks.pop(0)
            if key is not None and first[0] is None and key not in cached:
                gpu.name(first, key)
            gpu.free(first)
            if key is not None and key not in cached and gpu.num_free >= g.weight:
                # a hit below L: the chunk ending at L wrote its state in a block of its own
                self._cached_state(key, g.weight)

    def _cached_state(self, key: int, weight: int) -> None:
        """A cached, unheld state block (the LRU's newest)."""
        gpu = self.gpu
        gpu.reserve(weight)
        state = [None, 0, weight]
        gpu.name(state, key)
        gpu.evictable[id(state)] = state
        gpu.evictable_w += weight

    def abort(self, req: SimRequest) -> bool:
        """Drop a request (client went away); frees its blocks. False if already done."""
        if req.state == FINISHED:
            return False
        if req.state == RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_all(req)
        req.state = FINISHED
        req.finish_time = self.now
        return True

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


@dataclass(frozen=True)
class ReplayItem:
    """What the core needs from a trace entry: arrival time, prompt ids, max_tokens."""

    arrival: float
    prompt: Sequence[int]
    max_tokens: int
    rid: Any = None
    #: conversation / prefix id, for prefix-affinity routing across replicas
    session: str | None = None


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
