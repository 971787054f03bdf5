"""Spillway's metric catalogue: every series Spillway defines, simulates or scrapes.

One :class:`Metric` per series (name, type, help, labels) is the single source of truth:

- Spillway's own series say what vLLM 0.33.0 does not export about the host pool (how
  full it is, how many chunks it evicted, whether evicted chunks were wanted again,
  the plan). The real engine builds the static ones with :func:`build_spillway_metrics`
  (``spillway_engine.launcher.plugin``) and exports the pool ones through vLLM's
  connector stats (``spillway_engine.offloader.spec`` / ``manager`` / ``connector``);
  the simulator builds them all with :func:`build_spillway_metrics`.
- The disk tier's ``spillway_disk_tier_*`` series (:data:`DISK_TIER_METRICS`), which the
  tier (``spillway_engine.offloader.disk_tier``) exports through vLLM's tier stats.
- vLLM's own series that the simulator imitates (``spillway_engine.simulator.prom``)
  and the operator scrapes (``spillway_operator.flow.pressure``), with the name, type, label
  names and help text of vLLM 0.33.0 (``tests/contract/test_simulator_metrics_contract.py``
  checks them against the installed vLLM source).

Every series carries vLLM's base labels ``model_name`` and ``engine`` first, so Spillway's
join with ``vllm:*`` series in PromQL. Counters appear with a ``_total`` suffix in the
exposition, as prometheus_client writes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from spillway_engine.planner.plan import Plan

#: vLLM's base labels on every engine metric (``v1/metrics/loggers.py``).
BASE_LABELS: tuple[str, ...] = ("model_name", "engine")

#: Label names of ``spillway_plan_info`` (after the base labels), in order.
PLAN_INFO_LABELS: tuple[str, ...] = (
    "model",
    "gpu",
    "offloader",
    "tensor_parallel_size",
    "num_groups",
    "group_kinds",
    "tokens_per_hash",
    "blocks_per_chunk",
    "num_chunks",
    "row_bytes",
    "capacity_tokens",
)

Kind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True)
class Metric:
    """One Prometheus family: what every producer and reader of it agrees on."""

    name: str
    kind: Kind
    help: str
    #: label names after :data:`BASE_LABELS`
    labels: tuple[str, ...] = ()
    #: values of the one extra label whose series exist from the start (vLLM creates them)
    values: tuple[str, ...] = ()
    #: histogram bucket bounds; None where they depend on the engine (token counts)
    buckets: tuple[float, ...] | None = None

    @property
    def label_names(self) -> list[str]:
        return [*BASE_LABELS, *self.labels]

    def build(
        self, registry: CollectorRegistry, buckets: Iterable[float] | None = None
    ) -> Gauge | Counter | Histogram:
        """The prometheus_client family on ``registry`` (``buckets`` overrides)."""
        if self.kind == "gauge":
            return Gauge(
                self.name,
                self.help,
                self.label_names,
                registry=registry,
                multiprocess_mode="mostrecent",
            )
        if self.kind == "counter":
            return Counter(self.name, self.help, self.label_names, registry=registry)
        bounds = tuple(buckets) if buckets is not None else self.buckets
        assert bounds is not None, f"{self.name} needs its buckets"
        return Histogram(self.name, self.help, self.label_names, buckets=bounds, registry=registry)


# ------------------------------------------------------------------ vLLM 0.33.0
# Names and help texts as vLLM 0.33.0 defines them (v1/metrics/loggers.py, the
# offloading connector's metrics.py, v1/kv_offload/cpu/spec.py); label values are its
# enumerations (CacheHitSource, FinishReason, the waiting reasons, prompt sources).

# v1/metrics/buckets.py
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

NUM_REQUESTS_RUNNING = Metric(
    "vllm:num_requests_running", "gauge", "Number of requests in model execution batches."
)
NUM_REQUESTS_WAITING = Metric(
    "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."
)
NUM_REQUESTS_WAITING_BY_REASON = Metric(
    "vllm:num_requests_waiting_by_reason",
    "gauge",
    "Number of waiting requests by reason. "
    "Reason labels: 'capacity' = waiting for scheduling capacity; "
    "'deferred' = deferred by transient constraints "
    "(LoRA budget, KV transfer, blocked status). "
    "Sum of all reasons equals vllm:num_requests_waiting.",
    ("reason",),
    WAITING_REASONS,
)
KV_CACHE_USAGE_PERC = Metric(
    "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."
)
KV_OFFLOAD_CPU_CACHE_USAGE_PERC = Metric(
    "vllm:kv_offload_cpu_cache_usage_perc",
    "gauge",
    "Fraction of CPU KV-cache space currently pinned by active "
    "transfers (0.0 = idle, 1.0 = saturated). Sustained high "
    "values indicate transfers (stores or promotions) may be "
    "dropped due to insufficient capacity.",
)
KV_OFFLOAD_CPU_CACHE_WRITE_USAGE_PERC = Metric(
    "vllm:kv_offload_cpu_cache_write_usage_perc",
    "gauge",
    "Fraction of CPU KV-cache space currently pinned by "
    "in-flight stores that have not yet "
    "completed (0.0 = idle, 1.0 = saturated).",
)
KV_OFFLOAD_CPU_CACHE_READ_USAGE_PERC = Metric(
    "vllm:kv_offload_cpu_cache_read_usage_perc",
    "gauge",
    "Fraction of CPU KV-cache space currently pinned by "
    "in-flight loads that have not yet "
    "completed (0.0 = idle, 1.0 = saturated).",
)
KV_OFFLOAD_CONFIG_INFO = Metric(
    "vllm:kv_offload_config_info",
    "gauge",
    "Static configuration of the KV offload managers of this engine instance. "
    "The configured offloading spec declares the label names, and each manager "
    "fills the values, so a series appears from the first scheduler step of its "
    "engine. A manager reports one series for each configuration it holds, and "
    "a label of its own tells the series apart. Each engine reports its own "
    "configuration, not the instance total.",
    OFFLOAD_INFO_LABELS,
)
NUM_PREEMPTIONS = Metric(
    "vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."
)
PROMPT_TOKENS = Metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.")
GENERATION_TOKENS = Metric(
    "vllm:generation_tokens", "counter", "Number of generation tokens processed."
)
PREFIX_CACHE_QUERIES = Metric(
    "vllm:prefix_cache_queries",
    "counter",
    "Prefix cache queries, in terms of number of queried tokens.",
)
PREFIX_CACHE_HITS = Metric(
    "vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."
)
EXTERNAL_PREFIX_CACHE_QUERIES = Metric(
    "vllm:external_prefix_cache_queries",
    "counter",
    "External prefix cache queries from KV connector "
    "cross-instance cache sharing, in terms of number of queried tokens.",
)
EXTERNAL_PREFIX_CACHE_HITS = Metric(
    "vllm:external_prefix_cache_hits",
    "counter",
    "External prefix cache hits from KV connector "
    "cross-instance cache sharing, in terms of number of cached tokens.",
)
PROMPT_TOKENS_CACHED = Metric(
    "vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens (local + external)."
)
PROMPT_TOKENS_CACHED_BY_SOURCE = Metric(
    "vllm:prompt_tokens_cached_by_source",
    "counter",
    "Prefix-cache hit tokens by the cache tier that supplied them: "
    "device (local HBM), host (offloaded to DRAM), disk, p2p "
    "(transferred from another vLLM instance) or "
    "external_unspecified. Counted at admission; sums to "
    "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
    ("source",),
    CACHE_HIT_SOURCES,
)
PROMPT_TOKENS_BY_SOURCE = Metric(
    "vllm:prompt_tokens_by_source",
    "counter",
    "Number of prompt tokens by source.",
    ("source",),
    PROMPT_TOKEN_SOURCES,
)
KV_OFFLOAD_STORE_BYTES = Metric(
    "vllm:kv_offload_store_bytes", "counter", "Total bytes stored from GPU to offload storage."
)
KV_OFFLOAD_STORE_TIME = Metric(
    "vllm:kv_offload_store_time",
    "counter",
    "Total store time from GPU to offload storage, in seconds.",
)
KV_OFFLOAD_LOAD_BYTES = Metric(
    "vllm:kv_offload_load_bytes", "counter", "Total bytes loaded from offload storage to GPU."
)
KV_OFFLOAD_LOAD_TIME = Metric(
    "vllm:kv_offload_load_time",
    "counter",
    "Total load time from offload storage to GPU, in seconds.",
)
KV_OFFLOAD_ALLOCATION_FAILURE = Metric(
    "vllm:kv_offload_allocation_failure",
    "counter",
    "Number of KV offload store allocation attempts that failed.",
)
REQUEST_SUCCESS = Metric(
    "vllm:request_success",
    "counter",
    "Count of successfully processed requests.",
    ("finished_reason",),
    FINISH_REASONS,
)
TIME_TO_FIRST_TOKEN_SECONDS = Metric(
    "vllm:time_to_first_token_seconds",
    "histogram",
    "Histogram of time to first token in seconds.",
    buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
)
INTER_TOKEN_LATENCY_SECONDS = Metric(
    "vllm:inter_token_latency_seconds",
    "histogram",
    "Histogram of inter-token latency in seconds.",
    buckets=INTER_TOKEN_LATENCY_BUCKETS,
)
E2E_REQUEST_LATENCY_SECONDS = Metric(
    "vllm:e2e_request_latency_seconds",
    "histogram",
    "Histogram of e2e request latency in seconds.",
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_QUEUE_TIME_SECONDS = Metric(
    "vllm:request_queue_time_seconds",
    "histogram",
    "Histogram of time spent in WAITING phase for request.",
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_NUM_PREEMPTIONS = Metric(
    "vllm:request_num_preemptions",
    "histogram",
    "Histogram of the number of times a request was preempted.",
    buckets=REQUEST_NUM_PREEMPTIONS_BUCKETS,
)
# vLLM's token histograms use 1-2-5 buckets up to max_model_len: the engine's to give.
REQUEST_PROMPT_TOKENS = Metric(
    "vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed."
)
REQUEST_GENERATION_TOKENS = Metric(
    "vllm:request_generation_tokens", "histogram", "Number of generation tokens processed."
)
KV_OFFLOAD_STORE_SIZE = Metric(
    "vllm:kv_offload_store_size",
    "histogram",
    "Histogram of KV offload store operation size, in bytes.",
    buckets=TRANSFER_SIZE_BUCKETS,
)
KV_OFFLOAD_LOAD_SIZE = Metric(
    "vllm:kv_offload_load_size",
    "histogram",
    "Histogram of KV offload load operation size, in bytes.",
    buckets=TRANSFER_SIZE_BUCKETS,
)

#: vLLM's series the simulator exports (in this order); the operator reads a subset.
VLLM_METRICS: tuple[Metric, ...] = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    NUM_REQUESTS_WAITING_BY_REASON,
    KV_CACHE_USAGE_PERC,
    KV_OFFLOAD_CPU_CACHE_USAGE_PERC,
    KV_OFFLOAD_CPU_CACHE_WRITE_USAGE_PERC,
    KV_OFFLOAD_CPU_CACHE_READ_USAGE_PERC,
    KV_OFFLOAD_CONFIG_INFO,
    NUM_PREEMPTIONS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    EXTERNAL_PREFIX_CACHE_QUERIES,
    EXTERNAL_PREFIX_CACHE_HITS,
    PROMPT_TOKENS_CACHED,
    PROMPT_TOKENS_CACHED_BY_SOURCE,
    PROMPT_TOKENS_BY_SOURCE,
    KV_OFFLOAD_STORE_BYTES,
    KV_OFFLOAD_STORE_TIME,
    KV_OFFLOAD_LOAD_BYTES,
    KV_OFFLOAD_LOAD_TIME,
    KV_OFFLOAD_ALLOCATION_FAILURE,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    E2E_REQUEST_LATENCY_SECONDS,
    REQUEST_QUEUE_TIME_SECONDS,
    REQUEST_NUM_PREEMPTIONS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    KV_OFFLOAD_STORE_SIZE,
    KV_OFFLOAD_LOAD_SIZE,
)

# -------------------------------------------------------------------- Spillway

HOST_POOL_CAPACITY_CHUNKS = Metric(
    "spillway_host_pool_capacity_chunks",
    "gauge",
    "Chunks of every offloaded KV-cache group the host (CPU) KV pool holds, as planned.",
)
HOST_POOL_CAPACITY_TOKENS = Metric(
    "spillway_host_pool_capacity_tokens",
    "gauge",
    "Tokens of prefix the host KV pool holds, as planned.",
)
HOST_POOL_USED_CHUNKS = Metric(
    "spillway_host_pool_used_chunks",
    "gauge",
    "Host KV pool units holding keys now, in chunks of every offloaded group "
    "(the unit of spillway_host_pool_capacity_chunks).",
)
HOST_POOL_TOKENS = Metric(
    "spillway_host_pool_tokens",
    "gauge",
    "Prefix tokens held in the host KV pool (chunks of the first full-attention group "
    "x tokens per chunk).",
)
HOST_POOL_EVICTIONS = Metric(
    "spillway_host_pool_evictions",
    "counter",
    "(chunk, group) keys evicted from the host KV pool.",
)
HOST_POOL_THRASH = Metric(
    "spillway_host_pool_thrash",
    "counter",
    "Chunks evicted from the host KV pool that a later request asked for again.",
)
HOST_LOOKUP_TOKENS = Metric(
    "spillway_host_lookup_tokens",
    "counter",
    "Prompt tokens looked up in the host KV pool beyond the GPU prefix hit.",
)
HOST_HIT_TOKENS = Metric(
    "spillway_host_hit_tokens",
    "counter",
    "Prompt tokens found in the host KV pool (loaded instead of recomputed).",
)
#: Only on an emulated GPU (spillway_engine.emulator), where a page's expected bytes
#: are known: the emulated forward pass checks every page it reads against them.
EMULATOR_KV_MISMATCH = Metric(
    "spillway_emulator_kv_mismatch",
    "counter",
    "KV page slots (layer x position) an emulated GPU read that differ from what "
    "recomputing the prefix writes (a bad host load or a wrong prefix hit); 0 when correct.",
)
PLAN_INFO = Metric(
    "spillway_plan_info",
    "gauge",
    "Spillway KV plan of this engine (value 1; facts as labels).",
    PLAN_INFO_LABELS,
)

# The disk tier under the host pool (spillway_engine.offloader.disk_tier): its engine
# core exports these through vLLM's tier stats (SecondaryTierManager.get_stats /
# build_metric_definitions); build_spillway_metrics does not build them.
DISK_TIER_BUDGET_BYTES = Metric(
    "spillway_disk_tier_budget_bytes", "gauge", "Byte budget of the disk KV tier."
)
DISK_TIER_USED_BYTES = Metric(
    "spillway_disk_tier_used_bytes",
    "gauge",
    "Bytes the disk KV tier's own chunk files take (allocation-rounded; chunks another "
    "replica wrote on a shared volume are not counted).",
)
DISK_TIER_CHUNKS = Metric(
    "spillway_disk_tier_chunks",
    "gauge",
    "Chunk files held (counted against the budget) by the disk KV tier.",
)
DISK_TIER_HITS = Metric(
    "spillway_disk_tier_hits",
    "counter",
    "Disk KV tier lookups that found the chunk (own or, on a shared volume, another "
    "replica's).",
)
DISK_TIER_SHARED_HITS = Metric(
    "spillway_disk_tier_shared_hits",
    "counter",
    "Disk KV tier lookups that found a chunk another replica wrote on the shared volume "
    "(a subset of spillway_disk_tier_hits).",
)
DISK_TIER_MISSES = Metric(
    "spillway_disk_tier_misses", "counter", "Disk KV tier lookups that did not find the chunk."
)
DISK_TIER_LOADS = Metric(
    "spillway_disk_tier_loads", "counter", "Chunks read back from the disk KV tier."
)
DISK_TIER_LOAD_FAILURES = Metric(
    "spillway_disk_tier_load_failures",
    "counter",
    "Chunk reads from the disk KV tier that failed (file gone or unreadable).",
)
DISK_TIER_STORES = Metric(
    "spillway_disk_tier_stores", "counter", "Chunk files written by the disk KV tier."
)
DISK_TIER_EVICTIONS = Metric(
    "spillway_disk_tier_evictions",
    "counter",
    "Chunk files the disk KV tier deleted to stay within its budget.",
)
DISK_TIER_WRITE_FAILURES = Metric(
    "spillway_disk_tier_write_failures",
    "counter",
    "Chunk writes the disk refused (full, read-only, failing).",
)
DISK_TIER_STORES_DROPPED = Metric(
    "spillway_disk_tier_stores_dropped",
    "counter",
    "Chunks not written: no room left to evict, or backing off after a failure.",
)
DISK_TIER_THRASH = Metric(
    "spillway_disk_tier_thrash",
    "counter",
    "Chunks the disk KV tier evicted that a later request asked for again (its anchor "
    "group's, one per chunk of prefix: recomputed, as nothing holds them any more).",
)
#: The disk tier's series, in exposition order.
DISK_TIER_METRICS: tuple[Metric, ...] = (
    DISK_TIER_BUDGET_BYTES,
    DISK_TIER_USED_BYTES,
    DISK_TIER_CHUNKS,
    DISK_TIER_HITS,
    DISK_TIER_SHARED_HITS,
    DISK_TIER_MISSES,
    DISK_TIER_LOADS,
    DISK_TIER_LOAD_FAILURES,
    DISK_TIER_STORES,
    DISK_TIER_EVICTIONS,
    DISK_TIER_WRITE_FAILURES,
    DISK_TIER_STORES_DROPPED,
    DISK_TIER_THRASH,
)

#: The pool's live series: with Spillway's connector the engine core exports them
#: through vLLM's connector stats (the manager and the connector count them).
POOL_METRICS: tuple[Metric, ...] = (
    HOST_POOL_USED_CHUNKS,
    HOST_POOL_TOKENS,
    HOST_POOL_EVICTIONS,
    HOST_POOL_THRASH,
    HOST_LOOKUP_TOKENS,
    HOST_HIT_TOKENS,
)
#: Every Spillway series :func:`build_spillway_metrics` builds, in exposition order
#: (the disk tier's, :data:`DISK_TIER_METRICS`, come from its engine core).
SPILLWAY_METRICS: tuple[Metric, ...] = (
    HOST_POOL_CAPACITY_CHUNKS,
    HOST_POOL_CAPACITY_TOKENS,
    *POOL_METRICS,
    PLAN_INFO,
)
METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in SPILLWAY_METRICS)

#: name -> Metric for every series in the catalogue.
CATALOGUE: dict[str, Metric] = {
    m.name: m for m in (*VLLM_METRICS, *SPILLWAY_METRICS, *DISK_TIER_METRICS)
}


def _label_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def plan_info_labels(plan: Plan) -> dict[str, str]:
    """The ``spillway_plan_info`` label values of a plan."""
    values = {
        "model": plan.model.name,
        "gpu": plan.gpu.name,
        "offloader": plan.offloader,
        "tensor_parallel_size": plan.parallelism.tensor_parallel_size,
        "num_groups": len(plan.kv_groups),
        "group_kinds": ",".join(g.kind for g in plan.kv_groups),
        "tokens_per_hash": plan.tokens_per_hash,
        "blocks_per_chunk": plan.blocks_per_chunk,
        "num_chunks": plan.num_chunks,
        "row_bytes": plan.row_bytes,
        "capacity_tokens": plan.capacity_tokens,
    }
    return {k: _label_value(values[k]) for k in PLAN_INFO_LABELS}


@dataclass
class SpillwayMetrics:
    """The metric families, bound to one (model_name, engine) label pair."""

    capacity_chunks: Gauge
    capacity_tokens: Gauge
    #: the dynamic families are None where Spillway's connector exports them itself
    used_chunks: Gauge | None
    pool_tokens: Gauge | None
    evictions: Counter | None
    thrash: Counter | None
    lookup_tokens: Counter | None
    hit_tokens: Counter | None
    plan_info: Gauge
    model_name: str
    engine: str

    @property
    def dynamic_families(self) -> list[Gauge | Counter]:
        families = (getattr(self, field) for field, m in _FIELDS.items() if m in POOL_METRICS)
        return [f for f in families if f is not None]

    def _child(self, metric):
        return metric.labels(self.model_name, self.engine)

    def set_plan(self, plan: Plan) -> None:
        """Publish the static plan facts (capacity gauges and ``spillway_plan_info``)."""
        self._child(self.capacity_chunks).set(plan.num_chunks)
        self._child(self.capacity_tokens).set(plan.capacity_tokens)
        labels = plan_info_labels(plan)
        self.plan_info.labels(self.model_name, self.engine, *labels.values()).set(1)

    def set_fill(self, used_chunks: int, tokens: int) -> None:
        assert self.used_chunks is not None and self.pool_tokens is not None
        self._child(self.used_chunks).set(used_chunks)
        self._child(self.pool_tokens).set(tokens)

    def add(
        self,
        *,
        evictions: int = 0,
        thrash: int = 0,
        lookup_tokens: int = 0,
        hit_tokens: int = 0,
    ) -> None:
        """Increase the counters by the given deltas (zero deltas are skipped)."""
        deltas = {
            "evictions": evictions,
            "thrash": thrash,
            "lookup_tokens": lookup_tokens,
            "hit_tokens": hit_tokens,
        }
        for field, delta in deltas.items():
            family = getattr(self, field)
            assert family is not None, f"{field} is exported by the connector here"
            if delta:
                self._child(family).inc(delta)


#: SpillwayMetrics field -> its catalogue entry, in exposition order.
_FIELDS: dict[str, Metric] = {
    "capacity_chunks": HOST_POOL_CAPACITY_CHUNKS,
    "capacity_tokens": HOST_POOL_CAPACITY_TOKENS,
    "used_chunks": HOST_POOL_USED_CHUNKS,
    "pool_tokens": HOST_POOL_TOKENS,
    "evictions": HOST_POOL_EVICTIONS,
    "thrash": HOST_POOL_THRASH,
    "lookup_tokens": HOST_LOOKUP_TOKENS,
    "hit_tokens": HOST_HIT_TOKENS,
    "plan_info": PLAN_INFO,
}


def build_spillway_metrics(
    registry: CollectorRegistry, model_name: str, engine: str = "0", *, dynamic: bool = True
) -> SpillwayMetrics:
    """Create Spillway's metric families on ``registry`` and bind them to one engine.

    ``dynamic=False`` creates only the static plan families: with Spillway's connector
    the pool series come from the engine core through vLLM's connector metrics, under
    the same names (``spillway_engine.offloader.spec``).
    """
    families = {
        field: m.build(registry) if dynamic or m not in POOL_METRICS else None
        for field, m in _FIELDS.items()
    }
    metrics = SpillwayMetrics(**families, model_name=model_name, engine=engine)
    # Materialise the label children so every series is exported from the start.
    for field, family in families.items():
        if family is not None and not _FIELDS[field].labels:
            family.labels(model_name, engine)
    return metrics
