"""Spillway's vLLM general plugin: the start-up plan check and the plan metrics.

Registered in the ``vllm.general_plugins`` entry-point group (name ``spillway``, value
``spillway_engine.launcher.plugin:register``). vLLM calls :func:`register` once in every
process it starts -- the API server, each engine core, each GPU worker -- so it is
idempotent, and it does nothing unless ``SPILLWAY_PLAN`` names a plan file
(``spillway-engine serve`` sets it before it execs ``vllm serve``).

Why a plugin, and why this hook
-------------------------------
The engine core builds the KV-cache configuration in ``EngineCore._initialize_kv_caches``
(``vllm/v1/engine/core.py``), in its own process: worker specs, layout, grouping,
``get_kv_cache_configs``, the hybrid ``block_size`` rewrite, then the hash unit
(``hash_block_size``) written into every config, and only then
``self.model_executor.initialize_from_config(kv_cache_configs)``, which makes the
workers allocate the GPU cache, build the connector's worker side and map the host
pool in ``/dev/shm``; warm-up and CUDA-graph capture follow. So
``Executor.initialize_from_config`` (defined once on the base class
``vllm.v1.executor.abstract.Executor``; the mp, uni-process and Ray executors inherit
it) is the first moment the *final* per-worker ``KVCacheConfig`` exists and the last
one before memory is committed. The plugin wraps it: the wrapper runs
:func:`spillway_engine.launcher.plan_check.check` on the executor's ``vllm_config`` and the
first worker's config, and on a mismatch logs the side-by-side table and raises
:class:`~spillway_engine.launcher.plan_check.PlanMismatch`. vLLM's engine-core start-up then
fails the normal way ("EngineCore failed to start", "Engine core initialization
failed"), the workers are torn down, and ``vllm serve`` -- hence the pod -- exits
non-zero. A wrapper around ``vllm serve`` itself could not do this: the engine core
is another process (spawned or forked), and only entry-point plugins run there.

Metrics
-------
vLLM serves ``/metrics`` from the API-server process: prometheus_client's default
registry, or with several API servers a ``MultiProcessCollector`` over
``PROMETHEUS_MULTIPROC_DIR`` that vLLM sets before it starts them. Its own engine
metrics are created in ``PrometheusStatLogger.__init__`` in that process, labelled
``model_name`` (the served name) and ``engine`` (DP index). The plugin wraps that
constructor and creates Spillway's families (``spillway_engine.metrics``) beside
them, with the same labels, and sets the static ones from the plan:
``spillway_plan_info`` and ``spillway_host_pool_capacity_{chunks,tokens}``. Created
there, they land in whichever registry mode vLLM uses (gauges are ``mostrecent``).
The dynamic series (used chunks, pool tokens, evictions, thrash, lookup/hit tokens)
belong to the offloader's scheduler side in the engine core: with Spillway's
connector they reach this process through vLLM's connector stats and are exported
under the same names by the connector's metrics (``spillway_engine.offloader.spec``),
so the plugin then creates only the static families; with vLLM's own connector they
are exported at zero.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterable
from typing import Any

from spillway_engine.launcher.plan_check import (
    PlanMismatch,
    check,
    effective_plan,
    format_table,
    stage_of_rank,
)
from spillway_engine.launcher.termination import write_termination_message
from spillway_engine.planner.plan import Plan, PlanReadError, read_plan
from spillway_engine.vllm_pins import SPILLWAY_CONNECTOR

#: Environment variable naming the plan file; the plugin is inert without it.
ENV_PLAN = "SPILLWAY_PLAN"
#: The entry point (group ``vllm.general_plugins``) pyproject.toml must declare.
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "spillway"
ENTRY_POINT_VALUE = "spillway_engine.launcher.plugin:register"

# A child of vLLM's logger, so it shares vLLM's handlers and format.
logger = logging.getLogger("vllm.spillway")

_state: dict[str, Any] = {"plan": None, "metrics": {}, "checked": set()}


class PluginError(RuntimeError):
    """The plugin cannot do its job (plan unreadable); stops the vLLM process."""


def load_plan_file(path: str) -> Plan:
    """The plan ``SPILLWAY_PLAN`` names, read by the planner's own reader."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PluginError(f"{ENV_PLAN}={path}: cannot read the plan: {e.strerror or e}") from e
    try:
        return read_plan(text, path)
    except PlanReadError as e:
        raise PluginError(f"{ENV_PLAN}={path}: {e}") from e


def register() -> None:
    """vLLM general-plugin entry: register Spillway's connector; with a plan, install
    the plan check and the plan metrics."""
    from spillway_engine.offloader import register_connector

    register_connector()
    path = os.environ.get(ENV_PLAN)
    if not path:
        return
    if _state["plan"] is not None:
        return
    try:
        _state["plan"] = load_plan_file(path)
    except PluginError as e:
        write_termination_message(str(e))
        raise
    install_plan_check()
    install_metrics()
    logger.debug("Spillway plugin active with plan %s", path)


# ----------------------------------------------------------------------- plan check


def run_plan_check(plan: Plan, vllm_config: Any, kv_cache_config: Any,
                   stage: int | None = None, where: str = "") -> None:
    """Check one built config (with ``stage``: against that pipeline stage of the plan);
    log and raise :class:`PlanMismatch` on a difference."""
    try:
        observed = check(plan, vllm_config, kv_cache_config, stage)
    except PlanMismatch as e:
        table = format_table(e.mismatches)
        logger.error(
            "Spillway plan check FAILED: vLLM's KV-cache geometry differs from the plan "
            "(the pod's memory and host pool were sized for the plan):\n%s",
            table,
        )
        # What the operator shows in the Degraded condition (EngineStartFailed).
        write_termination_message(
            f"Spillway plan check FAILED: vLLM's KV-cache geometry differs from the plan:\n{table}"
        )
        raise
    _state["checked"].add(id(kv_cache_config))
    logger.info(
        "Spillway plan check passed%s: %d KV-cache group(s), %d tokens per hash, "
        "%d bytes per block%s",
        where,
        len(observed.groups),
        observed.tokens_per_hash,
        observed.worker_bytes_per_block,
        ""
        if observed.num_chunks is None
        else f", {observed.num_chunks} host chunks of {observed.row_bytes} bytes",
    )


def _stage_where(plan: Plan, stage: int | None) -> str:
    return "" if stage is None or not plan.stages else f" (pipeline stage {stage})"


def install_plan_check() -> None:
    """Wrap ``Executor.initialize_from_config`` and ``WorkerWrapperBase.
    initialize_from_config`` (once each) so the check sees the real result.

    The engine core's executor holds every worker's config (remote nodes' too) and
    checks each against its pipeline stage before any memory is committed. Each worker
    then checks its own config again in its own process: on a headless node
    (``--headless``, a multi-node replica's rank > 0) that is the only check, and its
    failure is that pod's termination message. A config already checked in the same
    process (the uni-process executor's worker) is not checked twice."""
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    original = Executor.initialize_from_config
    if not getattr(original, "_spillway_checked", False):

        @functools.wraps(original)
        def initialize_from_config(self: Any, kv_cache_configs: list[Any]) -> None:
            plan = _state["plan"]
            if plan is not None and kv_cache_configs:
                pcp = self.vllm_config.parallel_config.prefill_context_parallel_size
                picks: list[tuple[int, int | None]] = [(0, None)]
                if plan.stages and len(kv_cache_configs) > 1:
                    # the first worker of each stage (its TP ranks build the same config)
                    step = plan.parallelism.tensor_parallel_size * max(1, pcp)
                    picks = [(r, stage_of_rank(plan, r, pcp))
                             for r in range(0, len(kv_cache_configs), step)]
                for rank, stage in picks:
                    run_plan_check(plan, self.vllm_config, kv_cache_configs[rank], stage,
                                   _stage_where(plan, stage))
            return original(self, kv_cache_configs)

        initialize_from_config._spillway_checked = True  # type: ignore[attr-defined]
        Executor.initialize_from_config = initialize_from_config  # type: ignore[method-assign]

    worker_original = WorkerWrapperBase.initialize_from_config
    if not getattr(worker_original, "_spillway_checked", False):

        @functools.wraps(worker_original)
        def worker_initialize_from_config(self: Any, kv_cache_configs: list[Any]) -> None:
            plan = _state["plan"]
            config = kv_cache_configs[self.global_rank]
            if plan is not None and id(config) not in _state["checked"]:
                stage = _pipeline_stage() if plan.stages else None
                run_plan_check(plan, self.vllm_config, config, stage,
                               f" on worker rank {self.global_rank}"
                               + _stage_where(plan, stage))
            return worker_original(self, kv_cache_configs)

        worker_initialize_from_config._spillway_checked = True  # type: ignore[attr-defined]
        WorkerWrapperBase.initialize_from_config = (  # type: ignore[method-assign]
            worker_initialize_from_config)


def _pipeline_stage() -> int | None:
    """This worker's pipeline rank (its groups are initialised by then)."""
    from vllm.distributed.parallel_state import get_pp_group

    try:
        return int(get_pp_group().rank_in_group)
    except AssertionError:  # no model-parallel groups in this process
        return None


# -------------------------------------------------------------------------- metrics


def publish_plan_metrics(
    plan: Plan,
    model_name: str,
    engine_indexes: Iterable[int],
    registry: Any = None,
    *,
    dynamic: bool = True,
) -> list[Any]:
    """Spillway's metric families on ``registry`` (default: prometheus_client's), with
    the plan's static values set for every engine. Safe to call again (vLLM rebuilds
    its stat logger): families are created once per registry. ``dynamic=False`` when
    Spillway's connector exports the pool series itself."""
    from prometheus_client import REGISTRY

    from spillway_engine.metrics import build_spillway_metrics

    registry = REGISTRY if registry is None else registry
    cache: dict[int, Any] = _state["metrics"]
    engines = [str(i) for i in engine_indexes] or ["0"]
    base = cache.get(id(registry))
    if base is None:
        base = build_spillway_metrics(registry, model_name, engines[0], dynamic=dynamic)
        cache[id(registry)] = base
    bound = []
    for engine in engines:
        metrics = dataclasses.replace(base, model_name=model_name, engine=engine)
        for family in metrics.dynamic_families:
            family.labels(model_name, engine)  # export the series from the start
        metrics.set_plan(plan)
        bound.append(metrics)
    return bound


def install_metrics() -> None:
    """Wrap ``PrometheusStatLogger.__init__`` (once): publish the plan beside vLLM's."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    original = PrometheusStatLogger.__init__
    if getattr(original, "_spillway_metrics", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        original(self, vllm_config, engine_indexes)
        plan = _state["plan"]
        if plan is None:
            return
        transfer = vllm_config.kv_transfer_config
        connector = getattr(transfer, "kv_connector", None)
        try:
            publish_plan_metrics(
                effective_plan(plan, connector),
                str(vllm_config.model_config.served_model_name),
                self.engine_indexes,
                dynamic=connector != SPILLWAY_CONNECTOR,
            )
        except Exception:  # metrics must never take the server down
            logger.exception("Spillway: could not publish the plan metrics")

    __init__._spillway_metrics = True  # type: ignore[attr-defined]
    PrometheusStatLogger.__init__ = __init__  # type: ignore[method-assign]
