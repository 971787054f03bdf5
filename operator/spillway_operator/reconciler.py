"""One idempotent reconcile for create, update, resume and drift.

parse spec -> resolve config.json -> plan -> render children -> apply what differs
-> compute status -> write it if it changed -> Events for transitions.

Errors are sorted into temporary ones (retried with back-off by the controller
loop, reported in status) and permanent ones (a condition and an Event that say
what to change; no retry until the spec changes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from spillway_engine.planner.model_config import ModelConfigSourceError, load_hub, parse_config_text
from spillway_engine.planner.plan import PlanRefused, PlanRequest, make_plan
from spillway_engine.quantity import parse_bytes
from spillway_operator import metrics, render
from spillway_operator.kube import Kube, TemporaryError
from spillway_operator.spec import InferenceDeploymentSpec
from spillway_operator.status import Observed, build_status, plan_summary, transitions

log = logging.getLogger("spillway.reconciler")


@dataclass(frozen=True)
class Result:
    outcome: str  # ok, refused, retry
    requeue_after: float | None = None
    writes: int = 0


class ConfigUnavailable(TemporaryError):
    """config.json cannot be read yet (missing ConfigMap/Secret, hub unreachable)."""


class ConfigInvalid(Exception):
    """config.json was read but is not usable; the user must change it."""


def plan_request(spec: InferenceDeploymentSpec) -> PlanRequest:
    """What the planner needs from the spec."""
    off = spec.offload
    host = None if off.host_memory == "auto" else parse_bytes(off.host_memory,
                                                              what="offload.hostMemory")
    return PlanRequest(
        model_name=spec.model.name,
        tensor_parallel_size=spec.engine.tensor_parallel_size,
        pipeline_parallel_size=spec.engine.pipeline_parallel_size,
        data_parallel_size=spec.engine.data_parallel_size,
        kv_cache_dtype=spec.engine.kv_cache_dtype.value,
        max_model_len=spec.engine.max_model_len,
        blocks_per_chunk=off.blocks_per_chunk,
        chunk_block_size_tokens=off.chunk_tokens,
        cpu_memory_bytes=host,
        memory_limit_bytes=render.memory_limit_bytes(spec) if host is None else None,
        offloader=off.offloader.value,
        gpu=spec.resources.gpu_product.value.lower(),
    )


class ConfigResolver:
    """config.json from the spec's ConfigMap, or from the hub (cached per revision)."""

    def __init__(self, kube: Kube):
        self.kube = kube
        self._hub_cache: dict[tuple[str, str | None], dict[str, Any]] = {}

    def resolve(self, namespace: str, spec: InferenceDeploymentSpec) -> dict[str, Any]:
        ref = spec.model.config_map_ref
        if ref:
            text = self.kube.read_configmap_key(namespace, ref.name, ref.key)
            if text is None:
                raise ConfigUnavailable(
                    f"ConfigMap {namespace}/{ref.name} with key {ref.key!r} not found"
                )
            try:
                return parse_config_text(text, f"ConfigMap {ref.name} key {ref.key}")
            except ModelConfigSourceError as exc:
                raise ConfigInvalid(str(exc)) from None
        key = (spec.model.name, spec.model.revision)
        if key not in self._hub_cache:
            token = None
            if spec.model.token_secret_ref:
                s = spec.model.token_secret_ref
                token = self.kube.read_secret_key(namespace, s.name, s.key)
                if token is None:
                    raise ConfigUnavailable(f"Secret {namespace}/{s.name} key {s.key!r} not found")
            try:
                self._hub_cache[key] = load_hub(spec.model.name, revision=spec.model.revision,
                                                token=token)
            except ModelConfigSourceError as exc:
                raise ConfigUnavailable(str(exc)) from None
        return self._hub_cache[key]


class Reconciler:
    def __init__(self, kube: Kube):
        self.kube = kube
        self.configs = ConfigResolver(kube)

    def reconcile(self, obj: dict[str, Any]) -> Result:
        started = time.perf_counter()
        try:
            result = self._reconcile(obj)
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        metrics.RECONCILES.labels(outcome=result.outcome).inc()
        return result

    def _reconcile(self, obj: dict[str, Any]) -> Result:
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return Result("ok")  # owner references let the garbage collector clean up
        owner = render.Owner(meta["name"], meta["namespace"], meta["uid"])
        old_status = obj.get("status") or {}
        obs = Observed(generation=meta.get("generation", 0), desired_replicas=0,
                       selector=render.selector_string(owner))
        writes = 0
        outcome, requeue = "ok", None
        try:
            spec = InferenceDeploymentSpec.model_validate(obj.get("spec") or {})
            obs.desired_replicas = spec.replicas
            config = self.configs.resolve(owner.namespace, spec)
            plan = make_plan(config, plan_request(spec)).model_dump(mode="json")
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            obs.plan_error = ("SpecInvalid", f"spec.{where}: {first['msg']}")
            outcome = "refused"
        except ConfigUnavailable as exc:
            obs.plan_error = ("ModelConfigUnavailable", str(exc))
            outcome = "retry"
        except ConfigInvalid as exc:
            obs.plan_error = ("ModelConfigInvalid", str(exc))
            outcome = "refused"
        except PlanRefused as exc:
            obs.plan_error = ("OffloadPlanInvalid", str(exc))
            outcome = "refused"
        else:
            digest = render.plan_hash(plan)
            obs.plan_summary = plan_summary(plan, spec.gpus_per_pod, digest)
            children = [render.plan_configmap(owner, spec, plan), render.service(owner),
                        render.deployment(owner, spec, plan)]
            if self.kube.service_monitors_served():
                children.append(render.service_monitor(owner))
            for child in children:
                action, live = self.kube.ensure(child)
                if child["kind"] == "Deployment":
                    obs.deployment = live
                if action != "unchanged":
                    writes += 1
                    metrics.CHILD_WRITES.labels(kind=child["kind"], action=action).inc()
                    log.info("%s %s/%s %s", action, owner.namespace, child["metadata"]["name"],
                             child["kind"])

        if obs.deployment is None:  # not applied this time (no plan): what is running?
            obs.deployment = self.kube.get(render.deployment_path(owner))
        if obs.deployment is not None:
            obs.pods = self.kube.list_pods(owner.namespace, render.selector_string(owner))
        status = build_status(obs, old_status, autoscaling_enabled=bool(
            (obj.get("spec") or {}).get("autoscaling", {}).get("enabled")))
        # Merge patch: keys we leave out (status.autoscaling, the autoscaler's) stay.
        if any(status.get(k) != old_status.get(k) for k in status):
            self.kube.patch_status(owner.namespace, owner.name, status)
            writes += 1
            for ctype, cstatus, reason, message in transitions(old_status.get("conditions", []),
                                                               status["conditions"]):
                warn = (ctype == "Degraded" and cstatus == "True") or (
                    ctype in ("PlanReady", "Available") and cstatus == "False"
                    and reason not in ("DeploymentPending", "PodsNotReady"))
                self.kube.post_event(obj, "Warning" if warn else "Normal", reason,
                                     f"{ctype}={cstatus}: {message}" if message else
                                     f"{ctype}={cstatus}")
        if outcome == "retry":
            requeue = 5.0
        return Result(outcome, requeue, writes)
