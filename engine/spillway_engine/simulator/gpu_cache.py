"""The engine's GPU KV cache: the block pool, prefix hits, and the blocks a request
holds, names and frees.

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

"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from spillway_engine.arith import cdiv
from spillway_engine.simulator.request import SimRequest, _Block

_HASH_SEED = 0x5EED_5B11
_GOLDEN = 0x9E3779B97F4A7C15


def _group_salt(index: int) -> int:
    """Per-group constant XORed into block hashes: (hash, group) keys stay small ints."""
    return ((index + 1) * _GOLDEN) & 0x7FFF_FFFF_FFFF_FFFF


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


class GpuCache:
    """:class:`~spillway_engine.simulator.core.EngineCore`'s GPU half: hits, block
    allocation, naming and release over ``self.gpu`` (a :class:`_GpuPool`) for the
    classes in ``self.groups``. Mixed into the core, whose ``__init__`` sets the state."""

    def _hash_prompt(self, prompt: Sequence[int]) -> list[int]:
        tph = self.tph
        h = _HASH_SEED
        t = tuple(prompt)
        return [h := hash((h, t[i : i + tph])) for i in range(0, len(t) - tph + 1, tph)]

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
