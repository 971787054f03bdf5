"""The simulator's ``/metrics``: vLLM 0.33.0's names, types and labels, plus Spillway's.

Every family comes from the catalogue in :mod:`spillway_engine.metrics` (vLLM's series
as vLLM 0.33.0 defines them, checked by ``tests/contract/test_simulator_metrics_contract.py``
against the installed vLLM source). Base labels: ``model_name`` (the served model name)
and ``engine`` ("0"). Latencies are in modelled seconds of the core's clock.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from spillway_engine import metrics as m
from spillway_engine.metrics import build_spillway_metrics
from spillway_engine.simulator.core import LOADING, EngineCore, SimRequest

#: Core counters (``EngineCore.counters`` attributes) copied as deltas at each sync,
#: each into one series: (attribute, family, value of its extra label or None).
COUNTER_FEEDS: tuple[tuple[str, m.Metric, str | None], ...] = (
    ("preemptions", m.NUM_PREEMPTIONS, None),
    ("prompt_tokens", m.PROMPT_TOKENS, None),
    ("generation_tokens", m.GENERATION_TOKENS, None),
    ("prefix_queries", m.PREFIX_CACHE_QUERIES, None),
    ("prefix_hits", m.PREFIX_CACHE_HITS, None),
    ("external_queries", m.EXTERNAL_PREFIX_CACHE_QUERIES, None),
    ("external_hits", m.EXTERNAL_PREFIX_CACHE_HITS, None),
    ("cached_device", m.PROMPT_TOKENS_CACHED_BY_SOURCE, "device"),
    ("cached_host", m.PROMPT_TOKENS_CACHED_BY_SOURCE, "host"),
    ("by_source_local_compute", m.PROMPT_TOKENS_BY_SOURCE, "local_compute"),
    ("by_source_local_cache_hit", m.PROMPT_TOKENS_BY_SOURCE, "local_cache_hit"),
    ("by_source_external", m.PROMPT_TOKENS_BY_SOURCE, "external_kv_transfer"),
    ("store_bytes", m.KV_OFFLOAD_STORE_BYTES, None),
    ("store_time", m.KV_OFFLOAD_STORE_TIME, None),
    ("load_bytes", m.KV_OFFLOAD_LOAD_BYTES, None),
    ("load_time", m.KV_OFFLOAD_LOAD_TIME, None),
    ("allocation_failures", m.KV_OFFLOAD_ALLOCATION_FAILURE, None),
)


def build_buckets_1_2_5(max_value: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets``: its token-count histogram bounds."""
    out: list[float] = []
    exponent = 0
    while True:
        for mult in (1, 2, 5):
            value = mult * 10**exponent
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
        tokens = build_buckets_1_2_5(core.max_model_len)
        token_histograms = (m.REQUEST_PROMPT_TOKENS, m.REQUEST_GENERATION_TOKENS)
        self.families = {
            metric.name: metric.build(self.registry, tokens if metric in token_histograms else None)
            for metric in m.VLLM_METRICS
        }
        for metric in m.VLLM_METRICS:  # vLLM exports these series from the start
            if not metric.labels:
                self.series(metric)
            for value in metric.values:
                self.series(metric, value)
        plan = core.plan
        gauge_tokens = plan.gauge_tokens
        self.series(
            m.KV_OFFLOAD_CONFIG_INFO,
            str(plan.num_chunks),
            str(plan.blocks_per_chunk),
            str(plan.num_chunks * plan.row_bytes),
            str(gauge_tokens if gauge_tokens is not None else plan.capacity_tokens),
        ).set(1)
        self._counters = [
            (attr, self.series(metric, *(() if value is None else (value,))))
            for attr, metric, value in COUNTER_FEEDS
        ]
        # observed per token: bind the histogram series once
        self.h_ttft = self.series(m.TIME_TO_FIRST_TOKEN_SECONDS)
        self.h_itl = self.series(m.INTER_TOKEN_LATENCY_SECONDS)
        self.h_e2e = self.series(m.E2E_REQUEST_LATENCY_SECONDS)
        self.h_queue = self.series(m.REQUEST_QUEUE_TIME_SECONDS)
        self.h_preemptions = self.series(m.REQUEST_NUM_PREEMPTIONS)
        self.h_prompt_len = self.series(m.REQUEST_PROMPT_TOKENS)
        self.h_gen_len = self.series(m.REQUEST_GENERATION_TOKENS)

        self.spillway = build_spillway_metrics(self.registry, self.model_name, engine)
        self.spillway.set_plan(plan.plan)
        self._last: dict[str, float] = {}
        self._last_cached = 0
        self._last_host: dict[str, int] = {}
        core.observer = self
        self.sync()

    def series(self, metric: m.Metric, *values: str):
        """This engine's series of ``metric`` (with the values of its extra labels)."""
        return self.families[metric.name].labels(self.model_name, self.engine, *values)

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
        self.series(m.REQUEST_SUCCESS, "length").inc()

    def on_abort(self) -> None:
        self.series(m.REQUEST_SUCCESS, "abort").inc()

    # Scrape ------------------------------------------------------------------
    def sync(self) -> None:
        """Copy the core's current state into the Prometheus families."""
        core = self.core
        c = core.counters
        running = len(core.running)
        waiting = len(core.waiting)
        deferred = sum(1 for r in core.waiting if r.state == LOADING)
        store_frac, load_frac = core.host_pinned_fraction()
        gauges = (
            (m.NUM_REQUESTS_RUNNING, (), running),
            (m.NUM_REQUESTS_WAITING, (), waiting),
            (m.NUM_REQUESTS_WAITING_BY_REASON, ("capacity",), waiting - deferred),
            (m.NUM_REQUESTS_WAITING_BY_REASON, ("deferred",), deferred),
            (m.KV_CACHE_USAGE_PERC, (), core.kv_cache_usage()),
            (m.KV_OFFLOAD_CPU_CACHE_USAGE_PERC, (), min(1.0, store_frac + load_frac)),
            (m.KV_OFFLOAD_CPU_CACHE_WRITE_USAGE_PERC, (), store_frac),
            (m.KV_OFFLOAD_CPU_CACHE_READ_USAGE_PERC, (), load_frac),
        )
        for metric, values, value in gauges:
            self.series(metric, *values).set(value)
        last = self._last
        for attr, metric in self._counters:
            value = getattr(c, attr)
            delta = value - last.get(attr, 0)
            if delta > 0:
                metric.inc(delta)
                last[attr] = value
        cached = c.cached_device + c.cached_host
        if cached > self._last_cached:
            self.series(m.PROMPT_TOKENS_CACHED).inc(cached - self._last_cached)
            self._last_cached = cached
        for size in core.store_ops:
            self.series(m.KV_OFFLOAD_STORE_SIZE).observe(size)
        core.store_ops.clear()
        for size in core.load_ops:
            self.series(m.KV_OFFLOAD_LOAD_SIZE).observe(size)
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
