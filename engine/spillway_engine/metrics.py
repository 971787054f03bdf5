"""Spillway's own Prometheus metrics: what vLLM 0.33.0 does not export about the host pool.

vLLM's offloader exports transfer bytes/time, a "pinned by in-flight transfers"
gauge and a static ``vllm:kv_offload_config_info``; it does not export how full the
host (CPU) pool is, how many chunks it evicted, or whether evicted chunks were wanted
again. The autoscaler needs exactly those, so Spillway defines them here, once, and
both the real engine (``spillway-engine serve``) and the simulator build them on their
registry with :func:`build_spillway_metrics`.

Every metric carries vLLM's base labels ``model_name`` and ``engine`` so they join
with ``vllm:*`` series in PromQL.

======================================  =========  =================================================
metric                                  type       meaning
======================================  =========  =================================================
``spillway_host_pool_capacity_chunks``  gauge      chunks of every group the pool holds
                                                   (``num_chunks``)
``spillway_host_pool_capacity_tokens``  gauge      prefix tokens the pool holds (capacity_tokens)
``spillway_host_pool_used_chunks``      gauge      the same unit, in use now (units held / units of
                                                   one chunk of every group)
``spillway_host_pool_tokens``           gauge      prefix tokens held now (chunks of a full-
                                                   attention group x tokens per chunk)
``spillway_host_pool_evictions``        counter    (chunk, group) keys evicted from the pool (LRU)
``spillway_host_pool_thrash``           counter    evicted chunks (of that group) a later
                                                   lookup asked for again
``spillway_host_lookup_tokens``         counter    prompt tokens looked up in the pool (beyond the
                                                   GPU prefix hit)
``spillway_host_hit_tokens``            counter    of those, tokens found (loaded, not recomputed)
``spillway_plan_info``                  gauge = 1  static plan facts as labels (PLAN_INFO_LABELS)
======================================  =========  =================================================

Counters appear with a ``_total`` suffix in the exposition, as prometheus_client writes
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

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

METRIC_NAMES: tuple[str, ...] = (
    "spillway_host_pool_capacity_chunks",
    "spillway_host_pool_capacity_tokens",
    "spillway_host_pool_used_chunks",
    "spillway_host_pool_tokens",
    "spillway_host_pool_evictions",
    "spillway_host_pool_thrash",
    "spillway_host_lookup_tokens",
    "spillway_host_hit_tokens",
    "spillway_plan_info",
)


def _label_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        # ``gpu`` / ``model`` may be objects in the plan: use their name.
        return str(value.get("name", ""))
    return str(value)


def plan_info_labels(plan: Mapping[str, Any]) -> dict[str, str]:
    """The ``spillway_plan_info`` label values read (defensively) from a plan dict."""
    groups = plan.get("kv_groups") or []
    kinds = ",".join(str(g.get("kind", "")) for g in groups if isinstance(g, Mapping))
    tp = plan.get("tensor_parallel_size")
    parallelism = plan.get("parallelism")
    if tp is None and isinstance(parallelism, Mapping):
        tp = parallelism.get("tensor_parallel_size")
    values = {
        "model": plan.get("model"),
        "gpu": plan.get("gpu"),
        "offloader": plan.get("offloader", ""),
        "tensor_parallel_size": tp if tp is not None else 1,
        "num_groups": len(groups),
        "group_kinds": kinds,
        "tokens_per_hash": plan.get("tokens_per_hash"),
        "blocks_per_chunk": plan.get("blocks_per_chunk"),
        "num_chunks": plan.get("num_chunks"),
        "row_bytes": plan.get("row_bytes"),
        "capacity_tokens": plan.get("capacity_tokens"),
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
        families = (
            self.used_chunks,
            self.pool_tokens,
            self.evictions,
            self.thrash,
            self.lookup_tokens,
            self.hit_tokens,
        )
        return [f for f in families if f is not None]

    def _child(self, metric):
        return metric.labels(self.model_name, self.engine)

    def set_plan(self, plan: Mapping[str, Any]) -> None:
        """Publish the static plan facts (capacity gauges and ``spillway_plan_info``)."""
        self._child(self.capacity_chunks).set(int(plan.get("num_chunks") or 0))
        self._child(self.capacity_tokens).set(int(plan.get("capacity_tokens") or 0))
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
        assert self.evictions and self.thrash and self.lookup_tokens and self.hit_tokens
        if evictions:
            self._child(self.evictions).inc(evictions)
        if thrash:
            self._child(self.thrash).inc(thrash)
        if lookup_tokens:
            self._child(self.lookup_tokens).inc(lookup_tokens)
        if hit_tokens:
            self._child(self.hit_tokens).inc(hit_tokens)


def build_spillway_metrics(
    registry: CollectorRegistry, model_name: str, engine: str = "0", *, dynamic: bool = True
) -> SpillwayMetrics:
    """Create Spillway's metric families on ``registry`` and bind them to one engine.

    ``dynamic=False`` creates only the static plan families: with Spillway's connector
    the pool series come from the engine core through vLLM's connector metrics, under
    the same names (``spillway_engine.offloader.spec``).
    """
    labels = list(BASE_LABELS)

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, labels, registry=registry, multiprocess_mode="mostrecent")

    def counter(name: str, doc: str) -> Counter:
        return Counter(name, doc, labels, registry=registry)

    def live(family: Any) -> Any:
        return family() if dynamic else None

    metrics = SpillwayMetrics(
        capacity_chunks=gauge(
            "spillway_host_pool_capacity_chunks", "Chunk slots in the host (CPU) KV pool."
        ),
        capacity_tokens=gauge(
            "spillway_host_pool_capacity_tokens",
            "Tokens of prefix the host KV pool holds, as planned.",
        ),
        used_chunks=live(
            lambda: gauge(
                "spillway_host_pool_used_chunks",
                "Chunk slots of the host KV pool that hold a (chunk, group) key.",
            )
        ),
        pool_tokens=live(
            lambda: gauge(
                "spillway_host_pool_tokens",
                "Prefix tokens held in the host KV pool (chunks of one group x tokens per chunk).",
            )
        ),
        evictions=live(
            lambda: counter("spillway_host_pool_evictions", "Chunks evicted from the host KV pool.")
        ),
        thrash=live(
            lambda: counter(
                "spillway_host_pool_thrash",
                "Chunks evicted from the host KV pool that a later request asked for again.",
            )
        ),
        lookup_tokens=live(
            lambda: counter(
                "spillway_host_lookup_tokens",
                "Prompt tokens looked up in the host KV pool beyond the GPU prefix hit.",
            )
        ),
        hit_tokens=live(
            lambda: counter(
                "spillway_host_hit_tokens",
                "Prompt tokens found in the host KV pool (loaded instead of recomputed).",
            )
        ),
        plan_info=Gauge(
            "spillway_plan_info",
            "Spillway KV plan of this engine (value 1; facts as labels).",
            [*labels, *PLAN_INFO_LABELS],
            registry=registry,
            multiprocess_mode="mostrecent",
        ),
        model_name=model_name,
        engine=engine,
    )
    # Materialise the label children so every series is exported from the start.
    for metric in (metrics.capacity_chunks, metrics.capacity_tokens, *metrics.dynamic_families):
        metric.labels(model_name, engine)
    return metrics
