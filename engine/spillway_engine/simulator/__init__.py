"""A vLLM 0.33.0 replica without a GPU: a virtual-time core plus an HTTP face.

- :mod:`.core` — :class:`EngineCore`, the pure, synchronous engine model, and
  :func:`replay`; its parts, each with its rules in its docstring: :mod:`.gpu_cache`
  (GPU KV blocks), :mod:`.host_cache` and :mod:`.unit_pool` (the host pool),
  :mod:`.scheduling` (one step), :mod:`.config` (latency model, scheduler limits),
  :mod:`.counters`, :mod:`.request`.
- :mod:`.plan_input` — reads a Spillway plan (``spillway plan --format json``).
- :mod:`.prom` — ``/metrics`` with vLLM's metric names, types and labels.
- :mod:`.server` — the aiohttp app (OpenAI-compatible endpoints).
- :mod:`.cluster` — :class:`VirtualCluster`: several replicas on one virtual clock,
  with routing, scaling and per-replica ``/metrics`` text (autoscaling benchmarks).
- :mod:`.__main__` — ``spillway-engine simulate`` (:func:`simulate_main`).
"""

from spillway_engine.simulator.core import (
    EngineCore,
    LatencyModel,
    ReplayItem,
    RequestRejected,
    SchedulerConfig,
    SimRequest,
    replay,
)
from spillway_engine.simulator.plan_input import PlanError, SimPlan, load_plan, parse_plan

__all__ = [
    "EngineCore",
    "LatencyModel",
    "PlanError",
    "ReplayItem",
    "RequestRejected",
    "SchedulerConfig",
    "SimPlan",
    "SimRequest",
    "load_plan",
    "parse_plan",
    "replay",
]
