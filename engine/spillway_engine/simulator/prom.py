"""The simulator's ``/metrics``: vLLM 0.33.0's names, types and labels, plus Spillway's.

Every ``vllm:*`` family here exists in vLLM 0.33.0 with the same type and label names
(checked by ``tests/contract/test_simulator_metrics_contract.py`` against the installed
vLLM source); bucket bounds are vLLM's defaults (``v1/metrics/buckets.py`` and the
offloading connector's transfer-size buckets). Base labels: ``model_name`` (the served
model name) and ``engine`` ("0"). Latencies are in modelled seconds of the core's clock.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from spillway_engine.metrics import BASE_LABELS, build_spillway_metrics
from spillway_engine.simulator.core import LOADING, EngineCore, SimRequest

# vLLM 0.33.0 v1/metrics/buckets.py
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# offloading/metrics.py TRANSFER_SIZE_BUCKETS
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)

CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
#: CPUOffloadingInfo fields, the label names of vllm:kv_offload_config_info
OFFLOAD_INFO_LABELS = (
    "cpu_num_chunks",
    "cpu_blocks_per_chunk",
    "cpu_kv_cache_size_bytes",
    "cpu_kv_cache_size_tokens",
)


def build_buckets_1_2_5(max_value: int) -> list[float]:
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class SimulatorMetrics:
    """Prometheus families for one simulated engine; also the core's Observer.

    Call :meth:`sync` before each scrape: it copies the core's gauges and counter
    deltas; histograms are observed as tokens and requests complete.
    """

    def __init__(
        self,
        core: EngineCore,
        registry: CollectorRegistry | None = None,
        model_name: str | None = None,
        engine: str = "0",
    ) -> None:
        self.core = core
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name or core.plan.model_name
        self.engine = engine
        base = list(BASE_LABELS)
        reg = self.registry
        lv = (self.model_name, engine)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*base, *extra], registry=reg, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*base, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, base, buckets=buckets, registry=reg)

        self.g_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(*lv)
        self.g_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(*lv)
        waiting_by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            ("reason",),
        )
        self.g_waiting_capacity = waiting_by_reason.labels(*lv, "capacity")
        self.g_waiting_deferred = waiting_by_reason.labels(*lv, "deferred")
        self.g_kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(*lv)
        self.g_cpu_usage = gauge(
            "vllm:kv_offload_cpu_cache_usage_perc",
            "Fraction of CPU KV-cache space currently pinned by active transfers.",
        ).labels(*lv)
        self.g_cpu_write_usage = gauge(
            "vllm:kv_offload_cpu_cache_write_usage_perc",
            "Fraction of CPU KV-cache space pinned by in-flight stores.",
        ).labels(*lv)
        self.g_cpu_read_usage = gauge(
            "vllm:kv_offload_cpu_cache_read_usage_perc",
            "Fraction of CPU KV-cache space pinned by in-flight loads.",
        ).labels(*lv)
        info = gauge(
            "vllm:kv_offload_config_info",
            "Static configuration of the KV offload managers of this engine instance.",
            OFFLOAD_INFO_LABELS,
        )
        plan = core.plan
        section = plan.raw.get(plan.offloader)
        gauge_tokens = section.get("gauge_tokens") if isinstance(section, dict) else None
        info.labels(
            *lv,
            str(plan.num_chunks),
            str(plan.blocks_per_chunk),
            str(plan.num_chunks * plan.row_bytes),
            str(gauge_tokens if gauge_tokens is not None else plan.capacity_tokens),
        ).set(1)

        self._counters: list[tuple[str, Counter]] = []

        def track(attr: str, metric: Counter) -> None:
            self._counters.append((attr, metric))

        track(
            "preemptions",
            counter(
                "vllm:num_preemptions", "Cumulative number of preemption from the engine."
            ).labels(*lv),
        )
        track(
            "prompt_tokens",
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*lv),
        )
        track(
            "generation_tokens",
            counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(*lv),
        )
        track(
            "prefix_queries",
            counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
            ).labels(*lv),
        )
        track(
            "prefix_hits",
            counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
            ).labels(*lv),
        )
        track(
            "external_queries",
            counter(
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector, in queried tokens.",
            ).labels(*lv),
        )
        track(
            "external_hits",
            counter(
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector, in cached tokens.",
            ).labels(*lv),
        )
        cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(*lv)
        self._cached_total = cached
        by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            ("source",),
        )
        for source in CACHE_HIT_SOURCES:
            by_source.labels(*lv, source)
        track("cached_device", by_source.labels(*lv, "device"))
        track("cached_host", by_source.labels(*lv, "host"))
        prompt_by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",)
        )
        track("by_source_local_compute", prompt_by_source.labels(*lv, "local_compute"))
        track("by_source_local_cache_hit", prompt_by_source.labels(*lv, "local_cache_hit"))
        track("by_source_external", prompt_by_source.labels(*lv, "external_kv_transfer"))
        track(
            "store_bytes",
            counter(
                "vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage."
            ).labels(*lv),
        )
        track(
            "store_time",
            counter(
                "vllm:kv_offload_store_time",
                "Total store time from GPU to offload storage, in seconds.",
            ).labels(*lv),
        )
        track(
            "load_bytes",
            counter(
                "vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU."
            ).labels(*lv),
        )
        track(
            "load_time",
            counter(
                "vllm:kv_offload_load_time",
                "Total load time from offload storage to GPU, in seconds.",
            ).labels(*lv),
        )
        track(
            "allocation_failures",
            counter(
                "vllm:kv_offload_allocation_failure",
                "Number of KV offload store allocation attempts that failed.",
            ).labels(*lv),
        )
        success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        for reason in FINISH_REASONS:
            success.labels(*lv, reason)
        self._success_length = success.labels(*lv, "length")
        self._success_abort = success.labels(*lv, "abort")

        self.h_ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        ).labels(*lv)
        self.h_itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        ).labels(*lv)
        self.h_e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*lv)
        self.h_queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*lv)
        self.h_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        ).labels(*lv)
        token_buckets = build_buckets_1_2_5(core.max_model_len)
        self.h_prompt_len = histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            token_buckets,
        ).labels(*lv)
        self.h_gen_len = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        ).labels(*lv)
        self.h_store_size = histogram(
            "vllm:kv_offload_store_size",
            "Histogram of KV offload store operation size, in bytes.",
            TRANSFER_SIZE_BUCKETS,
        ).labels(*lv)
        self.h_load_size = histogram(
            "vllm:kv_offload_load_size",
            "Histogram of KV offload load operation size, in bytes.",
            TRANSFER_SIZE_BUCKETS,
        ).labels(*lv)

        self.spillway = build_spillway_metrics(reg, self.model_name, engine)
        self.spillway.set_plan(plan.raw)
        self._last: dict[str, float] = {}
        self._last_cached = 0
        self._last_host: dict[str, int] = {}
        core.observer = self
        self.sync()

    # Observer ----------------------------------------------------------------
    def on_token(self, req: SimRequest, itl: float | None) -> None:
        if itl is None:
            self.h_ttft.observe(req.first_token_time - req.arrival)  # type: ignore[operator]
        else:
            self.h_itl.observe(itl)

    def on_finished(self, req: SimRequest) -> None:
        self.h_e2e.observe(req.finish_time - req.arrival)  # type: ignore[operator]
        if req.first_scheduled is not None:
            self.h_queue.observe(req.first_scheduled - req.arrival)
        self.h_preemptions.observe(req.num_preemptions)
        self.h_prompt_len.observe(req.prompt_len)
        self.h_gen_len.observe(req.num_output)
        self._success_length.inc()

    def on_abort(self) -> None:
        self._success_abort.inc()

    # Scrape ------------------------------------------------------------------
    def sync(self) -> None:
        """Copy the core's current state into the Prometheus families."""
        core = self.core
        c = core.counters
        running = len(core.running)
        waiting = len(core.waiting)
        deferred = sum(1 for r in core.waiting if r.state == LOADING)
        self.g_running.set(running)
        self.g_waiting.set(waiting)
        self.g_waiting_capacity.set(waiting - deferred)
        self.g_waiting_deferred.set(deferred)
        self.g_kv_usage.set(core.kv_cache_usage())
        store_frac, load_frac = core.host_pinned_fraction()
        self.g_cpu_usage.set(min(1.0, store_frac + load_frac))
        self.g_cpu_write_usage.set(store_frac)
        self.g_cpu_read_usage.set(load_frac)
        last = self._last
        for attr, metric in self._counters:
            value = getattr(c, attr)
            delta = value - last.get(attr, 0)
            if delta > 0:
                metric.inc(delta)
                last[attr] = value
        cached = c.cached_device + c.cached_host
        if cached > self._last_cached:
            self._cached_total.inc(cached - self._last_cached)
            self._last_cached = cached
        for size in core.store_ops:
            self.h_store_size.observe(size)
        core.store_ops.clear()
        for size in core.load_ops:
            self.h_load_size.observe(size)
        core.load_ops.clear()
        host = {
            "evictions": c.host_evictions,
            "thrash": c.host_thrash,
            "lookup_tokens": c.host_lookup_tokens,
            "hit_tokens": c.host_hit_tokens,
        }
        deltas = {k: v - self._last_host.get(k, 0) for k, v in host.items()}
        self.spillway.add(**deltas)
        self._last_host = host
        self.spillway.set_fill(core.host_used_chunks(), core.host_tokens())
