"""One trace through the emulated engine (vLLM 0.33.0's real server, scheduler, prefix
cache and Spillway's connector on the CPU) and through the simulator on the same plan,
for a single-group model (Llama), sliding-window + full models (Gemma 3: window 64,
two groups; 12 layers, window 32, six groups, with a 4 MiB and a 6 MiB pool; and
Gemma-3-1B's own config.json, the geometry of tests/fixtures/plans/gemma-3-1b-it-
spillway.json: seven groups, window 512, keys of 4 or 3 units), MLA (DeepSeek) and a
Mamba hybrid (Qwen3-Next: 3 Gated DeltaNet layers + 1 full attention layer; also on
the long trace).

The trace is serial (each request is sent when the previous one returned) and uses
prompts whose prompt + output stays inside the last stored chunk, so the engine's
store and eviction order is the one the simulator models: the prompt's chunks offered
when its prefill is scheduled, its keys ranked tail first when it finishes.

Tolerance: **exact**, for every model, on GPU prefix-hit tokens, host-hit tokens,
external hits, host-pool evictions, preemptions and the pool's fill (used chunks), and
request by request on GPU hits, host hits and evictions (cumulative after each). A
serial trace leaves neither side a scheduling choice (no batching, no racing
transfers: each load and store is done before the next request arrives), and both the
GPU prefix cache and the host pool are deterministic LRUs over the same keys, so any
difference is a modelling error, not noise. What the simulator models to get there
(read from vLLM 0.33.0's source):

- vLLM's block pool: block 0 is its null block; blocks freed unnamed are reused
  before any cached one, cached blocks in LRU order.
- Sliding window, at the default ``prefix_cache_retention_interval = 0``: only the
  window's blocks ending at the replay boundary ``floor((P-1)/16)*16`` and at a
  shared-prefix junction are named (``SlidingWindowManager.reachable_block_mask``);
  the rest are freed unnamed as the window slides. Before this, the simulator named
  every window block, which pushed useful blocks out of its GPU cache: on this trace
  it hit 2560 host tokens and 0 on the GPU where vLLM hit 1536 and 1184.
- Mamba "align" mode (``MambaManager``; no prefill checkpoint blocks on this backend,
  so vLLM ends a prefill chunk at the prompt's last block boundary L): a prefilling
  request holds its running state plus the state it hit, loaded or caches at L; the
  state at L is released to the LRU after the prefill. The host tier gets a state
  only through a boundary hand-off (a block this request named: never a state it hit
  on the GPU, so a GPU hit does not refresh its host copy), stored by a call of its
  own before the step's chunk store; that call protects only its own key, so it may
  evict the request's own older chunks, which the chunk store then stores again.
- A window group's chunk is offered only when none of the blocks vLLM stores or names
  in it is the null block. A request that hit a prefix on the GPU holds only the
  window's blocks before the hit point, so the window chunks inside the hit are not
  offered: their host copies are not refreshed and age out, while the full group's
  chunks are refreshed. Before this, the simulator refreshed them too; on the six-group
  Gemma below it kept a prompt's window keys the engine had evicted (33 evictions each,
  but host hits 1024 against the engine's 512).

- vLLM's prefix cache names a block even when an older block of the same hash is
  still cached (``BlockHashToBlockMap`` keeps both; a hit takes the first, each is
  evicted on its own). The common case: a prompt whose window blocks left the GPU
  while its full-attention head stayed is loaded from the host into new blocks, and
  those are named too. Before this, the simulator left the new blocks unnamed (freed
  first, reused at once): it held 30 more free blocks after such a load, kept other
  prompts on the GPU longer and hit them there where the engine loaded them from the
  host pool, whose LRU then diverged (the long six-group trace below: from its 14th
  request; 99 against 100 evictions by its 80th).
- A request that loaded from the host offers no chunk before the end of its hit
  (vLLM moves ``next_stored_chunk_idx`` there, ``OffloadPolicy.CHUNK_LEVEL``), so a
  load refreshes exactly the keys it read; and vLLM's LRU re-ranks every key a
  request accessed, loaded or offered, in one tail-first pass when it finishes. For
  Qwen3-Next after a load only the boundary states are offered: ranked alone, they
  came out newer than the loaded chunks (the long trace: 59 against 60 evictions by
  its 21st request).
- The store's window mask is aligned on the full-attention chunk (the connector's
  ``alignment_tokens``), not on the scheduler's block as the GPU's naming mask is.
  With Gemma-3-1B's 512-token window a GPU hit at 592 holds blocks 5-36, the store
  mask reaches back to block 0, and the window chunk ending at 256 is not offered
  (null blocks 0-4): its keys age. Before this, the simulator refreshed them and
  kept a prompt the engine had evicted (host hits 10240 against 9728, 601 against
  607 evictions on the 1B trace).

Seen (engine = simulator): Llama GPU 128 / host 1408 tokens, 14 evictions, 16 used
chunks; Gemma 3 GPU 1184 / host 1536, 7 evictions, 16 used chunks; Qwen3-Next GPU
1152 / host 576, 61 evictions (keys: one per group and chunk), 38 used chunks;
six-group Gemma GPU 1184 / host 512, 33 evictions, 10 used chunks; with 6 MiB on the
long trace GPU 10656 / host 16384, 99 evictions, 16 used chunks; Gemma-3-1B GPU 5328
/ host 9728, 607 evictions, 14 used chunks; Qwen3-Next on the long trace GPU 9216 /
host 10368, 424 evictions, 38 used chunks; no preemptions. The per-request
cumulative figures are printed to locate a drift.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from e2e.engine_process import MIB
from spillway_engine.emulator.tiny import gemma3_config, qwen3_next_config, write_model
from spillway_engine.planner.plan import read_plan
from spillway_engine.simulator.core import EngineCore, LatencyModel, SchedulerConfig
from spillway_engine.simulator.plan_input import parse_plan
from tests.contract.conftest import load_model
from tests.contract.test_emulated_engine import (
    MODELS,
    Server,
    _free_port,
    _kill_group,
    _launch,
    _plan,
    _wait_ready,
    _write_plan,
    complete,
    metrics,
    prompt,
)

#: model -> (config.json, emulated GPU KV bytes): the emulated engine's models plus a
#: Qwen3-Next-style hybrid (3 Gated DeltaNet layers + 1 full attention: 3 Mamba groups
#: and 1 full group, 64-token blocks of 8 KiB). Its 64 blocks hold a few 600-token
#: prompts, so early repeats hit the GPU and later ones the host pool.
SIM_MODELS: dict[str, tuple[dict, int]] = {
    **MODELS,
    "qwen3_next": (qwen3_next_config(num_layers=4), 64 * 8192),
    # Gemma-3-shaped with six KV-cache groups: 10 sliding-window layers (window 32)
    # and 2 full, in groups of two layers (5 window groups + 1 full group)
    "gemma3_6g": (
        gemma3_config(num_layers=12, sliding_window=32, sliding_window_pattern=6,
                      head_dim=32, query_pre_attn_scalar=32),
        400 * 4096,
    ),
    # Gemma-3-1B (26 layers, window 512, one KV head of 256): 6 window groups, two of
    # them padded to 3 layers, and 1 full group; 640 blocks of 64 KiB
    "gemma3_1b": (load_model("gemma-3-1b-it"), 640 * 65536),
    # Llama-3.2-1B (16 layers, 8 KV heads of 64): the bursty, diurnal and flash
    # traces' model; 80 blocks of 512 KiB
    "llama3_1b": (load_model("llama-3.2-1b"), 80 * 524288),
}
#: the six-group Gemma with a pool of 96 keys: on the long trace below both GPU
#: hits and host loads come between the pool's evictions
SIM_MODELS["gemma3_6g_6mib"] = SIM_MODELS["gemma3_6g"]
#: Qwen3-Next on the long trace: host loads followed by boundary-state stores
SIM_MODELS["qwen3_next_long"] = SIM_MODELS["qwen3_next"]
#: Host pool per model, small enough for the trace to evict. Llama and Gemma: 1 MiB,
#: 16 chunks of 256 tokens (Gemma: 32 units, a sliding-window and a full key of one
#: unit each per chunk). Qwen3-Next: 768 KiB, 192 units of 4 KiB; a 64-token chunk of
#: every group takes 5 (1 per GDN state, 2 for the full layer's page). DeepSeek (MLA):
#: 9 MiB, 16 chunks of 256 tokens of 576 KiB (two layers' latents). Six-group Gemma:
#: 4 MiB, 64 keys of 64 KiB; a prompt stores 7 (5 window keys + 2 full chunks); 6 MiB:
#: 96 keys. Gemma-3-1B: 96 MiB, 384 units of 256 KiB; a prompt stores 14 keys of 3 or
#: 4 units, 52 units (2 window chunks of each window group + 2 full chunks). Llama-3.2-1B:
#: 128 MiB, 16 chunks of 256 tokens (8 MiB each), as the tiny Llama's.
POOL_BYTES = {
    "llama": 1 * MIB,
    "gemma3": 1 * MIB,
    "qwen3_next": 3 * MIB // 4,
    "deepseek": 9 * MIB,
    "gemma3_6g": 4 * MIB,
    "gemma3_6g_6mib": 6 * MIB,
    "gemma3_1b": 96 * MIB,
    "qwen3_next_long": 3 * MIB // 4,
    "llama3_1b": 128 * MIB,
}
#: two 256-token chunks (Qwen3-Next: nine of 64); + 2 output tokens stays inside the
#: next chunk (below 768; 640)
PROMPT_TOKENS = 600
MAX_TOKENS = 2
#: seeds in order: 10 distinct prompts fill and overflow the pool, then earlier ones
#: come back (from the GPU, the host pool, or neither).
TRACE = [1, 2, 3, 1, 4, 5, 6, 7, 8, 9, 10, 2, 9, 1, 11, 12, 10, 3]
#: 80 requests over 20 prompts (``random.Random(1).randrange(1, 21)``, drawn in turn):
#: prompts come back from the GPU, from the host pool, or after the pool dropped some
#: of their keys (window keys first, which a GPU hit does not refresh)
LONG_TRACE = [
    5, 19, 3, 9, 4, 16, 15, 16, 13, 7, 4, 16, 1, 13, 14, 20, 1, 15, 9, 8, 19, 4, 11, 1,
    1, 1, 18, 1, 13, 7, 14, 1, 17, 8, 15, 16, 18, 8, 12, 8, 8, 15, 10, 1, 14, 18, 4, 6,
    10, 4, 11, 17, 14, 17, 7, 10, 10, 19, 16, 17, 13, 19, 2, 16, 8, 13, 14, 6, 12, 18,
    12, 3, 15, 17, 4, 6, 17, 13, 12, 16,
]
#: cases on the long trace (the others on TRACE)
TRACES = dict.fromkeys(("gemma3_6g_6mib", "gemma3_1b", "qwen3_next_long"), LONG_TRACE)


def _gpu_blocks(server: Server) -> int:
    """Blocks of vLLM's shared pool: the emulated budget over one block of the
    largest group's layers (hybrid groups share the pool's tensors)."""
    kv_bytes = SIM_MODELS[server.name][1]
    return kv_bytes // max(g.bytes_per_block for g in server.plan.kv_groups)


@pytest.fixture(scope="module", params=list(SIM_MODELS))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    name = request.param
    config, kv_bytes = SIM_MODELS[name]
    model_dir = write_model(tmp_path_factory.mktemp("vs-sim") / name, config)
    plan = _plan(model_dir, cpu_memory_bytes=POOL_BYTES[name])
    root = model_dir.parent / f"{name}-vs-sim"
    plan_path = _write_plan(root, plan, model_dir)
    port = _free_port()
    proc = _launch(plan_path, root / "engine.log", port, kv_bytes)
    srv = Server(name, proc, port, root / "engine.log", plan, 0.0)
    try:
        _wait_ready(srv)
        yield srv
    finally:
        _kill_group(proc)


FIGURES = {
    "gpu_hit_tokens": "vllm:prefix_cache_hits_total",
    "host_hit_tokens": "spillway_host_hit_tokens_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "evictions": "spillway_host_pool_evictions_total",
    "preemptions": "vllm:num_preemptions_total",
    "used_chunks": "spillway_host_pool_used_chunks",
}


#: cumulative figures printed after each request of the trace (to locate a drift)
PER_REQUEST = ("gpu_hit_tokens", "host_hit_tokens", "evictions")


def _engine_figures(server: Server, pause: float = 0.5) -> dict[str, float]:
    # the engine publishes a step's stats after the reply: read until two agree
    last = None
    for _ in range(20):
        m = metrics(server)
        now = {k: m.get(name, 0.0) for k, name in FIGURES.items()}
        if now == last:
            return now
        last = now
        time.sleep(pause)
    return last  # type: ignore[return-value]


def test_one_trace_agrees_with_the_simulator(server: Server):
    trace = TRACES.get(server.name, TRACE)
    before = _engine_figures(server)
    per_request = []
    for seed in trace:
        reply = complete(server, prompt(seed, PROMPT_TOKENS), max_tokens=MAX_TOKENS)
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
        m = _engine_figures(server, pause=0.1)
        per_request.append(tuple(int(m[k] - before[k]) for k in PER_REQUEST))
    after = _engine_figures(server)
    engine = {k: after[k] - (0 if k == "used_chunks" else before[k]) for k in FIGURES}

    plan = parse_plan(read_plan(server.plan.model_dump_json(), "plan"))
    assert plan.host_layout is not None, "the plan runs Spillway's unit pool"
    # vLLM's block pool keeps block 0 as its null block
    core = EngineCore(
        plan,
        gpu_blocks=_gpu_blocks(server) - 1,
        latency=LatencyModel(jitter=0.0),
        scheduler=SchedulerConfig(max_model_len=server.plan.max_model_len),
    )
    sim_steps = []
    for seed in trace:
        core.add_request(prompt(seed, PROMPT_TOKENS), MAX_TOKENS)
        core.run_until_idle()
        c = core.counters
        sim_steps.append((c.prefix_hits, c.host_hit_tokens, c.host_evictions))
    c = core.counters
    sim = {
        "gpu_hit_tokens": c.prefix_hits,
        "host_hit_tokens": c.host_hit_tokens,
        "external_hits": c.external_hits,
        "evictions": c.host_evictions,
        "preemptions": c.preemptions,
        "used_chunks": core.host_used_chunks(),
    }
    kv_line = [ln for ln in server.log_text().splitlines() if "KV cache size" in ln][:1]
    print(f"\n[{server.name}] {kv_line}", file=sys.stderr)
    print(f"\n[{server.name}] engine {engine}\n[{server.name}] simulator {sim}", file=sys.stderr)
    print(f"[{server.name}] engine per request {per_request}", file=sys.stderr)
    print(f"[{server.name}] sim per request {sim_steps}", file=sys.stderr)
    assert engine["host_hit_tokens"] > 0, "the trace should reach the host pool"
    assert engine["evictions"] > 0, "the trace should overflow the host pool"
    # request by request (cumulative figures), so a drift is caught where it starts
    for i, (seed, ours, theirs) in enumerate(zip(trace, sim_steps, per_request, strict=True)):
        assert ours == theirs, (
            f"request {i} (prompt {seed}), cumulative {PER_REQUEST}: "
            f"simulator {ours} vs engine {theirs}"
        )
    for key in FIGURES:
        assert sim[key] == engine[key], f"{key}: simulator {sim[key]} vs engine {engine[key]}"
