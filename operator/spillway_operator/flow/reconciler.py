"""One idempotent reconcile for create, update, resume and drift.

parse spec -> resolve config.json -> plan -> render children -> apply what differs
-> compute status -> write it if it changed -> Events for news (transitions).

Errors are sorted into temporary ones (retried with back-off by the controller
loop, reported in status) and permanent ones (a condition and an Event that say
what to change; no retry until the spec changes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from spillway_engine.planner.model_config import (
    ModelConfigSourceError,
    ModelConfigUnreachable,
    load_hub,
    parse_config_text,
)
from spillway_engine.planner.plan import Plan, PlanRefused, make_plan
from spillway_operator.flow import render, rollout, routing
from spillway_operator.flow.hub_fetch import FetchPending, FetchTimedOut, HubFetches
from spillway_operator.flow.placement import placement_refusal
from spillway_operator.flow.pools import (
    POOL_LABEL,
    PoolView,
    mixed_products,
    node_selector_string,
    pool_views,
    unknown_product_refusal,
)
from spillway_operator.flow.routing import EndpointPicker
from spillway_operator.flow.spec import (
    DiskVolume,
    DraftModelSpec,
    InferenceDeploymentSpec,
    ModelSpec,
)
from spillway_operator.flow.status import (
    Observed,
    build_status,
    combined_workload,
    group_restarts,
    merge_patch,
    plan_summary,
    read_status,
    to_wire,
    transitions,
    with_group_status,
)
from spillway_operator.flow.status_model import Condition, ConditionType, PoolStatus, Routing
from spillway_operator.names import LWS_API, LWS_KIND
from spillway_operator.plumbing import metrics
from spillway_operator.plumbing.cache import Memo
from spillway_operator.plumbing.kube import (
    Kube,
    NamespaceTerminating,
    Rejected,
    TemporaryError,
)

log = logging.getLogger("spillway.reconciler")

#: Top-level status fields the autoscaler writes; the reconciler leaves them alone.
AUTOSCALER_FIELDS = frozenset({"autoscaling", "diskTier"})


@dataclass(frozen=True)
class Result:
    outcome: str  # ok, refused, retry
    requeue_after: float | None = None
    writes: int = 0
    #: the object after this reconcile's status write (None: no write)
    written: dict[str, Any] | None = None
    #: the children were applied, the status write was left for a later reconcile
    deferred: bool = False


class ConfigUnavailable(TemporaryError):
    """config.json cannot be read yet (missing ConfigMap/Secret, hub unreachable)."""


class DiskVolumeUnavailable(TemporaryError):
    """The disk tier's claim or StorageClass is not there (yet)."""


class DiskVolumeInvalid(Exception):
    """The disk tier's shared claim cannot hold it: the user must change something."""


class ConfigInvalid(Exception):
    """config.json was read but is not usable, or the hub answered that it has none
    to give (not found, gated, refused): the user must change something."""


class ConfigResolver:
    """config.json from the spec's ConfigMap, or from the hub (cached per revision).

    A text already parsed gives the same dict again (never mutated by its users), so
    the planner's results can be kept by the config's identity (``Reconciler._plan``)."""

    def __init__(self, kube: Kube, hub_endpoint: str | None = None,
                 hub_cache_dir: str | None = None, fetches: HubFetches | None = None):
        """``hub_endpoint``, ``hub_cache_dir``: another hub and cache than
        huggingface_hub's defaults (HF_ENDPOINT, HF_HOME); ``fetches``: the threads hub
        fetches run in, off the reconcile path (flow.hub_fetch)."""
        self.kube = kube
        self._hub = {"endpoint": hub_endpoint, "cache_dir": hub_cache_dir}
        self.fetches = fetches or HubFetches()
        self._hub_cache: dict[tuple[str, str | None], dict[str, Any]] = {}
        # The hub's refusals (not found, gated, no config.json, hostile content) by what
        # was asked: the model, its revision, the reader's spec (uid, generation) and the
        # token Secret's resourceVersion. A resync asks nothing new of the hub: before, every
        # one fetched again (9-10 requests per object in 150 s).
        self._hub_refusals = Memo(4096)
        self._parsed = Memo()

    def resolve(self, namespace: str, spec: InferenceDeploymentSpec,
                reader: str | None = None, version: Any = None) -> dict[str, Any]:
        """``reader``: the InferenceDeployment's name, queued again when its ConfigMap
        changes; ``version``: its spec's (uid, generation), which a remembered hub
        refusal is for."""
        return self._resolve(namespace, spec.model, spec, reader, version)

    def resolve_draft(
        self, namespace: str, spec: InferenceDeploymentSpec, reader: str | None = None,
        version: Any = None,
    ) -> dict[str, Any] | None:
        """The separate drafter's config.json (engine.speculative.model), or None."""
        speculative = spec.engine.speculative
        if speculative is None or speculative.model is None:
            return None
        return self._resolve(namespace, speculative.model, spec, reader, version)

    def _resolve(
        self, namespace: str, model: ModelSpec | DraftModelSpec, spec: InferenceDeploymentSpec,
        reader: str | None = None, version: Any = None,
    ) -> dict[str, Any]:
        ref = model.config_map_ref
        if ref:
            text = self.kube.read_configmap_key(namespace, ref.name, ref.key,
                                                None if reader is None else (namespace, reader))
            if text is None:
                raise ConfigUnavailable(
                    f"ConfigMap {namespace}/{ref.name} with key {ref.key!r} not found"
                )
            if (parsed := self._parsed.get(text)) is not None:
                return parsed
            try:
                parsed = parse_config_text(text, f"ConfigMap {ref.name} key {ref.key}")
            except ModelConfigSourceError as exc:
                raise ConfigInvalid(str(exc)) from None
            self._parsed.put(text, parsed)
            return parsed
        key = (model.name, model.revision)
        if key in self._hub_cache:
            return self._hub_cache[key]
        token, token_version = None, None
        if spec.model.token_secret_ref:
            s = spec.model.token_secret_ref
            token, token_version = self.kube.read_secret_key_version(namespace, s.name, s.key)
            if token is None:
                raise ConfigUnavailable(f"Secret {namespace}/{s.name} key {s.key!r} not found")
        asked = (namespace, reader, version, *key, token_version)
        if (refused := self._hub_refusals.get(asked)) is not None:
            raise ConfigInvalid(refused)
        try:
            self._hub_cache[key] = self.fetches.get(
                asked, lambda: load_hub(model.name, revision=model.revision, token=token,
                                        **self._hub),
                f"config.json of {model.name}", None if reader is None else (namespace, reader))
        except (FetchPending, FetchTimedOut) as exc:  # retried, and queued when it ends
            raise ConfigUnavailable(str(exc)) from None
        except ModelConfigUnreachable as exc:  # the transport: ask again later
            raise ConfigUnavailable(str(exc)) from None
        except ModelConfigSourceError as exc:  # the hub's answer, or its content
            self._hub_refusals.put(asked, str(exc))
            raise ConfigInvalid(str(exc)) from None
        return self._hub_cache[key]


class LeaderWorkerSetUnavailable(Exception):
    """The replica spans nodes and LeaderWorkerSet's API is not installed: asked again
    until it is (installing LWS needs no change to the spec)."""


class UnknownGpuProduct(Exception):
    """A GPU product the catalogue does not know: no plan, no pods, until the spec
    names a known one."""


class PlanCrashed(Exception):
    """The planner failed in a way it does not foresee (a bug a hostile config.json
    reached): refused like an invalid config, once, instead of retried for ever."""


# Planning failures: the PlanReady reason, and the outcome (retry or refused).
_PLAN_FAILURES = (ValidationError, ConfigUnavailable, ConfigInvalid, PlanRefused, PlanCrashed,
                  DiskVolumeUnavailable, DiskVolumeInvalid, LeaderWorkerSetUnavailable,
                  UnknownGpuProduct)
#: How long a listing of a pool's nodes is reused (nodes come and go in minutes).
NODES_SECONDS = 30.0
MAX_MESSAGE = 600


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."


def make_plan_safely(
    config: dict[str, Any],
    spec: InferenceDeploymentSpec,
    draft_config: dict[str, Any] | None = None,
    view: PoolView | None = None,
) -> Plan:
    """make_plan, with any exception it does not foresee turned into PlanCrashed.
    ``view``: the GPU pool planned (default: the spec as it is)."""
    view = view or PoolView(None, spec, spec.disk_writers)
    if refusal := unknown_product_refusal(view.spec, view.name):
        raise UnknownGpuProduct(refusal)
    if refusal := placement_refusal(view.spec):
        raise PlanRefused(refusal)
    try:
        return make_plan(config, view.plan_request(), draft_config)
    except PlanRefused:
        raise
    except Exception as exc:  # the reconciler logs its traceback once per object
        raise PlanCrashed(_short(f"config.json could not be planned: "
                                 f"{type(exc).__name__}: {exc}")) from exc


def plan_failure(exc: Exception) -> tuple[str, str, str]:
    """(reason, message, outcome) for an exception in _PLAN_FAILURES."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return "SpecInvalid", f"spec.{where}: {first['msg']}", "refused"
    if isinstance(exc, ConfigUnavailable):
        return "ModelConfigUnavailable", str(exc), "retry"
    if isinstance(exc, DiskVolumeUnavailable):
        return "DiskVolumeUnavailable", str(exc), "retry"
    if isinstance(exc, LeaderWorkerSetUnavailable):
        return "LeaderWorkerSetUnavailable", str(exc), "retry"
    if isinstance(exc, DiskVolumeInvalid):
        return "DiskVolumeInvalid", str(exc), "refused"
    if isinstance(exc, UnknownGpuProduct):
        return "UnknownGpuProduct", str(exc), "refused"
    if isinstance(exc, ConfigInvalid | PlanCrashed):
        return "ModelConfigInvalid", _short(str(exc)), "refused"
    return "OffloadPlanInvalid", _short(str(exc)), "refused"


def event_type(condition: Condition) -> str:
    """Warning for a condition that needs someone's attention, Normal otherwise."""
    bad = (condition.type in (ConditionType.DEGRADED, ConditionType.MIXED_GPU_PRODUCTS)
           and condition.status == "True") or (
        condition.type in (ConditionType.PLAN_READY, ConditionType.AVAILABLE)
        and condition.status == "False"
        and condition.reason not in ("DeploymentPending", "PodsNotReady", "ScaledToZero")) or (
        condition.type == ConditionType.PROGRESSING and condition.status == "False"
        and condition.reason in (rollout.INSUFFICIENT_GPU_FOR_SURGE,
                                 rollout.INSUFFICIENT_GPU_FOR_ROLLOUT))
    return "Warning" if bad else "Normal"


def newsworthy(old: list[Condition], new: list[Condition]) -> Iterator[tuple[Condition, str]]:
    """The condition changes worth an Event, with the Event's type: every transition,
    but of a condition's first appearance only the plan's (what Spillway computed for
    the object) and any Warning. A new object's Degraded=False or
    Available=False/DeploymentPending is where it starts, not news: such were three of
    a new object's four Events, and a thousand new objects posted four thousand."""
    seen = {c.type for c in old}
    for c in transitions(old, new):
        kind = event_type(c)
        if c.type in seen or kind == "Warning" or c.type == ConditionType.PLAN_READY:
            yield c, kind


class Reconciler:
    def __init__(self, kube: Kube, endpoint_picker: EndpointPicker | None = None,
                 discovery_seconds: float = 30):
        """``endpoint_picker``: the Service each InferencePool names (None: no pools);
        ``discovery_seconds``: how old an answer on whether InferencePools are served
        may be."""
        self.kube = kube
        self.endpoint_picker = endpoint_picker
        self.discovery_seconds = discovery_seconds
        self.configs = ConfigResolver(kube)
        self._crashes: set[tuple[str, str, str]] = set()  # (namespace, name, message)
        # A reconcile's pure steps, kept by their inputs: the spec by (uid, generation)
        # (the API server bumps the generation on every spec change), the plan by the
        # identity of its configs and its request. When a thousand objects arrive at
        # once, validating, planning and the plan's JSON were a fifth of the work.
        self._specs = Memo(4096)
        self._plans = Memo()
        # Multi-node replicas: each group as last seen whole and ready, to tell a group
        # LWS recreates after a pod failed (status.group_restarts) from one starting.
        self._groups: dict[tuple[str, str], dict[str, Any]] = {}
        # GPU pools' nodes by label selector: (when listed, the nodes or None)
        self._node_lists = Memo(256)
        self._nodes_denied = False

    def _spec(self, meta: dict[str, Any], raw: dict[str, Any]) -> InferenceDeploymentSpec:
        key = (meta.get("uid"), meta.get("generation"))
        if key[1] is None:  # no generation to key it by
            return InferenceDeploymentSpec.model_validate(raw)
        if (spec := self._specs.get(key)) is None:
            spec = InferenceDeploymentSpec.model_validate(raw)
            self._specs.put(key, spec)
        return spec

    def _plan(self, config: dict[str, Any], view: PoolView,
              draft: dict[str, Any] | None) -> Plan:
        """make_plan_safely for one workload, kept by its inputs. The entry holds the
        configs too, so no other dict can take their ids while it lives."""
        if refusal := unknown_product_refusal(view.spec, view.name):
            raise UnknownGpuProduct(refusal)
        key = (id(config), id(draft), view.plan_request())
        if (hit := self._plans.get(key)) is not None:
            return hit[2]
        try:
            plan = make_plan_safely(config, view.spec, draft, view)
        except PlanRefused as exc:
            if view.name is None:
                raise
            raise PlanRefused(f"gpuPools[{view.name}] ({view.spec.resources.gpu_product}): "
                              f"{exc}") from exc
        self._plans.put(key, (config, draft, plan))
        return plan

    def _mixed_products(self, views: list[PoolView]) -> list[str] | None:
        """Each pool whose nodeSelector matches nodes of other GPU products, said once;
        None when no pool has a nodeSelector or nodes cannot be listed (no RBAC)."""
        checked, messages = False, []
        for view in views:
            selector = view.spec.resources.node_selector
            if not selector or (view.spec.engine.emulate_gpu is not None and not (
                    view.spec.engine.emulate_gpu.request_gpus)):
                continue
            nodes = self._nodes(node_selector_string(selector))
            if nodes is None:
                return None
            checked = True
            if message := mixed_products(view, nodes):
                messages.append(message)
        return messages if checked else None

    def _nodes(self, selector: str) -> list[dict[str, Any]] | None:
        """The nodes a selector matches, listed at most every NODES_SECONDS; None when
        the operator may not list nodes (rbac.clusterScopedReads false)."""
        now = time.monotonic()
        hit = self._node_lists.get(selector)
        if hit is not None and now - hit[0] < NODES_SECONDS:
            return hit[1]
        try:
            nodes = self.kube.list_nodes(selector)
        except ApiException as exc:
            if exc.status != 403:
                raise TemporaryError(f"listing nodes: HTTP {exc.status}", exc.status) from None
            if not self._nodes_denied:
                log.info("may not list nodes (rbac.clusterScopedReads false): GPU pools' "
                         "nodes are not checked for mixed GPU products")
            self._nodes_denied = True
            nodes = None
        self._node_lists.put(selector, (now, nodes))
        return nodes

    def _check_disk_volume(self, namespace: str, spec: InferenceDeploymentSpec) -> None:
        """The disk tier's volume exists and can hold it, before any pod waits on it.
        Without the RBAC to read it (a StorageClass needs rbac.clusterScopedReads), the
        pods' own scheduling says so instead."""
        disk = spec.offload.disk
        if disk is None or disk.volume == DiskVolume.EMPTY_DIR:
            return
        try:
            if disk.volume == DiskVolume.SHARED_PVC:
                claim = self.kube.get_claim(namespace, disk.claim_name)
                if claim is None:
                    raise DiskVolumeUnavailable(
                        f"offload.disk.claimName: PersistentVolumeClaim {disk.claim_name} "
                        f"not found in {namespace}")
                if why := render.disk_claim_refusal(spec, claim):
                    raise DiskVolumeInvalid(why)
            elif disk.storage_class_name and self.kube.get_storage_class(
                    disk.storage_class_name) is None:
                raise DiskVolumeUnavailable(
                    f"offload.disk.storageClassName: StorageClass {disk.storage_class_name} "
                    "not found")
        except ApiException as exc:
            if exc.status != 403:
                raise TemporaryError(f"reading the disk tier's volume: HTTP {exc.status}",
                                     exc.status) from None

    def _log_crash(self, owner: render.Owner, exc: PlanCrashed) -> None:
        """A planner crash is a bug: its traceback, once per object and message."""
        seen = (owner.namespace, owner.name, str(exc))
        if seen not in self._crashes:
            self._crashes.add(seen)
            log.error("%s/%s: the planner crashed on its config.json (a bug; refused as "
                      "ModelConfigInvalid)", owner.namespace, owner.name,
                      exc_info=exc.__cause__)

    def reconcile(self, obj: dict[str, Any], defer_status: bool = False) -> Result:
        """``defer_status``: other new objects wait for their children, so apply this
        one's and leave its status (and Events) to a later reconcile (``deferred``)."""
        started = time.perf_counter()
        namespace = obj["metadata"]["namespace"]
        try:
            if self.kube.namespace_terminating(namespace):
                # It goes with its namespace; writes would be refused. Looked at again
                # once that is forgotten: a namespace of this name may be new by then.
                result = Result("ok", self.kube.TERMINATING_MEMORY)
            else:
                result = self._reconcile(obj, defer_status)
        except NamespaceTerminating:
            # Its children went first (the namespace's deletion takes everything in it):
            # re-creating them, or a status and Event saying they are gone, would fight
            # the deletion the user asked for.
            log.info("%s/%s: its namespace is being deleted; leaving it alone", namespace,
                     obj["metadata"]["name"])
            result = Result("ok", self.kube.TERMINATING_MEMORY)
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        metrics.RECONCILES.labels(outcome=result.outcome).inc()
        return result

    def _reconcile(self, obj: dict[str, Any], defer_status: bool = False) -> Result:
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            self._groups.pop((meta["namespace"], meta["name"]), None)
            return Result("ok")  # owner references let the garbage collector clean up
        owner = render.Owner(meta["name"], meta["namespace"], meta["uid"])
        obs = Observed(generation=meta.get("generation", 0), desired_replicas=0,
                       selector=render.selector_string(owner))
        writes = 0
        try:
            spec = self._spec(meta, obj.get("spec") or {})
            obs.desired_replicas = spec.replicas
            version = (meta.get("uid"), meta.get("generation"))
            config = self.configs.resolve(owner.namespace, spec, owner.name, version)
            draft = self.configs.resolve_draft(owner.namespace, spec, owner.name, version)
            views = pool_views(spec)
            obs.desired_replicas = sum(v.spec.replicas for v in views)
            planned = [(view, self._plan(config, view, draft)) for view in views]
            self._check_disk_volume(owner.namespace, spec)
            if spec.nodes > 1 and not self.kube.leader_worker_sets_served():
                raise LeaderWorkerSetUnavailable(
                    f"spec.engine.nodes: a replica on {spec.nodes} nodes runs as a "
                    "LeaderWorkerSet group, and the cluster does not serve "
                    "leaderworkerset.x-k8s.io/v1: install LWS (sigs.k8s.io/lws); no pods "
                    "are made until then")
        except _PLAN_FAILURES as exc:
            reason, message, outcome = plan_failure(exc)
            obs.plan_error = (reason, message)
            if isinstance(exc, PlanCrashed):
                self._log_crash(owner, exc)
        else:
            outcome = "ok"
            # Never reconciled (no status yet): no children to read before applying.
            first = not (obj.get("status") or {}).get("observedGeneration")
            try:
                writes += self._apply(owner, spec, planned, obs, first,
                                      obj.get("status") or {})
            except NamespaceTerminating:
                raise  # not this body's fault: see reconcile()
            except Rejected as exc:
                # A body the API server refuses is refused again on retry: say so
                # in status and an Event; the next spec change tries again.
                obs.apply_error = ("ApplyRejected", _short(str(exc)))
                outcome = "refused"
            else:
                if defer_status and obs.recheck_after is None:
                    return Result(outcome, writes=writes, deferred=True)
        written = self._write_status(obj, owner, obs)
        # A surge pod waiting for a GPU: come back when it reaches its time limit
        # (nothing else may change meanwhile).
        requeue = 5.0 if outcome == "retry" else obs.recheck_after
        return Result(outcome, requeue, writes + (written is not None), written or None)

    def _children(self, owner: render.Owner, spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
        """The children every pool shares; the Service and the PDB matter once pods are
        ready, so they come after the pools' plans and workloads."""
        children = [render.service(owner, spec), render.pod_disruption_budget(owner, spec)]
        if self.kube.service_monitors_served():
            children.append(render.service_monitor(owner))
        return children

    def _pods(self, owner: render.Owner, workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every pool's pods (the object's labels select them all)."""
        if not workloads:
            return []
        if len(workloads) == 1 and workloads[0].get("kind") != LWS_KIND:
            return self.kube.owned_pods((owner.namespace, owner.name),
                                        render.selector_string(owner), workloads[0])
        # The watch's pods stand when they number the pods the workloads ask for.
        pods = 0
        for w in workloads:
            spec = w.get("spec") or {}
            pods += (int(spec.get("replicas") or 0) * int(
                spec["leaderWorkerTemplate"].get("size") or 1) if w.get("kind") == LWS_KIND
                else int((w.get("status") or {}).get("replicas") or 0))
        return self.kube.owned_pods((owner.namespace, owner.name),
                                    render.selector_string(owner), {"status": {"replicas": pods}})

    def _live_workload(self, owner: render.Owner, groups: bool) -> dict[str, Any] | None:
        name = render.workload_name(owner)
        if groups:
            return self.kube.get_leader_worker_set(owner.namespace, name)
        return self.kube.get_deployment(owner.namespace, name)

    def _apply(self, owner: render.Owner, spec: InferenceDeploymentSpec,
               planned: list[tuple[PoolView, Plan]], obs: Observed, first: bool,
               old_status: dict[str, Any]) -> int:
        """Apply the children that differ, each pool's then the shared ones; returns
        the writes made."""
        old_nodes = int((old_status.get("plan") or {}).get("nodes") or 1)
        pooled = planned[0][0].name is not None
        owners = [render.Owner(owner.name, owner.namespace, owner.uid, view.name)
                  for view, _ in planned]
        groups = spec.nodes > 1
        lives = [] if first else [self._live_workload(o, groups) for o in owners]
        obs.pods = self._pods(owner, [w for w in lives if w is not None])
        writes, workloads, obs.pools = 0, [], []
        for (view, plan), pool_owner, live in zip(planned, owners, lives or [None] * len(owners),
                                                  strict=True):
            wrote, workload = self._apply_pool(pool_owner, view, plan, live, obs, first)
            writes += wrote
            workloads.append(workload)
            if pooled:
                obs.pools.append(PoolStatus(
                    name=view.name, gpu_product=view.spec.resources.gpu_product,
                    workload=render.workload_name(pool_owner), replicas=view.spec.replicas,
                    plan=plan_summary(plan, view.spec.gpus_per_pod, render.plan_hash(plan))))
            if not first:
                writes += self._drop_other_workload(pool_owner, groups, old_nodes)
        obs.plan_summary = (obs.pools[0].plan if pooled else plan_summary(
            planned[0][1], spec.gpus_per_pod, render.plan_hash(planned[0][1])))
        obs.workloads = [(view.name, w) for (view, _), w in zip(planned, workloads, strict=True)]
        obs.mixed_products = self._mixed_products([view for view, _ in planned])
        for child in self._children(owner, spec):
            writes += self._ensure(owner, child, first)[0]
        if not first:
            writes += self._drop_left_pools(owner, planned, old_status, groups)
        return writes + self._route(owner, spec, obs, first)

    def _apply_pool(self, owner: render.Owner, view: PoolView, plan: Plan,
                    live: dict[str, Any] | None, obs: Observed,
                    first: bool) -> tuple[int, dict[str, Any]]:
        """One workload's plan and workload: (writes made, the live workload)."""
        spec = view.spec
        pods = [p for p in obs.pods
                if (p["metadata"].get("labels") or {}).get(POOL_LABEL) == view.name]
        # A Deployment's update strategy follows the live rollout (a surge pod with no
        # GPU); LWS rolls whole groups one at a time by itself.
        decision = (rollout.Decision({}) if spec.nodes > 1
                    else rollout.decide(spec, live, pods, time.time()))
        if decision.stuck and obs.rollout_stuck is None:
            obs.rollout_stuck = decision.stuck
        obs.rollout_in_place = obs.rollout_in_place or decision.in_place
        if decision.recheck_after is not None:
            again = decision.recheck_after + 1.0
            obs.recheck_after = min(again, obs.recheck_after or again)
        # In the order the pods need them: they mount the plan, the workload starts
        # them (image pulls and model loads take minutes).
        writes = self._ensure(owner, render.plan_configmap(owner, spec, plan), first)[0]
        wrote, workload = self._ensure(
            owner, render.engine_workload(owner, spec, plan, decision.strategy), first)
        return writes + wrote, workload

    def _drop_other_workload(self, owner: render.Owner, groups: bool, old_nodes: int) -> int:
        """Scale to 0 the workload of the other kind, left by a spec whose replicas
        spanned another number of nodes (the status says how many the last plan had)."""
        ns, name = owner.namespace, render.workload_name(owner)
        if groups:
            kind = ("apps/v1", "Deployment")
            live = self.kube.watched_deployment(ns, name)
        elif old_nodes > 1:
            kind = (LWS_API, LWS_KIND)
            live = self.kube.get_leader_worker_set(ns, name)
        else:
            return 0
        if not self.kube.scale_to_zero(*kind, ns, name, live):
            return 0
        log.info("scaled %s/%s %s to 0: replicas now span %s", ns, name, kind[1],
                 "several nodes" if groups else "one node")
        return 1

    def _drop_left_pools(self, owner: render.Owner, planned: list[tuple[PoolView, Plan]],
                         old_status: dict[str, Any], groups: bool) -> int:
        """Scale to 0 the workloads of GPU pools the spec no longer has (the object's
        own when it gained pools); they go with the object."""
        now = {render.workload_name(render.Owner(owner.name, owner.namespace, owner.uid,
                                                 view.name)) for view, _ in planned}
        before = [p.get("workload") for p in old_status.get("pools") or []] or (
            [owner.name] if old_status.get("plan") else [])
        writes = 0
        for name in before:
            if not name or name in now:
                continue
            kind = (LWS_API, LWS_KIND) if groups else ("apps/v1", "Deployment")
            live = (self.kube.get_leader_worker_set(owner.namespace, name) if groups
                    else self.kube.watched_deployment(owner.namespace, name))
            if self.kube.scale_to_zero(*kind, owner.namespace, name, live):
                log.info("scaled %s/%s %s to 0: its GPU pool left the spec", owner.namespace,
                         name, kind[1])
                writes += 1
        return writes

    def _ensure(self, owner: render.Owner, child: dict[str, Any],
                first: bool) -> tuple[int, dict[str, Any]]:
        """Apply one child if it differs: (writes made, the live object)."""
        action, live = self.kube.ensure(child, surely_absent=first)
        if action == "unchanged":
            return 0, live
        metrics.CHILD_WRITES.labels(kind=child["kind"], action=action).inc()
        log.info("%s %s/%s %s", action, owner.namespace, child["metadata"]["name"],
                 child["kind"])
        return 1, live

    def _route(self, owner: render.Owner, spec: InferenceDeploymentSpec, obs: Observed,
               first: bool) -> int:
        """The InferencePool, when routing.decide wants one; obs.routing says what routes
        to the pods. Returns the writes made."""
        picker = self.endpoint_picker
        served = picker is not None and self.kube.inference_pools_served(self.discovery_seconds)
        if picker is None or routing.decide(picker, owner.namespace, served) is not (
                Routing.INFERENCE_POOL):
            obs.routing = Routing.SPILLWAY_ROUTER
            return 0
        pool = render.inference_pool(owner, spec, picker)
        try:
            writes = self._ensure(owner, pool, first)[0]
            obs.routing = Routing.INFERENCE_POOL
            return writes
        except ApiException as exc:  # what kube.request leaves unsorted for this object
            if exc.status == 404:  # GIE's CRD went since discovery said it was there
                self.kube.inference_pools_gone()
                obs.routing = Routing.SPILLWAY_ROUTER
                return 0
            # A 403 on the read: the operator's role lacks inferencepools (an older
            # chart). Reported like a refused write, never a crash loop.
            raise Rejected(f"InferencePool {owner.namespace}/{pool['metadata']['name']}: "
                           f"HTTP {exc.status} {exc.reason}", exc.status) from None

    def recheck_routing(self) -> int:
        """Ask the API server now whether InferencePools are served (the controller's
        periodic check, so a CRD installed or removed later is noticed); returns how
        many times that API came or went so far."""
        if self.endpoint_picker is not None:
            self.kube.inference_pools_served(max_age=0)
        return self.kube.api_changes

    def _running_workloads(self, owner: render.Owner, status: dict[str, Any]
                           ) -> list[tuple[str | None, dict[str, Any] | None]]:
        """The workloads the last plan made, as the status names them."""
        groups = int((status.get("plan") or {}).get("nodes") or 1) > 1 and (
            self.kube.leader_worker_sets_served())
        pools = [(p.get("name"), p.get("workload")) for p in status.get("pools") or []]
        out = []
        for pool, name in pools or [(None, owner.name)]:
            pool_owner = render.Owner(owner.name, owner.namespace, owner.uid, pool)
            if name == render.workload_name(pool_owner):
                out.append((pool, self._live_workload(pool_owner, groups)))
        return out

    def _counted(self, owner: render.Owner, pool: str | None, workload: dict[str, Any],
                 obs: Observed) -> dict[str, Any]:
        """A LeaderWorkerSet's groups counted from their pods, whose events wake this
        reconcile (no watch tells it when LWS's own status catches up)."""
        if workload.get("kind") != LWS_KIND:
            return workload
        pods = [p for p in obs.pods
                if (p["metadata"].get("labels") or {}).get(POOL_LABEL) == pool]
        workload = with_group_status(workload, pods)
        if pool is None:  # restarts are followed for an object without pools
            size = int(workload["spec"]["leaderWorkerTemplate"].get("size") or 1)
            key = (owner.namespace, owner.name)
            obs.restarting_groups, self._groups[key] = group_restarts(
                pods, size, self._groups.get(key, {}))
        return workload

    def _write_status(self, obj: dict[str, Any], owner: render.Owner,
                      obs: Observed) -> dict[str, Any] | None:
        """Write the status if it changed, with an Event per condition transition;
        returns the object written ({} when the answer had none), None if no write."""
        if obs.workloads is None:  # not applied this time (no plan): what is running?
            obs.workloads = self._running_workloads(owner, obj.get("status") or {})
        present = [w for _, w in obs.workloads if w is not None]
        obs.pods = self._pods(owner, present)
        obs.workloads = [(pool, None if w is None else self._counted(owner, pool, w, obs))
                         for pool, w in obs.workloads]
        obs.deployment = combined_workload([w for _, w in obs.workloads if w is not None])
        live_pools = dict(obs.workloads)
        obs.pools = None if obs.pools is None else [pool.model_copy(update={
            "ready_replicas": int(((live_pools.get(pool.name) or {}).get("status") or {}).get(
                "readyReplicas") or 0)}) for pool in obs.pools]
        live = obj.get("status") or {}
        old = read_status(live)
        # The raw spec: autoscaling may be on even when the spec does not validate.
        autoscaling = bool((obj.get("spec") or {}).get("autoscaling", {}).get("enabled"))
        status = build_status(obs, old, autoscaling_enabled=autoscaling)
        # status.autoscaling and status.diskTier are the autoscaler's: left as they are.
        patch = merge_patch(live, to_wire(status), keep=AUTOSCALER_FIELDS)
        if not patch:
            return None
        log.debug("%s/%s: status patch of %s", owner.namespace, owner.name, ", ".join(patch))
        try:
            written = self.kube.patch_status(owner.namespace, owner.name, patch) or {}
        except ApiException as exc:
            if exc.status == 404:  # deleted while we reconciled: nothing left to report
                return None
            raise
        for c, kind in newsworthy(old.conditions, status.conditions):
            self.kube.post_event(obj, kind, c.reason,
                                 f"{c.type}={c.status}: {c.message}" if c.message else
                                 f"{c.type}={c.status}")
            if kind == "Warning":  # one line per transition, never per retry
                log.warning("%s/%s: %s=%s %s: %s", owner.namespace, owner.name, c.type,
                            c.status, c.reason, c.message)
        return written
