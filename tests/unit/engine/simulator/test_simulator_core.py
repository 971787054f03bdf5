"""The simulator's virtual-time core: prefix reuse, LRU, host hits, preemption, determinism."""

from __future__ import annotations

import dataclasses

import pytest

from spillway_cli.loadgen import TraceSpec, generate_trace, to_replay_items
from spillway_engine.simulator.core import EngineCore, LatencyModel, RequestRejected, replay
from tests.unit.simulator_support import (
    GEMMA,
    LLAMA,
    QWEN_NEXT,
    make_core,
    run_one,
    sim_plan,
    tokens,
)

LLAMA_BLOCK_BYTES = 32768 * 16  # page_bytes x layers, one rank


def test_lone_request_latency_is_the_documented_formula():
    core = make_core()
    req = run_one(core, tokens(1000, 1), max_tokens=3)
    lat = LatencyModel()
    prefill = lat.step_overhead_s + 1000 * lat.prefill_s_per_token
    assert req.ttft == pytest.approx(prefill)
    decode = lat.step_overhead_s + lat.decode_s_per_seq
    assert req.e2e == pytest.approx(prefill + 2 * decode)
    assert req.queue_time == 0
    assert core.counters.prompt_tokens == 1000
    assert core.counters.generation_tokens == 3
    assert core.counters.by_source_local_compute == 1000


@pytest.mark.parametrize(("params", "speed"), [(8e9, 1.0), (7e10, 1.0), (7e10, 0.25)])
def test_emulating_latency_steps_as_the_emulated_gpu_sleeps(params, speed):
    """``LatencyModel.emulating`` against the emulated worker's own timing
    (``emulator.latency.step_s`` x speed, KV reads aside) for prefill, decode and mixed
    steps, on both sides of the roofline's knee, plus the engine's CPU time per step."""
    from spillway_engine.emulator import latency as emu

    gpu, cost = emu.gpu_profile("h100"), emu.ModelCost.of(params)
    lat = LatencyModel.emulating(gpu, cost, speed, overhead_s=0.007)
    for prefill, decodes in [(0, 1), (0, 40), (1000, 0), (600, 12), (7000, 200), (50, 3)]:
        core = make_core()
        core.latency = lat
        for _ in range(decodes):  # requests already decoding
            core.add_request(tokens(8, 100 + _), max_tokens=50)
        while core.waiting or any(r.num_computed < r.prompt_len for r in core.running):
            core.step()
        if prefill:
            core.add_request(tokens(prefill, 1), max_tokens=2)
        before = core.now
        core.step()
        want = emu.step_s(prefill + decodes, gpu, cost) * speed + 0.007
        assert core.now - before == pytest.approx(want), (prefill, decodes)
    # moving a page over the link takes the emulator's transfer time
    assert 1e9 / lat.pcie_bytes_per_s == pytest.approx(emu.transfer_s(1e9, gpu) * speed)


def test_shared_prefix_hits_the_gpu_cache_in_whole_blocks():
    core = make_core()
    prefix = tokens(1000, 1)
    run_one(core, prefix + tokens(50, 2))
    again = run_one(core, prefix + tokens(70, 3))
    assert again.local_hit == 992  # 62 full 16-token blocks of the shared 1000 tokens
    other = run_one(core, tokens(1050, 4))
    assert other.local_hit == 0
    c = core.counters
    assert c.prefix_hits == 992
    assert c.prefix_queries == 1050 + 1070 + 1050
    assert c.cached_device == 992


def test_hit_never_covers_the_last_prompt_token():
    core = make_core()
    prompt = tokens(320, 5)  # exactly 20 blocks
    run_one(core, prompt)
    assert run_one(core, prompt).local_hit == 304


def test_gpu_lru_evicts_tails_first_then_host_pool_supplies_the_rest():
    core = make_core(gpu_tokens=2048)  # 128 blocks
    a = tokens(1024, 1)
    run_one(core, a)
    run_one(core, tokens(1900, 2))  # 119 blocks: evicts 55 of a's 64, tail first
    assert core.gpu.evictions == 55
    again = run_one(core, a)
    assert again.local_hit == 9 * 16  # a's head blocks survived
    assert again.external_hit == 768 - 144  # host chunks 0..2 (256 tokens each)
    c = core.counters
    assert c.cached_host == 624
    assert c.load_bytes == (768 - 144) // 16 * LLAMA_BLOCK_BYTES
    assert c.host_hit_tokens == 624
    lat = LatencyModel()
    load_s = c.load_bytes / lat.pcie_bytes_per_s
    rest = lat.step_overhead_s + (1024 - 768) * lat.prefill_s_per_token
    assert again.ttft == pytest.approx(load_s + rest)
    assert c.by_source_external == 624


def test_without_host_pool_the_same_sequence_recomputes():
    core = make_core(gpu_tokens=2048, num_chunks=0)
    a = tokens(1024, 1)
    first = run_one(core, a)
    run_one(core, tokens(1900, 2))
    again = run_one(core, a)
    assert again.external_hit == 0
    assert again.local_hit == 144
    assert again.ttft > first.ttft * 0.8
    assert core.counters.load_bytes == 0
    assert core.counters.allocation_failures == 3  # every store found a 0-chunk pool


def test_host_lru_eviction_and_thrash():
    core = make_core(gpu_tokens=2048, num_chunks=8)  # host: 8 chunks of 256 tokens
    a, b, c = tokens(1024, 1), tokens(1024, 2), tokens(1024, 3)
    for prompt in (a, b, c):
        run_one(core, prompt)
    assert core.counters.host_evictions == 4  # c's 4 chunks pushed a's 4 out
    assert core.host_used_chunks() == 8
    assert core.host_tokens() == 8 * 256
    again = run_one(core, a)
    assert again.external_hit == 0
    assert core.counters.host_thrash >= 1
    # b's chunks were evicted by a's re-store; asking for b again is thrash too
    before = core.counters.host_thrash
    run_one(core, tokens(1024, 2))
    assert core.counters.host_thrash > before


def test_host_lookup_touches_chunks_lru():
    core = make_core(gpu_tokens=1200, num_chunks=8)
    a, b = tokens(1024, 1), tokens(1024, 2)
    run_one(core, a)
    run_one(core, b)
    run_one(core, a)  # host hit on a: a's chunks become most recent
    run_one(core, tokens(1024, 3))  # evicts the least recent: b's
    assert run_one(core, a).external_hit > 0
    assert run_one(core, b).external_hit == 0


def test_preemption_when_gpu_blocks_run_out():
    core = make_core(gpu_tokens=2048)  # 128 blocks; 4 x 44 needed at the end
    reqs = [core.add_request(tokens(400, i), 300) for i in range(4)]
    core.run_until_idle()
    c = core.counters
    assert c.preemptions > 0
    assert all(r.num_output == 300 for r in reqs)
    assert c.generation_tokens == 1200
    assert sum(r.num_preemptions for r in reqs) == c.preemptions
    assert c.prefix_queries == 1600  # a preempted request's re-lookup is not counted
    assert core.kv_cache_usage() == 0.0


def test_waiting_requests_queue_behind_the_seat_limit():
    core = make_core(max_num_seqs=2)
    reqs = [core.add_request(tokens(100, i), 20) for i in range(4)]
    core.step()
    assert core.num_running == 2 and core.num_waiting == 2
    core.run_until_idle()
    assert reqs[3].queue_time > 0
    assert reqs[0].queue_time == 0


def test_token_budget_chunks_long_prefills():
    core = make_core(gpu_tokens=65536, max_num_batched_tokens=512)
    req = core.add_request(tokens(2000, 1), 2)
    steps = 0
    while req.first_token_time is None:
        core.step()
        steps += 1
    assert steps == 4  # 512 + 512 + 512 + 464


def test_rejections():
    core = make_core(gpu_tokens=1024)
    with pytest.raises(RequestRejected, match="maximum context length"):
        core.add_request(tokens(10, 1), core.max_model_len)
    with pytest.raises(RequestRejected, match="KV blocks"):
        core.add_request(tokens(2000, 1), 10)
    with pytest.raises(RequestRejected):
        core.add_request([], 10)


def test_abort_frees_blocks():
    core = make_core()
    req = core.add_request(tokens(500, 1), 100)
    core.step()
    assert core.kv_cache_usage() > 0
    assert core.abort(req)
    assert core.kv_cache_usage() == 0.0
    assert not core.has_work()
    assert not core.abort(req)


def test_sliding_window_groups_hold_only_the_window():
    core = make_core(GEMMA, gpu_tokens=32768)
    prompt = tokens(3000, 1)
    req = core.add_request(prompt, 50)
    while req.first_token_time is None:
        core.step()
    held = core.gpu.total - core.gpu.num_free
    full_blocks = -(-3001 // 16)
    # the 6 window groups keep 33 blocks each (512-token window + the current block)
    assert held == full_blocks + 6 * 33
    assert held < 7 * full_blocks / 3
    core.run_until_idle()
    again = run_one(core, prompt)
    assert again.local_hit == 2992  # window blocks before the hit point were still cached


def test_sliding_window_host_store_keeps_only_window_tails_per_group():
    core = make_core(GEMMA, gpu_tokens=32768)
    run_one(core, tokens(3000, 1))
    # full group: 3000 // 256 = 11 chunks of 4 units; 6 window groups x 2 chunks before
    # 2816 (four groups of 4 units, two of 3): units in the one pool, and the manager's
    # used_chunks is those units // the 26 units of one chunk of every group
    units = 11 * 4 + 2 * (4 * 4 + 2 * 3)
    assert core.pools[0].used == units
    assert core.host_used_chunks() == units // 26
    assert core.host_tokens() == 11 * 256


def test_mamba_hybrid_reuses_the_state_at_the_block_boundary():
    core = make_core(QWEN_NEXT, gpu_tokens=65536)
    prompt = tokens(1000, 1)
    run_one(core, prompt)
    again = run_one(core, prompt)
    assert again.local_hit == 960  # 3 blocks of 320 tokens; Mamba state at 960
    # Only the state at the prompt's last boundary is kept: a prompt that diverges
    # before it finds full-attention blocks up to 640 but no Mamba state there.
    assert run_one(core, prompt[:900] + tokens(100, 2)).local_hit == 0


def test_mamba_state_is_loaded_from_the_host():
    # 16 blocks; a state block weighs 3 and a prefill holds two (hit or boundary + running)
    core = make_core(QWEN_NEXT, gpu_tokens=1280)
    prompt = tokens(1000, 1)
    run_one(core, prompt)
    run_one(core, tokens(2200, 2))  # pushes the first prompt out of the GPU
    again = run_one(core, prompt)
    assert again.local_hit == 0
    assert again.external_hit == 960


def _trace_items(seed: int = 3, n: int = 200):
    spec = TraceSpec(
        kind="chat",
        rate=20,
        num_requests=n,
        duration=None,
        users=6,
        system_tokens=200,
        user_tokens=60,
        reply_tokens=60,
        max_tokens=16,
        seed=seed,
    )
    return to_replay_items(generate_trace(spec))


def _fingerprint(seed: int):
    core = make_core(gpu_tokens=8192, num_chunks=64, seed=seed, jitter=0.05)
    reqs = replay(core, _trace_items())
    counters = dataclasses.asdict(core.counters)
    return [(r.ttft, r.e2e, tuple(r.output_ids)) for r in reqs], counters, core.now


def test_deterministic_under_a_seed():
    assert _fingerprint(7) == _fingerprint(7)
    a, b = _fingerprint(7), _fingerprint(8)
    assert [x[2] for x in a[0]] != [x[2] for x in b[0]]
    assert a[2] != b[2]


def test_replay_over_a_chat_trace_reuses_conversation_prefixes():
    core = make_core(gpu_tokens=65536)
    reqs = replay(core, _trace_items())
    assert len(reqs) == 200 and all(r.num_output == 16 for r in reqs)
    c = core.counters
    assert c.prefix_hits > 0.5 * c.prefix_queries  # multi-turn: most of each prompt is old
    assert core.kv_cache_usage() == 0.0


def test_plan_capacity_fields_drive_the_pool():
    plan = sim_plan(LLAMA, num_chunks=3)
    core = EngineCore(plan, gpu_blocks=4096)
    run_one(core, tokens(2000, 1))
    assert core.host_used_chunks() == 3
    assert core.counters.host_evictions == 7 - 3


def test_mamba_hybrid_keeps_the_state_at_a_shared_prefix_junction():
    core = make_core(QWEN_NEXT, gpu_tokens=65536)
    system = tokens(1000, 1)
    first = run_one(core, system + tokens(400, 2))  # state kept at 1280 only
    second = run_one(core, system + tokens(400, 3))  # no state at 960: recompute...
    third = run_one(core, system + tokens(400, 4))  # ...but the second kept one there
    assert (first.local_hit, second.local_hit, third.local_hit) == (0, 0, 960)
    assert second.junction == 960


def test_sliding_window_junction_tails_reach_the_host_pool():
    core = make_core(GEMMA, gpu_tokens=8192, num_chunks=630)
    system = tokens(2000, 1)
    run_one(core, system + tokens(600, 2))
    run_one(core, system + tokens(600, 3))  # junction at 1984: window tail stored
    # push everything out of the GPU (window blocks outside a kept tail are freed
    # unnamed and reused first, as in vLLM, so it takes more than the GPU's size)
    for i in range(8):
        run_one(core, tokens(2600, 10 + i))
    again = run_one(core, system + tokens(600, 5))
    assert again.local_hit == 0
    assert again.external_hit == 1792  # 7 chunks of 256: the last full chunk before 1984


def test_sliding_window_names_only_the_tail_a_hit_can_use():
    # vLLM's retention (interval 0): the window's blocks before the replay boundary
    core = make_core(GEMMA, gpu_tokens=65536)
    prompt = tokens(2000, 1)
    first = run_one(core, prompt)
    swa = next(g for g in core.groups if g.kind == "sliding_window")
    named = [b for b, key in enumerate(first.bkeys[swa.index]) if key in core.gpu.cached]
    end = 1999 // core.align * core.align // swa.tokens_per_block
    assert named == list(range(end - swa.window_blocks, end))
    assert run_one(core, prompt).local_hit == end * swa.tokens_per_block


def test_mamba_state_hit_on_the_gpu_is_not_refreshed_on_the_host():
    core = make_core(QWEN_NEXT, gpu_tokens=65536)
    a, b = tokens(1000, 1), tokens(1000, 2)
    first = run_one(core, a)
    run_one(core, b)
    again = run_one(core, a)
    assert again.local_hit == 960  # the state at 960 and three full blocks
    mamba = next(g for g in core.groups if g.kind == "mamba")
    full = next(g for g in core.groups if g.kind == "full_attention")
    order = list(core.pools[0].keys)
    state = core._chunk_keys(first, mamba)[2]
    head = core._chunk_keys(first, full)[0]
    other = core._chunk_keys(core.add_request(b, 1), full)[0]
    # the full chunks were offered again (refreshed); the state was not
    assert order.index(state) < order.index(other) < order.index(head)


def test_mamba_prefill_holds_two_state_blocks():
    # while prefilling (in two steps here): the running state and the block whose
    # state is cached at the last boundary; after it, the running state only
    core = make_core(QWEN_NEXT, gpu_tokens=65536, max_num_batched_tokens=640)
    req = core.add_request(tokens(1000, 1), 4)
    mamba = next(g for g in core.groups if g.kind == "mamba")
    core.step()
    assert req.num_computed == 640 and len(req.blocks[mamba.index]) == 2
    core.step()
    assert req.num_computed == 1000 and len(req.blocks[mamba.index]) == 1
    assert req.bkeys[mamba.index][2] in core.gpu.cached  # the state at 960
    core.run_until_idle()
    assert core.kv_cache_usage() == 0.0
