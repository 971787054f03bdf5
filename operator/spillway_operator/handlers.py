"""kopf wiring: thin handlers that feed the controller's queue.

kopf watches InferenceDeployments and ConfigMaps (the plan ConfigMaps Spillway
manages, and the model ConfigMaps specs name: a changed config.json re-plans). The
Deployments, Services, PodDisruptionBudgets and pods Spillway manages come from its
own watches (``watch.Reflector``: the API server filters them by label, and no kopf
bookkeeping per event). Every change of a child re-reconciles its owner, so drift is
repaired and status follows the pods; each body is kept in the watch cache first, so
the reconcile reads none of them again.

What the process holds while it runs (the controller, the watch cache, the watches,
the leader election) is one :class:`Running` record, made by ``startup`` and taken
apart by ``cleanup``; it lives in kopf's operator memo, which kopf hands to every
handler (each object's memo is a shallow copy of it, taken after startup), so the
module keeps no state of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes import client, config

from spillway_operator.controller import Controller
from spillway_operator.flow.reconciler import Reconciler
from spillway_operator.flow.render import FIELD_MANAGER
from spillway_operator.flow.routing import EndpointPicker
from spillway_operator.flow.scaler import Autoscaler
from spillway_operator.flow.spec import GROUP, KIND, PLURAL, VERSION
from spillway_operator.plumbing import metrics, watch
from spillway_operator.plumbing.cache import WatchCache
from spillway_operator.plumbing.kube import Kube
from spillway_operator.plumbing.leader import Election, LeaderElector, LeaseClient

OWNER_LABEL = f"{GROUP}/inference-deployment"
MANAGED_BY = "app.kubernetes.io/managed-by"
# What the own watches ask the API server for: managed by Spillway, with an owner.
MANAGED_SELECTOR = f"{MANAGED_BY}={FIELD_MANAGER},{OWNER_LABEL}"



@dataclass
class Running:
    """One operator process's runtime state, from ``startup`` to ``cleanup``."""

    controller: Controller
    cache: WatchCache
    watches: list[watch.Reflector] = field(default_factory=list)
    #: the Lease loop and its task, with leader election only
    elector: LeaderElector | None = None
    election: asyncio.Task[None] | None = None


def running(memo: Any) -> Running | None:
    """The process's record in kopf's memo (None before startup and after cleanup)."""
    return getattr(memo, "running", None)


def _api_client(connections: int | None = None) -> client.ApiClient:
    """``connections``: kept open at once (urllib3 closes any beyond them after each
    request, and the next one pays a new TLS handshake); the client's default is five
    per CPU."""
    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                client_configuration=cfg)
    if connections:
        cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize, connections)
    return client.ApiClient(cfg)


def _drop_retry_lines(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Retrying (")


class RetryForever:
    """kopf's API retry delays: 1, 2, 5 s, then every 10 s without end. kopf's own
    list ends, and a watch whose retries end stops the whole operator: an API server
    or etcd outage longer than the list (30 s, a control-plane upgrade) became an
    exit, and a crash loop under the kubelet. client-go's reflectors never give up
    either. Iterable afresh for every request (kopf counts no length: no last try)."""

    def __iter__(self) -> Iterator[float]:
        return itertools.chain((1, 2, 5), itertools.repeat(10))


class NoDiffBase(kopf.DiffBaseStorage):
    """No "essence" of the objects: kopf deep-copies one of every object on every event
    for its change-detecting handlers, which Spillway does not register (event handlers
    never read it). It was 13 % of the operator's CPU when 200 objects arrived at once
    (py-spy); nothing is stored on the objects either way."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def configure(settings: kopf.OperatorSettings, env: Mapping[str, str]) -> None:
    settings.posting.enabled = False  # Spillway posts its own, meaningful Events
    settings.persistence.diffbase_storage = NoDiffBase()
    # An API server outage is one warning per object from the controller; urllib3's
    # own line per connection retry would add thousands (its request lines stay).
    pool_log = logging.getLogger("urllib3.connectionpool")
    if _drop_retry_lines not in pool_log.filters:
        pool_log.addFilter(_drop_retry_lines)
    settings.watching.server_timeout = int(env.get("SPILLWAY_WATCH_TIMEOUT", "300"))
    settings.watching.client_timeout = settings.watching.server_timeout + 30
    settings.networking.error_backoffs = RetryForever()
    settings.persistence.finalizer = f"{GROUP}/operator"


def workers(env: Mapping[str, str]) -> int:
    return int(env.get("SPILLWAY_WORKERS", "8"))


def make_controller(kube: Kube, env: Mapping[str, str],
                    endpoint_picker: EndpointPicker | None = None) -> Controller:
    # How often the InferencePool API is looked for (with an endpoint picker).
    discovery = float(env.get("SPILLWAY_DISCOVERY_SECONDS", "30"))
    return Controller(
        Reconciler(kube, endpoint_picker, discovery),
        autoscaler=Autoscaler(kube),
        workers=workers(env),
        resync_seconds=float(env.get("SPILLWAY_RESYNC_SECONDS", "300")),
        discovery_seconds=discovery,
    )


def owner_key(namespace: str | None, labels: Mapping[str, str],
              owner_references: list[Mapping[str, Any]] | None = None) -> tuple[str, str] | None:
    """The InferenceDeployment a managed child belongs to: by its owner reference (a
    hand edit of its labels keeps it), else by its label (pods, owned by ReplicaSets)."""
    for ref in owner_references or ():
        if namespace and ref.get("kind") == KIND and \
                str(ref.get("apiVersion", "")).split("/")[0] == GROUP and ref.get("name"):
            return (namespace, ref["name"])
    name = labels.get(OWNER_LABEL)
    return (namespace, name) if namespace and name else None


def is_child(labels: Mapping[str, str], meta: Mapping[str, Any], **_: Any) -> bool:
    """Whether a ConfigMap is a plan ConfigMap: managed by label, or owned by an
    InferenceDeployment (someone removed the labels: the event must still reach its
    owner, whose reconcile puts them back)."""
    managed = labels.get(MANAGED_BY) == FIELD_MANAGER and OWNER_LABEL in labels
    return managed or owner_key("-", {}, meta.get("ownerReferences")) is not None


def make_elector(election: Election, controller: Controller) -> LeaderElector:
    """The Lease loop that starts and pauses ``controller``; its own API client, so
    renewals never wait for a connection the reconciles hold."""
    return LeaderElector(
        LeaseClient(Kube(_api_client()), election.namespace, election.name),
        election.identity, election.timing,
        on_started=controller.start, on_stopped=controller.pause)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    configure(settings, os.environ)
    log = logging.getLogger("spillway")
    election: Election | None = getattr(memo, "election", None)
    cache = WatchCache(OWNER_LABEL)
    # The reconcile workers, the autoscaler's and the Event thread's requests.
    kube = Kube(_api_client(workers(os.environ) + 8), cache=cache)
    picker: EndpointPicker | None = getattr(memo, "endpoint_picker", None)
    controller = make_controller(kube, os.environ, picker)
    if picker is not None:
        log.info("endpoint picker %s: an InferencePool per InferenceDeployment%s while the "
                 "cluster serves inference.networking.k8s.io/v1 InferencePools", picker,
                 f" in {picker.namespace}" if picker.namespace else "")
    kube.hold_events = lambda: controller.bursting
    # A hub fetch that outlasted its reconcile's wait queues its object when it ends.
    loop = asyncio.get_running_loop()
    controller.reconciler.configs.fetches.on_done = (
        lambda key: loop.call_soon_threadsafe(controller.enqueue, key))
    state = memo.running = Running(controller, cache)
    state.watches = start_watches(getattr(memo, "namespaces", None),
                                  asyncio.get_running_loop(),
                                  settings.watching.server_timeout or 300, kube, state)
    if election is None:
        metrics.LEADER.set(1)  # the only replica: it always writes
        controller.start()
        log.info("spillway operator started")
        return
    # The watches feed the controller's cache from now on, leader or not; reconciling,
    # autoscaling and every write wait for the Lease (Kube asks the elector's gate).
    elector = make_elector(election, controller)
    kube.may_write = elector.may_write
    state.elector = elector
    state.election = asyncio.create_task(elector.run())
    log.info("spillway operator started; candidate %s for lease %s/%s (duration %gs, "
             "renew deadline %gs, retry period %gs)", election.identity, election.namespace,
             election.name, election.timing.lease_duration, election.timing.renew_deadline,
             election.timing.retry_period)


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    state = running(memo)
    if state is None:
        return
    memo.running = None
    for reflector in state.watches:
        reflector.stop()
    if state.election:
        state.election.cancel()
    state.controller.pause()  # stop writing first, then hand the Lease over
    await state.controller.stop()
    if state.elector:
        await state.elector.release()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_inference_deployment(body: kopf.Body, type: str | None, memo: Any,
                                   **_: Any) -> None:
    state = running(memo)
    if state is None:
        return
    state.controller.observe(dict(body), type)
    if type == "DELETED":
        state.cache.forget_reader((body["metadata"]["namespace"], body["metadata"]["name"]))


def _owner_changed(controller: Controller, namespace: str | None, labels: Mapping[str, str],
                   meta: Mapping[str, Any] | None = None) -> None:
    key = owner_key(namespace, labels, (meta or {}).get("ownerReferences"))
    if key is not None and key in controller.objects:
        controller.enqueue(key)


def _child_changed(state: Running, body: Mapping[str, Any], type: str | None,
                   namespace: str | None, labels: Mapping[str, str],
                   meta: Mapping[str, Any]) -> None:
    """Keep the body, then queue its owner (in that order: the reconcile must see it)
    if the event tells it anything new."""
    if state.cache.observe(dict(body), type):
        _owner_changed(state.controller, namespace, labels, meta)


WATCHED = (watch.DEPLOYMENTS, watch.SERVICES, watch.POD_DISRUPTION_BUDGETS, watch.PODS)
#: What the operator does without the LeaderWorkerSets' watch (LWS not installed, or a
#: role from before it was granted): it reads a multi-node replica's LWS each reconcile.
LWS_UNWATCHED = "multi-node replicas' LeaderWorkerSets are read at each reconcile"


def start_watches(namespaces: list[str] | None, loop: asyncio.AbstractEventLoop,
                  timeout: int, kube: Kube, state: Running) -> list[watch.Reflector]:
    """The children's and pods' watches (``namespaces`` None: cluster-wide). They
    keep the cache on their own threads, in stream order, and queue the owner on
    ``loop``, where the controller lives. And the namespaces' watch, which tells
    ``kube`` which ones are being deleted before their contents go."""
    cache, controller = state.cache, state.controller

    def child(event_type: str, body: dict[str, Any]) -> None:
        if cache.observe(body, event_type):
            meta = body.get("metadata") or {}
            loop.call_soon_threadsafe(_owner_changed, controller, meta.get("namespace"),
                                      meta.get("labels") or {}, meta)

    def pod(event_type: str, body: dict[str, Any]) -> None:
        cache.observe_pod(body, event_type)
        meta = body.get("metadata") or {}
        loop.call_soon_threadsafe(_owner_changed, controller, meta.get("namespace"),
                                  meta.get("labels") or {})

    scopes = namespaces or [None]
    api = _api_client((len(WATCHED) + 1) * len(scopes) + 1)  # one connection each
    groups = [watch.Reflector(api, watch.LEADER_WORKER_SETS, namespace, MANAGED_SELECTOR, child,
                              timeout=timeout, optional=LWS_UNWATCHED, absent=LWS_UNWATCHED)
              for namespace in scopes]
    kube.watching_leader_worker_sets(lambda: all(r.current() for r in groups))
    return [watch.Reflector(api, kind, namespace, MANAGED_SELECTOR,
                            pod if kind is watch.PODS else child, timeout=timeout).start()
            for namespace in scopes for kind in WATCHED] + [r.start() for r in groups] + [
        watch.Reflector(api, watch.NAMESPACES, None, "", kube.observe_namespace,
                        timeout=timeout,
                        optional="a namespace being deleted is known from refused writes")
        .start()]


@kopf.on.event("", "v1", "configmaps")
async def on_configmap(body: kopf.Body, type: str | None, namespace: str | None,
                       labels: kopf.Labels, meta: kopf.Meta, memo: Any, **_: Any) -> None:
    """A plan ConfigMap (a child), or a model ConfigMap a spec names (its readers
    re-plan); any other ConfigMap is ignored."""
    state = running(memo)
    if state is None:
        return
    if is_child(labels, meta):
        _child_changed(state, body, type, namespace, labels, meta)
        return
    readers = state.cache.readers(namespace or "", meta.get("name", ""))
    if not readers or not state.cache.observe(dict(body), type):
        return
    for key in readers:
        if key in state.controller.objects:
            state.controller.enqueue(key)
