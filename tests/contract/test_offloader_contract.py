"""Spillway's offloader through vLLM 0.33.0's real scheduler-side path, on the CPU.

Each architecture runs one workload in :class:`~.offload_loop.EngineLoop` (vLLM's
``Scheduler``, KV-cache manager and prefix cache; Spillway's connector on the
scheduler and worker side; transfers really copy bytes between CPU tensors laid out
as vLLM's KV caches and the host pool):

1. three prompts of four chunks plus a short suffix (stores),
2. fillers with other prefixes until the GPU prefix cache has forgotten the three,
3. the three prefixes again with new suffixes: they must come back from the host
   tier in every group, and every loaded block must hold exactly the bytes the model
   wrote for those tokens (the loop checks this as the loads land).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import get_offload_group_idx

from spillway_engine.offloader.connector import SpillwayOffloadingConnector
from spillway_engine.offloader.geometry import SpillwayConfigError
from spillway_engine.offloader.host_layout import HostLayout
from spillway_engine.planner.plan import PlanRefused, PlanRequest, make_plan

from .conftest import load_model
from .offload_loop import SPILLWAY, UPSTREAM, EngineLoop, gemma4_style_config, shrunk_config
from .vllm_harness import Case

POOL = 1 << 30
PREFIX_CHUNKS = 4


@dataclass(frozen=True)
class Arch:
    name: str
    config: Any  # a callable building the config.json dict
    backend: str
    num_gpu_blocks: int
    #: the planner models this architecture (Gemma-4-style pages it does not)
    planned: bool = True
    single_group: bool = False
    max_model_len: int = 4096

    def __str__(self) -> str:
        return self.name

    def case(self) -> Case:
        return Case(self.name, max_model_len=self.max_model_len, num_gpu_blocks=self.num_gpu_blocks)


ARCHS = [
    Arch(
        "gemma-3-1b-it", lambda: load_model("gemma-3-1b-it"), "FLASH_ATTN", 1000, max_model_len=2048
    ),
    Arch("gpt-oss", lambda: shrunk_config("gpt-oss-120b", 4), "FLASH_ATTN", 600),
    Arch("qwen3-next", lambda: shrunk_config("qwen3-next-80b-a3b-instruct", 8), "FLASH_ATTN", 60),
    Arch(
        "deepseek-v2-lite-mla",
        lambda: shrunk_config("deepseek-v2-lite", 3),
        "FLASH_ATTN_MLA",
        600,
        single_group=True,
    ),
    Arch("gemma-4-style", gemma4_style_config, "FLASH_ATTN", 800, planned=False),
    Arch(
        "llama-3.2-1b",
        lambda: shrunk_config("llama-3.2-1b", 4),
        "FLASH_ATTN",
        600,
        single_group=True,
    ),
]


@dataclass
class Outcome:
    loop: EngineLoop
    prefix_tokens: int
    stores_before: int
    host_hits: int
    gpu_hits: int
    loaded_groups: set[int]


def workload(loop: EngineLoop, seed: int = 0) -> Outcome:
    rng = random.Random(seed)
    span = loop.connector.geometry.layout.chunk_tokens if loop.connector_is_spillway else 256

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(n)]

    prefix = PREFIX_CHUNKS * span
    prefixes = [tokens(prefix) for _ in range(3)]
    loop.run([p + tokens(24) for p in prefixes])
    stores = loop.counters.store_jobs
    # Fillers until the GPU has recycled every block the three prefixes used.
    blocks = loop.kv_cache_config.num_blocks
    per_request = sum(
        -(-prefix // g.kv_cache_spec.block_size) for g in loop.kv_cache_config.kv_cache_groups
    )
    loop.run([tokens(prefix) for _ in range(blocks // per_request + 2)])
    loop.counters.host_hit_tokens = loop.counters.gpu_hit_tokens = 0
    loop.counters.loaded_block_ids.clear()
    loop.run([p + tokens(24) for p in prefixes])
    return Outcome(
        loop,
        prefix,
        stores,
        loop.counters.host_hit_tokens,
        loop.counters.gpu_hit_tokens,
        {g for g, _ in loop.counters.loaded_block_ids},
    )


@pytest.fixture(scope="module", params=ARCHS, ids=str)
def outcome(request: pytest.FixtureRequest) -> tuple[Arch, Outcome]:
    arch: Arch = request.param
    loop = EngineLoop(arch.config(), arch.case(), arch.backend, extra={"cpu_bytes_to_use": POOL})
    return arch, workload(loop)


def test_repeated_prefix_comes_back_from_the_host_in_every_group(outcome):
    _, out = outcome
    loop = out.loop
    layout = loop.connector.geometry.layout
    assert out.stores_before >= 3, "each first request stores its chunks"
    assert all(loop.manager.keys_per_group[g.group_id] > 0 for g in layout.groups)
    # nothing left on the GPU: the whole prefix is loaded from the host, never recomputed
    assert out.gpu_hits == 0
    assert out.host_hits == 3 * out.prefix_tokens
    assert out.loaded_groups == {g.group_id for g in layout.groups}
    # the loop compared every loaded block with the model's bytes as it landed
    assert loop.counters.checked_blocks > 0


def test_pool_accounting_is_byte_exact(outcome):
    _, out = outcome
    manager = out.loop.manager
    layout = manager.layout
    held = {g.group_id: 0 for g in layout.groups}
    for key in manager._policy.chunks:
        held[get_offload_group_idx(key)] += 1
    assert held == manager.keys_per_group
    assert manager.used_units == sum(held[g.group_id] * g.units for g in layout.groups)
    assert manager.stored_bytes == sum(held[g.group_id] * g.chunk_bytes for g in layout.groups)
    assert manager.row_utilization >= 0.95


def test_capacity_matches_the_planner(outcome):
    arch, out = outcome
    if not arch.planned:
        # Gemma 4's per-layer head sizes have no planner rule yet: it refuses, by name.
        with pytest.raises(PlanRefused, match="Gemma4ForCausalLM"):
            plan_for(arch)
        return
    # the layout the plan sized the pool for is the one the connector built from vLLM
    assert HostLayout.from_plan(plan_for(arch)) == out.loop.connector.geometry.layout


def plan_for(arch: Arch) -> Any:
    return make_plan(
        arch.config(),
        PlanRequest(max_model_len=arch.max_model_len, cpu_memory_bytes=POOL, offloader="spillway"),
    )


def test_metrics_reach_prometheus(outcome):
    _, out = outcome
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = SpillwayOffloadingConnector.build_prom_metrics(
        out.loop.vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    for payload in out.loop.stats_payloads:  # what the engine core sent, step by step
        prom.observe(payload, 0)
    value = functools.partial(registry.get_sample_value, labels={"model_name": "m", "engine": "0"})
    assert value("spillway_host_pool_used_chunks") == out.loop.manager.used_units // sum(
        g.units for g in out.loop.manager.layout.groups
    )
    assert value("spillway_host_hit_tokens_total") == out.loop.counters.all_host_hit_tokens > 0
    assert value("spillway_host_lookup_tokens_total") >= value("spillway_host_hit_tokens_total")
    assert value("spillway_host_pool_evictions_total") == out.loop.manager.evicted_keys


# ---------------------------------------------------------------- single group


@pytest.mark.parametrize("arch", [a for a in ARCHS if a.single_group], ids=str)
def test_single_group_equals_upstream(arch: Arch):
    """Same geometry, same keys, same capacity as vLLM's own connector."""
    runs = {}
    for connector, extra in (
        (UPSTREAM, {"cpu_bytes_to_use": POOL, "block_size": 256}),
        (SPILLWAY, {"cpu_bytes_to_use": POOL}),
    ):
        loop = EngineLoop(
            arch.config(),
            arch.case(),
            arch.backend,
            connector=connector,
            extra=extra,
            move_bytes=False,
        )
        workload(loop)
        runs[connector] = loop
    upstream = runs[UPSTREAM].connector.connector_scheduler
    spillway = runs[SPILLWAY].connector
    layout = spillway.geometry.layout
    info = upstream.manager.config_info()[0]
    assert (
        layout.chunk_tokens == upstream.config.blocks_per_chunk * layout.groups[0].tokens_per_block
    )
    assert layout.num_units == upstream.manager._num_chunks == int(info["cpu_num_chunks"])
    row = int(info["cpu_kv_cache_size_bytes"]) // int(info["cpu_num_chunks"])
    assert layout.unit_bytes * layout.copies == row
    assert set(upstream.manager._policy.chunks) == set(runs[SPILLWAY].manager._policy.chunks)
    assert runs[UPSTREAM].counters.host_hit_tokens == runs[SPILLWAY].counters.host_hit_tokens > 0


# ------------------------------------------------------------------- refusals


def refusal(arch: Arch, extra: dict[str, Any]) -> str:
    with pytest.raises(SpillwayConfigError) as info:
        EngineLoop(arch.config(), arch.case(), arch.backend, extra=extra, move_bytes=False)
    return str(info.value)


GEMMA3 = ARCHS[0]


def test_refuses_a_chunk_span_that_cannot_be_formed():
    message = refusal(GEMMA3, {"cpu_bytes_to_use": POOL, "spillway_chunk_tokens": 100})
    assert "100 tokens" in message and "KV-cache group 0" in message
    assert "16 tokens per block" in message and "multiple of 16" in message


def test_refuses_a_pool_smaller_than_one_chunk_of_every_group():
    message = refusal(GEMMA3, {"cpu_bytes_to_use": 1 << 20})
    assert (
        "1048576 bytes" in message and "smaller than one chunk of every KV-cache group" in message
    )
    assert "group 6 (FullAttention)" in message and "group 0 (SlidingWindow)" in message


def test_refuses_a_plan_made_for_another_engine():
    message = refusal(
        GEMMA3, {"cpu_bytes_to_use": POOL, "spillway_group_blocks_per_chunk": [16] * 6 + [8]}
    )
    assert "KV-cache group 6" in message and "cuts 8 blocks per chunk" in message


def test_refuses_vllm_options_the_unit_pool_does_not_implement():
    message = refusal(GEMMA3, {"cpu_bytes_to_use": POOL, "canonical_layout": True})
    assert "['canonical_layout'] is not supported" in message


# ------------------------------------------------------------------- KV events


@pytest.mark.parametrize("arch", [ARCHS[0], ARCHS[4]], ids=str)
def test_host_tier_kv_events_keep_vllms_format(arch: Arch):
    """Keys stay (block hash, group): vLLM's event tracker reports host stores and
    evictions per group, with the request's own block hashes and tokens."""
    pool = 24 << 20  # small: the fillers evict the first prefixes from the host too
    extra = {"cpu_bytes_to_use": pool, "self_describing_kv_events": True}
    loop = EngineLoop(arch.config(), arch.case(), arch.backend, extra=extra, kv_events=True)
    workload(loop)
    layout = loop.connector.geometry.layout
    host = [e for e in loop.kv_events if getattr(e, "medium", None) == "CPU"]
    stored = [e for e in host if isinstance(e, BlockStored)]
    removed = [e for e in host if isinstance(e, BlockRemoved)]
    assert {e.group_idx for e in stored} == {g.group_id for g in layout.groups}
    assert removed and loop.manager.evicted_keys > 0
    hashes = {maybe_convert_block_hash(h) for r in loop._requests.values() for h in r.block_hashes}
    full = {g.group_id for g in layout.groups if g.window_chunks is None}
    for event in stored:
        assert event.block_hashes and set(event.block_hashes) <= hashes
        if event.group_idx in full:
            # full attention: the chunk's blocks and tokens, spanning the common chunk
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            assert len(event.token_ids) == layout.chunk_tokens
        else:
            # vLLM's tracker describes windowed groups by the key's hash alone
            assert (len(event.block_hashes), event.token_ids) == (1, [])
    stored_hashes = {h for e in stored for h in e.block_hashes}
    assert all(set(e.block_hashes) <= stored_hashes for e in removed)
