"""The operator's only door to the API server.

Server-side apply with field manager ``spillway``, but only when the live object
differs from what we would apply: a steady-state reconcile makes no writes. The live
object comes from the watches' cache (``cache.WatchCache``) when they have delivered
it, so a steady-state reconcile makes no reads either. Every request is counted by
verb (``spillway_operator_api_requests_total``) so tests and benchmarks can prove it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from spillway_engine.quantity import QuantityError, parse_bytes
from spillway_operator.names import (
    FIELD_MANAGER,
    GROUP,
    INFERENCE_POOL_API,
    INFERENCE_POOL_KIND,
    INFERENCE_POOL_PLURAL,
    KIND,
    LWS_API,
    LWS_KIND,
    LWS_PLURAL,
    PLURAL,
    VERSION,
)
from spillway_operator.plumbing import metrics
from spillway_operator.plumbing.cache import Key, WatchCache, ref_of

log = logging.getLogger("spillway.kube")

# Keys whose values are resource quantities: compared by value ("1Gi" == "1024Mi").
_QUANTITY_PARENTS = {"requests", "limits", "capacity", "allocatable"}
_QUANTITY_KEYS = {"sizeLimit"}
# Maps that server-side apply owns whole (mapType=atomic): a key someone else added
# is replaced when we apply, so it is a difference, not a field to ignore. The
# Service's selector (a hand-added key selects no pod); the Deployment's is immutable.
_ATOMIC_MAPS = {("spec", "selector")}
# Lists that server-side apply merges item by item (listType=map) and the key of each
# item: an item another manager added stays after our apply, so it is no difference
# (else every reconcile would apply again, for ever). Other lists are atomic: ours
# replace them whole, so any difference counts.
_LIST_KEYS = {"containers": ("name",), "initContainers": ("name",), "env": ("name",),
              "volumes": ("name",), "volumeMounts": ("mountPath",),
              "imagePullSecrets": ("name",),
              "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
              "ports": ("containerPort", "port", "protocol")}


def now_rfc3339() -> str:
    """Now, as the API server writes times (RFC 3339, seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _item_key(item: Any, keys: tuple[str, ...]) -> tuple | None:
    if not isinstance(item, dict):
        return None
    return tuple(str(item.get(k, "TCP" if k == "protocol" else None)) for k in keys)

SERVICE_MONITOR_API = "monitoring.coreos.com/v1"
# The REST resource (plural) of each (apiVersion, kind) the operator touches.
_PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("apps/v1", "Deployment"): "deployments",
    (LWS_API, LWS_KIND): LWS_PLURAL,
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    (SERVICE_MONITOR_API, "ServiceMonitor"): "servicemonitors",
    (INFERENCE_POOL_API, INFERENCE_POOL_KIND): INFERENCE_POOL_PLURAL,
    (f"{GROUP}/{VERSION}", KIND): PLURAL,
}


def api_path(api_version: str) -> str:
    """The REST root of an API version: the core group lives under /api."""
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


def resource_path(api_version: str, kind: str, namespace: str, name: str = "",
                  sub: str = "") -> str:
    """The REST path of a namespaced object (of its collection when name is empty)."""
    path = f"{api_path(api_version)}/namespaces/{namespace}/{_PLURALS[(api_version, kind)]}"
    for part in (name, sub):
        if part:
            path += f"/{part}"
    return path


class TemporaryError(Exception):
    """Worth retrying with back-off (API unavailable, conflict, missing input);
    ``status``: the HTTP status, when the API server answered."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class NotLeader(TemporaryError):
    """A write refused inside the operator: this replica does not hold the leader
    Lease (or its renew deadline passed). Never sent to the API server."""


class Rejected(Exception):
    """The API server refused a write for what it contains: retrying the same body
    fails the same way, so the object's status and an Event must say so."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class NamespaceTerminating(Rejected):
    """The object's namespace is being deleted: the API server creates nothing in it
    any more (children, Events, Leases), and everything in it goes soon. Neither a
    retry nor a status saying so would help anyone."""


# Server-side apply answers 500 when it cannot even build the typed object
# (duplicate list keys such as two env vars with one name): the body, not the
# server, is at fault.
_TYPED_PATCH_ERRORS = ("failed to create typed patch object", "duplicate entries for key")
_RETRYABLE_STATUS = (408, 409, 429, 500, 502, 503, 504)


def _api_message(body: bytes | None) -> str:
    """The Status message of an error answer, else its text (one line, capped)."""
    text = body.decode("utf-8", "replace") if body else ""
    try:
        message = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    return " ".join(str(message).split())[:800]


def _namespace_terminating(body: bytes | None) -> bool:
    """Whether a 403 is the namespace lifecycle admission's refusal to create anything
    in a namespace being deleted: a Status cause NamespaceTerminating (a StatusCause's
    type is serialized as "reason")."""
    try:
        causes = (json.loads(body or b"{}").get("details") or {}).get("causes") or []
    except (ValueError, AttributeError):
        return False
    return any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating" for c in causes)


def _namespace_of(path: str) -> str | None:
    """The namespace of a namespaced REST path, else None."""
    if "/namespaces/" not in path:
        return None
    rest = path.split("/namespaces/", 1)[1]
    return rest.split("/", 1)[0].split("?", 1)[0] or None


def duplicate_list_keys(obj: Any) -> bool:
    """Whether a list that server-side apply keys by item (``_LIST_KEYS``) holds two
    items with one key, e.g. two env vars named alike. A POST accepts that body, but
    no apply of the object could ever succeed again (the API server answers 500), so
    such a child is applied from the start and refused as a whole."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, list) and key in _LIST_KEYS:
                keys = [k for k in (_item_key(i, _LIST_KEYS[key]) for i in value) if k]
                if len(keys) != len(set(keys)):
                    return True
            if isinstance(value, (dict, list)) and duplicate_list_keys(value):
                return True
    elif isinstance(obj, list):
        return any(duplicate_list_keys(item) for item in obj)
    return False


def _quantity_equal(a: Any, b: Any) -> bool:
    try:
        return parse_bytes(str(a)) == parse_bytes(str(b))
    except QuantityError:
        return _cpu(a) is not None and _cpu(a) == _cpu(b)


def _cpu(v: Any) -> float | None:
    s = str(v)
    try:
        return float(s[:-1]) / 1000 if s.endswith("m") else float(s)
    except ValueError:
        return None


def contains(live: Any, desired: Any, path: tuple[str, ...] = ()) -> bool:
    """True when every field of ``desired`` is present in ``live`` with the same value.

    Fields the server defaults or other managers add are ignored; merged lists
    (``_LIST_KEYS``) must hold each of our items by key; atomic lists must match item
    by item (order and length), as we send them.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict) or (path in _ATOMIC_MAPS and live.keys() != desired.keys()):
            return False
        return all(k in live and contains(live[k], v, (*path, k)) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list):
            return False
        keys = _LIST_KEYS.get(path[-1]) if path else None
        if keys and all(isinstance(d, dict) for d in desired):
            by_key = {_item_key(lv, keys): lv for lv in live}
            return all((lv := by_key.get(_item_key(dv, keys))) is not None
                       and contains(lv, dv, path) for dv in desired)
        if len(live) != len(desired):
            return False
        return all(contains(lv, dv, path) for lv, dv in zip(live, desired, strict=True))
    if live == desired:
        return True
    if path and (path[-1] in _QUANTITY_KEYS or (len(path) > 1 and path[-2] in _QUANTITY_PARENTS)):
        return _quantity_equal(live, desired)
    # The API server turns ints into strings for int-or-string fields and back.
    return str(live) == str(desired)


class Kube:
    """Thin, counted wrapper around the official client (thread-safe for our use)."""

    def __init__(self, api: client.ApiClient, may_write: Callable[[], bool] | None = None,
                 cache: WatchCache | None = None):
        self.api = api
        # The leader-election gate: asked right before every write is sent. None: no
        # election, every write goes.
        self.may_write = may_write
        # What the watches delivered (None: read everything from the API server).
        self.cache = cache
        self._events: queue.Queue[tuple[float, dict]] | None = None  # (queued at, Event)
        # While it answers True, Events wait (new objects' children go first), each at
        # most EVENT_HOLD seconds after it was queued. None: they never wait.
        self.hold_events: Callable[[], bool] | None = None
        # Reconciles run in worker threads and share the discovery cache below.
        self._lock = threading.Lock()
        # (apiVersion, kind) -> (served, when discovery said so)
        self._discovered: dict[tuple[str, str], tuple[bool, float]] = {}
        #: How many times an optional API (discovery) came or went while running.
        self.api_changes = 0
        # Namespaces the API server said are being deleted -> when it said so.
        self._terminating: dict[str, float] = {}
        # Namespaces the namespace watch shows being deleted (observe_namespace).
        self._deleting: set[str] = set()
        # Whether the LeaderWorkerSets' watch holds them all (watching_leader_worker_sets).
        self._lws_current: Callable[[], bool] = lambda: False

    #: How long a namespace the API server called terminating is taken as such without
    #: asking again (a namespace of that name may be created anew after it is gone).
    TERMINATING_MEMORY = 30.0

    def observe_namespace(self, event_type: str, namespace: dict) -> None:
        """A namespace watch event: one being deleted (a deletionTimestamp, phase
        Terminating) is known as such before anything in it is, so no write goes into
        it; one that is gone, or new under the same name, is open again."""
        meta = namespace.get("metadata") or {}
        name = meta.get("name")
        if not name:
            return
        deleting = event_type != "DELETED" and bool(
            meta.get("deletionTimestamp")
            or (namespace.get("status") or {}).get("phase") == "Terminating")
        with self._lock:
            news = deleting and name not in self._deleting
            if deleting:
                self._deleting.add(name)
            else:
                self._deleting.discard(name)
        if news:  # from here on no write goes into it (tests count from this line)
            log.info("namespace %s is being deleted: no writes into it from now on", name)

    def namespace_terminating(self, namespace: str) -> bool:
        """Whether ``namespace`` is being deleted: the namespace watch says so, or a
        write into it was refused as "being terminated" (an operator whose role may not
        watch namespaces), which holds TERMINATING_MEMORY seconds and then as long as
        reading the namespace shows its deletion."""
        with self._lock:
            if namespace in self._deleting:
                return True
            said = self._terminating.get(namespace)
            if said is None:
                return False
            if time.monotonic() - said < self.TERMINATING_MEMORY:
                return True
            del self._terminating[namespace]
        # Pods taking their grace period keep a namespace Terminating for minutes:
        # forgetting it then wrote statuses, plan ConfigMaps and Events into it again
        # every TERMINATING_MEMORY seconds until a create was refused once more.
        if self._still_terminating(namespace):
            with self._lock:
                self._terminating[namespace] = time.monotonic()
            return True
        return False

    def _still_terminating(self, namespace: str) -> bool:
        """Whether a read of the namespace shows its deletion; False when it is gone,
        new, or cannot be read (no role for it: it is forgotten, as it was before)."""
        try:
            live = self.get(f"{api_path('v1')}/namespaces/{namespace}")
        except (ApiException, TemporaryError):
            return False
        return live is not None and bool((live.get("metadata") or {}).get("deletionTimestamp"))

    # ------------------------------------------------------------ raw requests

    def request(self, verb: str, path: str, body: Any = None, *, query: dict | None = None,
                content_type: str = "application/json", gated: bool = True,
                timeout: float = 30) -> Any:
        """One API request; JSON bodies as dicts, apply patches as YAML text.

        A write (any verb but GET) is sent only while ``may_write`` allows it; the
        leader election's own Lease requests pass ``gated=False``.
        """
        if gated and verb.lower() != "get":
            if self.may_write is not None and not self.may_write():
                metrics.WRITES_FENCED.inc()
                raise NotLeader(f"{verb} {path}: not the leader; write not sent")
            # Everything in a namespace being deleted goes with it: a status, an Event
            # or a re-created child written into it would fight the deletion.
            namespace = _namespace_of(path)
            if namespace is not None and self.namespace_terminating(namespace):
                raise NamespaceTerminating(
                    f"{verb} {path}: namespace {namespace} is being deleted; write not sent",
                    403)
            # urllib3 logs a request when its answer comes: this says when it went
            log.debug("sending %s %s", verb.upper(), path)
        metrics.API_REQUESTS.labels(verb=verb.lower()).inc()
        method, url, headers, body, post = self.api.param_serialize(
            verb.upper(),
            path,
            query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self.api.call_api(method, url, headers, body, post,
                                     _request_timeout=timeout)
            data = resp.read()
        except ApiException as exc:  # transport-level failure
            raise TemporaryError(f"{verb} {path}: {exc.reason or exc}") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # API server down or restarting: connection refused, reset, timed out.
            raise TemporaryError(f"{verb} {path}: API server unreachable "
                                 f"({type(exc).__name__})") from None
        if resp.status >= 400:
            message = _api_message(data)
            if resp.status == 403 and _namespace_terminating(data):
                namespace = _namespace_of(path) or ""
                with self._lock:
                    self._terminating[namespace] = time.monotonic()
                raise NamespaceTerminating(f"{verb} {path}: {message}", resp.status)
            # A refusal says what the API server said, which names the object and field,
            # and not how it was sent: a create (POST) and the applies after it (PATCH)
            # are refused the same way, and a condition quoting the verb would flap.
            if resp.status == 500 and any(m in message for m in _TYPED_PATCH_ERRORS):
                raise Rejected(message, resp.status)
            if resp.status in _RETRYABLE_STATUS:
                raise TemporaryError(f"{verb} {path}: HTTP {resp.status} {resp.reason}",
                                     resp.status)
            if resp.status in (400, 403, 413, 422) and verb.lower() in ("patch", "post", "put"):
                raise Rejected(f"HTTP {resp.status}: {message}", resp.status)
            raise ApiException(status=resp.status, reason=resp.reason,
                               body=data.decode("utf-8", "replace") if data else None)
        return json.loads(data) if data else None

    def get(self, path: str, *, gated: bool = True, timeout: float = 30) -> dict | None:
        try:
            return self.request("get", path, gated=gated, timeout=timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # ------------------------------------------------------------ children

    @staticmethod
    def object_path(obj: dict) -> str:
        meta = obj["metadata"]
        return resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])

    def _cached(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self.cache.get(api_version, kind, namespace, name) if self.cache else None

    def _read(self, path: str) -> dict | None:
        """GET, keeping the answer in the cache (the watch keeps it fresh from then on)."""
        live = self.get(path)
        if self.cache is not None:
            self.cache.remember(live)
        return live

    def ensure(self, desired: dict, *, surely_absent: bool = False) -> tuple[str, dict]:
        """Apply ``desired`` if the live object lacks any of its fields.

        The live object is the watches' copy, else read. ``surely_absent`` (the owner
        was never reconciled) skips that read: an apply is right whatever it finds.
        Returns the action ("created", "updated" or "unchanged") and the live object
        after it, so callers need not read it again.
        """
        path = self.object_path(desired)
        live = self._cached(*ref_of(desired))
        if live is None and not surely_absent:
            live = self._read(path)
        if live is None and surely_absent and not duplicate_list_keys(desired):
            created = self.create(desired)
            if created is not None:
                return "created", created
            live = self._read(path)  # it existed after all
        if live is not None and contains(live, desired):
            return "unchanged", live
        if live is not None:
            self.adopt_created(live)
        return ("created" if live is None else "updated"), self.apply(desired)

    def apply(self, desired: dict) -> dict:
        """Server-side apply as the field manager ``spillway`` (forced: the operator
        owns its children's fields); the answer is kept in the cache."""
        applied = self.request(
            "patch",
            self.object_path(desired),
            # JSON is YAML, and json.dumps is many times faster than yaml.safe_dump.
            body=json.dumps(desired),
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )
        if self.cache is not None:
            self.cache.remember(applied)
        return applied

    def create(self, desired: dict) -> dict | None:
        """POST a child that is surely new: the API server spends about a third less
        on a create than on an apply that creates (bench/operator_reconcile.py,
        floor against floor-apply). Its fields belong to ``spillway`` by an Update
        entry, which ``adopt_created`` turns into the Apply entry before the first
        apply, so applies keep removing what they no longer set. None when it
        already exists."""
        meta = desired["metadata"]
        try:
            created = self.request(
                "post", resource_path(desired["apiVersion"], desired["kind"], meta["namespace"]),
                body=desired, query={"fieldManager": FIELD_MANAGER})
        except TemporaryError as exc:
            if exc.status == 409:
                return None
            raise
        if self.cache is not None:
            self.cache.remember(created)
        return created

    def adopt_created(self, live: dict) -> None:
        """Turn the ``spillway`` Update entry a create left in ``live``'s managedFields
        into an Apply entry, as kubectl does when it moves an object to server-side
        apply. Without it the Update entry keeps owning every field it created, and
        an apply that stops setting one (an env var, a volume) would leave it behind.
        The write names the resourceVersion, so the entry's index is the one read: when
        the copy was stale (a Deployment's status moves all the time) the API server
        answers 409 and it is read and tried once more; then the reconcile retries."""
        try:
            self._adopt(live)
        except TemporaryError as exc:
            if exc.status != 409:
                raise
            fresh = self._read(self.object_path(live))
            if fresh is not None:
                self._adopt(fresh)

    def _adopt(self, live: dict) -> None:
        entries = (live.get("metadata") or {}).get("managedFields") or []
        ours = [(i, e.get("operation")) for i, e in enumerate(entries)
                if e.get("manager") == FIELD_MANAGER and not e.get("subresource")]
        if [op for _, op in ours] != ["Update"]:
            return  # applied already (or more than the create touched it: leave it)
        meta = live["metadata"]
        patch = [{"op": "replace", "path": "/metadata/resourceVersion",
                  "value": meta["resourceVersion"]},
                 {"op": "replace", "path": f"/metadata/managedFields/{ours[0][0]}/operation",
                  "value": "Apply"}]
        adopted = self.request("patch", self.object_path(live), body=patch,
                               query={"fieldManager": FIELD_MANAGER},
                               content_type="application/json-patch+json")
        if self.cache is not None:
            self.cache.remember(adopted)

    def _served(self, api_version: str, kind: str, max_age: float) -> bool:
        """Whether the API server serves ``kind`` (its discovery document lists the
        resource), asked again once the last answer is older than ``max_age`` seconds.
        Discovery is a non-resource URL every authenticated user may read."""
        plural = _PLURALS[(api_version, kind)]
        # Held across the one discovery request, so concurrent workers wait for its
        # answer instead of each asking (and racing on the answer).
        with self._lock:
            held = self._discovered.get((api_version, kind))
            if held is not None and time.monotonic() - held[1] <= max_age:
                return held[0]
            found = self.get(api_path(api_version))
            served = bool(found and any(r.get("name") == plural
                                        for r in found.get("resources") or ()))
            self._discovered[(api_version, kind)] = (served, time.monotonic())
        if held is not None and held[0] != served:
            self._api_changed(api_version, kind)
        return served

    def _api_changed(self, api_version: str, kind: str) -> None:
        """An API came or went: what the cache remembers of its objects is void (they
        went with their CRD; and one re-installed holds none of them)."""
        with self._lock:
            self.api_changes += 1
        if self.cache is not None:
            self.cache.forget_kind(api_version, kind)

    def service_monitors_served(self) -> bool:
        """Whether the Prometheus operator's ServiceMonitor API exists (re-checked every
        5 minutes, so installing the Prometheus operator later is noticed)."""
        return self._served(SERVICE_MONITOR_API, "ServiceMonitor", 300)

    def inference_pools_served(self, max_age: float = 30) -> bool:
        """Whether the Gateway API Inference Extension's InferencePool v1 API exists;
        ``max_age`` 0 asks now (the controller's periodic check)."""
        return self._served(INFERENCE_POOL_API, INFERENCE_POOL_KIND, max_age)

    def inference_pools_gone(self) -> None:
        """A request on an InferencePool answered 404 for the whole resource: its CRD
        was removed since discovery last said it was served."""
        with self._lock:
            held = self._discovered.get((INFERENCE_POOL_API, INFERENCE_POOL_KIND))
            self._discovered[(INFERENCE_POOL_API, INFERENCE_POOL_KIND)] = (False,
                                                                           time.monotonic())
        if held is None or held[0]:
            self._api_changed(INFERENCE_POOL_API, INFERENCE_POOL_KIND)

    # ------------------------------------------------------------ reads

    def leader_worker_sets_served(self, max_age: float = 30) -> bool:
        """Whether LeaderWorkerSet's API (sigs.k8s.io/lws) is installed: replicas that
        span nodes need it."""
        return self._served(LWS_API, LWS_KIND, max_age)

    def watching_leader_worker_sets(self, current: Callable[[], bool]) -> None:
        """The LeaderWorkerSets' watch: ``current`` says whether the cache holds every
        one there is (listed, the API installed and the watch granted)."""
        self._lws_current = current

    def get_leader_worker_set(self, namespace: str, name: str) -> dict | None:
        """The watch's copy while its watch is current (a miss then means absent);
        else read each time, since a copy the operator remembered from its own write
        goes stale with no watch to move it (its status moves with every group)."""
        if self.cache is not None and self._lws_current():
            return self._cached(LWS_API, LWS_KIND, namespace, name)
        return self.get(resource_path(LWS_API, LWS_KIND, namespace, name))

    def scale_to_zero(self, api_version: str, kind: str, namespace: str, name: str,
                      live: dict | None) -> bool:
        """Set a workload's replicas to 0 (a merge patch: the operator's role has no
        delete); False when it is absent or already at 0."""
        if live is None or not (live.get("spec") or {}).get("replicas"):
            return False
        try:
            patched = self.request("patch", resource_path(api_version, kind, namespace, name),
                                   body={"spec": {"replicas": 0}},
                                   content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        if self.cache is not None:
            self.cache.remember(patched)
        return True

    def watched_deployment(self, namespace: str, name: str) -> dict | None:
        """The Deployment as the watch holds it (None: the watch has none); read only
        without watches. For checks that must not GET a Deployment that is usually
        absent (a multi-node replica's) on every tick."""
        if self.cache is not None:
            return self._cached("apps/v1", "Deployment", namespace, name)
        return self.get_deployment(namespace, name)

    def get_deployment(self, namespace: str, name: str) -> dict | None:
        return self._cached("apps/v1", "Deployment", namespace, name) or self._read(
            resource_path("apps/v1", "Deployment", namespace, name))

    def read_configmap_key(self, namespace: str, name: str, key: str,
                           reader: Key | None = None) -> str | None:
        """A key of a ConfigMap; ``reader`` (the InferenceDeployment whose spec names it)
        has the watch keep it, and queue the reader again when it changes."""
        if self.cache is not None and reader is not None:
            self.cache.read_by(namespace, name, reader)
        cm = self._cached("v1", "ConfigMap", namespace, name) or self._read(
            resource_path("v1", "ConfigMap", namespace, name))
        if cm is None:
            return None
        return (cm.get("data") or {}).get(key)

    def get_claim(self, namespace: str, name: str) -> dict | None:
        return self.get(resource_path("v1", "PersistentVolumeClaim", namespace, name))

    def get_storage_class(self, name: str) -> dict | None:
        return self.get(f"{api_path('storage.k8s.io/v1')}/storageclasses/{name}")

    def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        return self.read_secret_key_version(namespace, name, key)[0]

    def read_secret_key_version(self, namespace: str, name: str,
                                key: str) -> tuple[str | None, str | None]:
        """A key of a Secret and the Secret's resourceVersion (None, None: no Secret)."""
        secret = self.get(resource_path("v1", "Secret", namespace, name))
        if secret is None:
            return None, None
        value = (secret.get("data") or {}).get(key)
        version = (secret.get("metadata") or {}).get("resourceVersion")
        return (base64.b64decode(value).decode() if value else None), version

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        data = self.request("get", resource_path("v1", "Pod", namespace),
                            query={"labelSelector": selector})
        return data.get("items", [])

    def list_nodes(self, selector: str) -> list[dict]:
        """The nodes a label selector matches (a GPU pool's nodeSelector)."""
        data = self.request("get", f"{api_path('v1')}/nodes", query={"labelSelector": selector})
        return data.get("items", [])

    def owned_pods(self, owner: Key, selector: str, deployment: dict | None) -> list[dict]:
        """The pods of an InferenceDeployment: the watches' copies when they agree with
        its Deployment's count, else listed (and the copies replaced)."""
        if self.cache is not None and (pods := self.cache.pods(owner, deployment)) is not None:
            return pods
        pods = self.list_pods(owner[0], selector)
        if self.cache is not None:
            for pod in pods:  # a list's items carry neither
                pod.setdefault("apiVersion", "v1")
                pod.setdefault("kind", "Pod")
            self.cache.replace_pods(owner, pods)
        return pods

    def pods_of(self, namespace: str, name: str, selector: str) -> list[dict]:
        """owned_pods, with the workload the watches hold (the autoscaler's tick): the
        Deployment, or a LeaderWorkerSet's groups counted as the pods they ask for."""
        workload = self.watched_deployment(namespace, name)
        if workload is None and self.cache is not None and self._lws_current():
            lws = self._cached(LWS_API, LWS_KIND, namespace, name)
            if lws is not None:
                spec = lws.get("spec") or {}
                size = int((spec.get("leaderWorkerTemplate") or {}).get("size") or 1)
                workload = {"status": {"replicas": int(spec.get("replicas") or 0) * size}}
        return self.owned_pods((namespace, name), selector, workload)

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        """Merge-patch a pod's annotations (None removes one): the autoscaler's
        scale-down marks. Gated like every write."""
        self.request("patch", resource_path("v1", "Pod", namespace, name),
                     body={"metadata": {"annotations": annotations}},
                     content_type="application/merge-patch+json")

    # ------------------------------------------------------------ the resource

    @staticmethod
    def _own_path(namespace: str, name: str, sub: str) -> str:
        return resource_path(f"{GROUP}/{VERSION}", KIND, namespace, name, sub)

    def patch_status(self, namespace: str, name: str, status: dict) -> dict | None:
        """Merge-patch the status; returns the object the API server now holds."""
        return self.request(
            "patch",
            self._own_path(namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        """Write spec.replicas through the scale subresource (the autoscaler's only write)."""
        self.request(
            "patch",
            self._own_path(namespace, name, "scale"),
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    def post_event(self, owner: dict, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the InferenceDeployment (what `kubectl describe` shows)."""
        meta = owner["metadata"]
        now = now_rfc3339()
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message[:1000],
            "source": {"component": "spillway-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": "spillway-operator",
        }
        self._send_later(body)

    #: Events sent at most this many a second after a burst of ``EVENT_BURST``: a
    #: thousand new objects make a thousand Events or more, which must not take the API
    #: server from the children's writes (client-go's recorder limits them as well);
    #: each waits at most ``EVENT_HOLD`` seconds while ``hold_events`` says so.
    EVENT_RATE, EVENT_BURST = 25.0, 100
    EVENT_HOLD = 30.0

    def _send_later(self, event: dict) -> None:
        """Events are best effort: one thread posts them, so a reconcile never waits for
        them (a new object's first status write has one or two). A full queue drops."""
        if self._events is None:
            with self._lock:
                if self._events is None:
                    self._events = queue.Queue(maxsize=10_000)
                    threading.Thread(target=self._post_events, name="spillway-events",
                                     daemon=True).start()
        with contextlib.suppress(queue.Full):
            self._events.put_nowait((time.monotonic(), event))

    def _post_events(self) -> None:
        assert self._events is not None
        tokens, last = float(self.EVENT_BURST), time.monotonic()
        while True:
            queued, event = self._events.get()
            # From its queueing, not from its turn: in a long burst, Events queued
            # behind others would each wait EVENT_HOLD again, one per EVENT_HOLD.
            held = queued + self.EVENT_HOLD
            while self.hold_events is not None and self.hold_events() and \
                    time.monotonic() < held:
                time.sleep(0.1)
            now = time.monotonic()
            tokens = min(float(self.EVENT_BURST), tokens + (now - last) * self.EVENT_RATE)
            last = now
            if tokens < 1:
                time.sleep((1 - tokens) / self.EVENT_RATE)
                tokens, last = 1.0, time.monotonic()
            tokens -= 1
            # Never let one Event (or an outage) end the thread.
            with contextlib.suppress(Exception):
                self.request("post", resource_path("v1", "Event",
                                                   event["metadata"]["namespace"]), body=event)
