"""The engine's scheduler: one step, admission, preemption and the end of a step.

Scheduler (vLLM V1, FCFS, chunked prefill)
    Each step has a budget of ``max_num_batched_tokens`` tokens and at most
    ``max_num_seqs`` running requests. Running requests go first (1 token when
    decoding, the rest of the prompt up to the budget when prefilling); if their new
    blocks do not fit, the last running request is preempted (blocks freed, all of its
    tokens recomputed later; ``vllm:num_preemptions``). Then waiting requests are
    admitted in order while the budget, seat count and free blocks allow (none in a
    step that preempted). A prefill's last chunk yields the first token.

"""

from __future__ import annotations

from spillway_engine.arith import cdiv
from spillway_engine.simulator.request import (
    FINISHED,
    LOADING,
    RUNNING,
    WAITING,
    SimRequest,
    _Block,
)


class Scheduler:
    """:class:`~spillway_engine.simulator.core.EngineCore`'s scheduler (vLLM V1's FCFS
    loop with chunked prefill). Mixed into the core, over its GPU and host caches."""

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
