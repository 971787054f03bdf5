"""The engine's cumulative counters: what vLLM's and Spillway's counters export."""

from __future__ import annotations

from dataclasses import dataclass


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
