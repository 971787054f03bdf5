"""Acceptance: host hits when the working set fits GPU + host; evictions when it does not.

Virtual time (the core replayed by the load generator's trace), judged from the
``/metrics`` exposition the HTTP server would serve. Llama-3.2-1B plan, GPU KV of
32,768 tokens, host pool of 1,024 chunks x 256 tokens = 262,144 tokens; traffic: many
users sharing 2,048-token system prompts at 6 requests/s.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spillway_cli.loadgen import TraceSpec, generate_trace, to_replay_items
from spillway_engine.simulator.core import replay
from spillway_engine.simulator.prom import SimulatorMetrics
from tests.unit.simulator_support import make_core

GPU_TOKENS = 32768
HOST_CHUNKS = 1024  # x 256 tokens
PREFIX_TOKENS = 2048


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            )
            out[(s.name, labels)] = s.value
    return out


def run_scenario(prefixes: int, host_chunks: int):
    core = make_core(gpu_tokens=GPU_TOKENS, num_chunks=host_chunks, seed=1, jitter=0.02)
    metrics = SimulatorMetrics(core)
    spec = TraceSpec(
        kind="shared-prefix",
        rate=6,
        num_requests=600,
        duration=None,
        prefixes=prefixes,
        prefix_tokens=PREFIX_TOKENS,
        question_tokens=64,
        max_tokens=32,
        seed=3,
    )
    reqs = replay(core, to_replay_items(generate_trace(spec)))
    metrics.sync()
    m = scrape(generate_latest(metrics.registry).decode())
    ttfts = sorted(r.ttft for r in reqs)
    return m, ttfts[len(ttfts) // 2]


def host_tokens(m):
    return m[("vllm:prompt_tokens_cached_by_source_total", (("source", "host"),))]


def share(m, source):
    total = m[("vllm:prompt_tokens_total", ())]
    return m[("vllm:prompt_tokens_by_source_total", (("source", source),))] / total


def ttft_fraction_below(m, bound: str) -> float:
    below = m[("vllm:time_to_first_token_seconds_bucket", (("le", bound),))]
    return below / m[("vllm:time_to_first_token_seconds_count", ())]


@pytest.fixture(scope="module")
def fits_gpu_plus_host():
    # 40 prefixes x 2,048 = 82k tokens: more than the GPU, less than GPU + host
    return run_scenario(prefixes=40, host_chunks=HOST_CHUNKS)


@pytest.fixture(scope="module")
def fits_gpu_plus_host_without_offload():
    return run_scenario(prefixes=40, host_chunks=0)


@pytest.fixture(scope="module")
def exceeds_both():
    # 200 prefixes x 2,048 = 410k tokens: more than GPU + host
    return run_scenario(prefixes=200, host_chunks=HOST_CHUNKS)


def test_working_set_between_gpu_and_host_is_served_from_host(fits_gpu_plus_host):
    m, _ = fits_gpu_plus_host
    assert host_tokens(m) > 0.3 * m[("vllm:prompt_tokens_total", ())]
    assert m[("vllm:external_prefix_cache_hits_total", ())] == host_tokens(m)
    assert m[("vllm:kv_offload_load_bytes_total", ())] > 0
    assert m[("vllm:kv_offload_store_bytes_total", ())] > 0
    assert m[("spillway_host_hit_tokens_total", ())] == host_tokens(m)
    assert m[("spillway_host_pool_evictions_total", ())] == 0
    assert share(m, "local_compute") < 0.2


def test_ttft_stays_low_with_host_hits(fits_gpu_plus_host, fits_gpu_plus_host_without_offload):
    m, p50 = fits_gpu_plus_host
    m_off, p50_off = fits_gpu_plus_host_without_offload
    assert host_tokens(m_off) == 0
    full_prefill = 0.004 + (PREFIX_TOKENS + 64) * 60e-6
    assert p50 < 0.3 * full_prefill
    assert p50 < 0.25 * p50_off
    assert ttft_fraction_below(m, "0.04") > 0.6
    assert ttft_fraction_below(m_off, "0.04") < ttft_fraction_below(m, "0.04") - 0.3


def test_working_set_beyond_gpu_and_host_evicts_and_recomputes(exceeds_both, fits_gpu_plus_host):
    m, p50 = exceeds_both
    m_fit, p50_fit = fits_gpu_plus_host
    assert m[("spillway_host_pool_evictions_total", ())] > 100
    assert m[("spillway_host_pool_thrash_total", ())] > 50
    assert m[("spillway_host_pool_used_chunks", ())] == HOST_CHUNKS
    assert share(m, "local_compute") > 0.3
    assert share(m, "local_compute") > 2 * share(m_fit, "local_compute")
    hit_ratio = host_tokens(m) / m[("vllm:prompt_tokens_total", ())]
    assert hit_ratio < host_tokens(m_fit) / m_fit[("vllm:prompt_tokens_total", ())]
    assert p50 > 3 * p50_fit
