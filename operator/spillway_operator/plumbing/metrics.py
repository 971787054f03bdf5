"""The operator's own Prometheus metrics (served by `spillway operator run`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "spillway_operator_reconciles_total",
    "Reconciles of InferenceDeployments by outcome.",
    ["outcome"],  # ok, refused, retry, error
)
RECONCILE_SECONDS = Histogram(
    "spillway_operator_reconcile_duration_seconds",
    "Wall time of one reconcile.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
API_REQUESTS = Counter(
    "spillway_operator_api_requests_total",
    "Requests the operator sent to the API server, by verb.",
    ["verb"],
)
CHILD_WRITES = Counter(
    "spillway_operator_child_writes_total",
    "Server-side applies of children, by kind and action (created, updated).",
    ["kind", "action"],
)
OFFLOAD_PRESSURE = Gauge(
    "spillway_offload_pressure",
    "Offload pressure of an InferenceDeployment (1.0 = at target), for HPA/KEDA or dashboards.",
    ["namespace", "name"],
)
QUEUE_DEPTH = Gauge("spillway_operator_queue_depth", "InferenceDeployments waiting to reconcile.")
SCRAPE_FAILURES = Counter(
    "spillway_operator_scrape_failures_total",
    "Pod /metrics scrapes the autoscaler could not use, by reason.",
    ["reason"],  # unreachable, http, too_large, timeout, not_utf8, malformed, parse_timeout
)
LEADER = Gauge(
    "spillway_operator_leader",
    "1 while this replica holds the leader Lease (reconciles, autoscales and writes), else 0.",
)
WRITES_FENCED = Counter(
    "spillway_operator_writes_fenced_total",
    "Writes refused inside the operator because this replica was not the leader.",
)
