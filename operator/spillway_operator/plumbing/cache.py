"""What the operator's watches already told it: the children, their pods, and the
model ConfigMaps the specs name, so a reconcile reads none of them again.

The watches deliver every change of the children (Deployments, Services and
PodDisruptionBudgets and the pods from the operator's own, plan ConfigMaps from
kopf's); each body is put here before its owner is queued, so the owner's reconcile
sees at least that version. The
operator's own writes put the answer here too, so a reconcile that runs before the
watch event of its own write does not write again.

A miss is never taken as "absent": the caller reads the API server (and the answer
is kept). A stale hit is harmless: the watch event that follows queues the owner
again. Versions only move forward (a late event never replaces a newer body), and
an object re-created after a delete is not dropped by the old delete's late event.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

Ref = tuple[str, str, str, str]  # (apiVersion, kind, namespace, name)
Key = tuple[str, str]  # an InferenceDeployment: (namespace, name)


def _version(body: Mapping[str, Any]) -> int | None:
    """The resourceVersion as a number (etcd's revision in every API server we know);
    None when it is not one, and then the latest arrival wins."""
    try:
        return int((body.get("metadata") or {}).get("resourceVersion", ""))
    except (TypeError, ValueError):
        return None


def ref_of(body: Mapping[str, Any]) -> Ref:
    meta = body.get("metadata") or {}
    return (body.get("apiVersion", ""), body.get("kind", ""), meta.get("namespace", ""),
            meta.get("name", ""))


def _active(pod: Mapping[str, Any]) -> bool:
    """Counted in a Deployment's status.replicas: neither terminating nor finished."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def _without_status(body: Mapping[str, Any]) -> dict[str, Any]:
    """What an owner's reconcile compares: all but the status and what every write
    moves."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items()
            if k not in ("resourceVersion", "managedFields")}
    return {**{k: v for k, v in body.items() if k != "status"}, "metadata": meta}


def older(new: Mapping[str, Any], held: Mapping[str, Any] | None) -> bool:
    """Whether ``new`` is an earlier version than ``held`` (False when either is unknown)."""
    if held is None:
        return False
    a, b = _version(new), _version(held)
    return a is not None and b is not None and a < b


class WatchCache:
    """Thread-safe: the watches write from their threads and kopf's event loop,
    reconciles read from worker threads."""

    def __init__(self, owner_label: str):
        self.owner_label = owner_label
        self._lock = threading.Lock()
        self._objects: dict[Ref, dict[str, Any]] = {}
        self._pods: dict[Key, dict[str, dict[str, Any]]] = {}  # owner -> name -> pod
        # model ConfigMaps read for a spec -> the InferenceDeployments that read them
        self._readers: dict[tuple[str, str], set[Key]] = {}

    # ------------------------------------------------------------ the watches

    def observe(self, body: Mapping[str, Any], event_type: str | None) -> bool:
        """A watch event of a child (kopf's ``type``: None while listing). Returns
        whether it is news to the owner's reconcile: not when the cache already held
        this version (the answer to the operator's own write), nor when only the status
        moved of a kind whose status the reconcile never reads (all but Deployments)."""
        ref = ref_of(body)
        with self._lock:
            held = self._objects.get(ref)
            if event_type == "DELETED":
                if older(body, held):
                    return False  # re-created since: this delete is of the old one
                self._objects.pop(ref, None)
                return True
            if older(body, held):
                return False
            self._objects[ref] = dict(body)
        if held is None:
            return True
        if _version(body) is not None and _version(body) == _version(held):
            return False
        return ref[1] == "Deployment" or _without_status(body) != _without_status(held)

    def remember(self, body: Mapping[str, Any] | None) -> None:
        """An object the operator wrote or read itself."""
        if body and body.get("kind"):
            self.observe(body, "MODIFIED")

    def observe_pod(self, body: Mapping[str, Any], event_type: str | None) -> None:
        meta = body.get("metadata") or {}
        owner = (meta.get("namespace", ""), (meta.get("labels") or {}).get(self.owner_label, ""))
        name = meta.get("name", "")
        with self._lock:
            pods = self._pods.setdefault(owner, {})
            if event_type == "DELETED":
                pods.pop(name, None)
                if not pods:
                    self._pods.pop(owner, None)
            elif not older(body, pods.get(name)):
                pods[name] = dict(body)

    def forget_kind(self, api_version: str, kind: str) -> None:
        """Every body of a kind whose API came or went (a CRD installed or removed):
        none of them is known any more, so the next reconcile reads or writes anew."""
        with self._lock:
            for ref in [r for r in self._objects if r[:2] == (api_version, kind)]:
                del self._objects[ref]

    # ------------------------------------------------------------ reads

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """The latest body seen, or None when none was (not: "it does not exist")."""
        with self._lock:
            return self._objects.get((api_version, kind, namespace, name))

    def pods(self, owner: Key, deployment: Mapping[str, Any] | None) -> list[dict] | None:
        """The owner's pods, when the watch's count agrees with what its Deployment
        reports (``status.replicas``: pods neither terminating nor finished); None when it does not
        (the watch has not caught up, e.g. just after start-up): list them instead."""
        with self._lock:
            pods = list((self._pods.get(owner) or {}).values())
        live = sum(1 for p in pods if _active(p))
        want = ((deployment or {}).get("status") or {}).get("replicas") or 0
        return pods if live == want else None

    def replace_pods(self, owner: Key, pods: list[dict]) -> None:
        """A LIST's answer: the owner's pods now (newer watch bodies are kept)."""
        with self._lock:
            held = self._pods.get(owner) or {}
            fresh = {}
            for pod in pods:
                name = pod["metadata"]["name"]
                fresh[name] = held[name] if older(pod, held.get(name)) else pod
            if fresh:
                self._pods[owner] = fresh
            else:
                self._pods.pop(owner, None)

    # ------------------------------------------------------------ model ConfigMaps

    def read_by(self, namespace: str, name: str, reader: Key) -> None:
        """``reader``'s spec names this ConfigMap: keep it, and say who to wake."""
        with self._lock:
            self._readers.setdefault((namespace, name), set()).add(reader)

    def readers(self, namespace: str, name: str) -> set[Key]:
        with self._lock:
            return set(self._readers.get((namespace, name), ()))

    def forget_reader(self, reader: Key) -> None:
        """``reader`` was deleted: its ConfigMaps no longer need watching for it."""
        with self._lock:
            for ref, readers in list(self._readers.items()):
                readers.discard(reader)
                if not readers:
                    del self._readers[ref]
                    self._objects.pop(("v1", "ConfigMap", *ref), None)


class Memo:
    """A small thread-safe LRU map for results of pure steps (the reconcile's workers
    share it)."""

    def __init__(self, size: int = 512):
        self.size = size
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
