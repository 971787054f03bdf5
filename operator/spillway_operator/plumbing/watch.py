"""The operator's own watches of its children and their pods.

kopf spends about a millisecond of its event loop on every watch event (its
per-event bookkeeping, handler arguments and throttling) and filters labels on the
client, after the API server has sent every Deployment, Service and pod of the
namespace. A new InferenceDeployment makes a dozen child and pod events within
seconds, so at a thousand objects created at once that overhead, not the API server,
set the pace (py-spy: two thirds of the operator's CPU in kopf's loop). These watches
ask the server for the managed objects only (a label selector) and hand each event
straight to the cache, one thread per kind and namespace.

Semantics are client-go's reflector: a paged LIST, then WATCH from its
resourceVersion with bookmarks, resumed from the last version seen after every
server timeout; a 410 Gone (the version was compacted) lists again, and an object
the new list lacks is delivered as DELETED. Failures back off 1, 2, 5, then every
10 s, without end: an API server outage is waited out, never an exit.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from spillway_operator.names import LWS_API, LWS_KIND
from spillway_operator.plumbing import metrics
from spillway_operator.plumbing.kube import api_path

log = logging.getLogger("spillway.watch")

Deliver = Callable[[str, dict[str, Any]], None]  # (event type, object)


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str

    def path(self, namespace: str | None) -> str:
        root = api_path(self.api_version)
        return f"{root}/namespaces/{namespace}/{self.plural}" if namespace else \
            f"{root}/{self.plural}"


DEPLOYMENTS = Kind("apps/v1", "Deployment", "deployments")
SERVICES = Kind("v1", "Service", "services")
POD_DISRUPTION_BUDGETS = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
PODS = Kind("v1", "Pod", "pods")
NAMESPACES = Kind("v1", "Namespace", "namespaces")
LEADER_WORKER_SETS = Kind(LWS_API, LWS_KIND, "leaderworkersets")
#: How long a watch whose API is not installed waits before it looks again.
ABSENT_RETRY_SECONDS = 60.0


class Gone(Exception):
    """410: the resourceVersion asked for is older than etcd keeps; list again."""


class WatchFailed(Exception):
    """Any other failure of a list or watch: retried after a back-off."""


class NotServed(WatchFailed):
    """404 on the list: the API server serves no such resource (a CRD not installed)."""


class Forbidden(WatchFailed):
    """403: the operator's role does not grant this list or watch."""


def lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The newline-delimited JSON of a watch stream as whole lines, however the
    chunks cut them."""
    rest = b""
    for chunk in chunks:
        rest += chunk
        *whole, rest = rest.split(b"\n")
        for line in whole:
            if line.strip():
                yield line
    if rest.strip():
        yield rest


def _backoffs() -> Iterator[float]:
    return itertools.chain((1, 2, 5), itertools.repeat(10))


class Reflector:
    """Keeps ``deliver`` told of every object of ``kind`` in ``namespace`` (None: all
    namespaces) that ``selector`` matches. ``deliver`` runs on the reflector's thread,
    in the order of the stream."""

    def __init__(self, api: client.ApiClient, kind: Kind, namespace: str | None,
                 selector: str, deliver: Deliver, *, timeout: int = 300,
                 page_size: int = 500, optional: str | None = None,
                 absent: str | None = None):
        """``optional``: what the operator does without this watch; a role that does
        not grant it (403) ends the watch with that line instead of retrying for ever.
        ``absent``: what it does while the kind's API is not installed (404): said
        once, and the watch looks again every ABSENT_RETRY_SECONDS (it may be
        installed later)."""
        self.optional, self.absent = optional, absent
        self.api, self.kind, self.namespace = api, kind, namespace
        self.selector, self.deliver = selector, deliver
        self.timeout, self.page_size = timeout, page_size
        self.version: str | None = None  # where the next watch resumes; None: list first
        self.synced = threading.Event()  # set once the first list was delivered
        self._said_absent = False
        # What each object delivered last carried that a DELETED needs (its owner).
        self._known: dict[tuple[str, str], dict[str, Any]] = {}
        self._stopped = threading.Event()
        self._response: urllib3.HTTPResponse | None = None
        self._thread = threading.Thread(
            target=self._run, daemon=True,
            name=f"watch-{kind.plural}-{namespace or 'all'}")

    def start(self) -> Reflector:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stopped.set()
        response = self._response
        if response is not None:
            # Wakes the thread's blocking read; it may have closed meanwhile.
            with contextlib.suppress(Exception):
                response.shutdown()
        if timeout is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        backoff = _backoffs()
        while not self._stopped.is_set():
            try:
                if self.version is None:
                    self._list()
                healthy = self._watch()
            except Gone:
                log.info("%s: resourceVersion %s compacted; listing again",
                         self._name(), self.version)
                self.version = None
                continue
            except NotServed as exc:
                if self.absent is None:
                    healthy = False
                    log.warning("%s: %s", self._name(), exc)
                else:
                    self.version = None  # nothing it held is current any more
                    if not self._said_absent:
                        log.info("%s: the API is not installed; %s", self._name(), self.absent)
                        self._said_absent = True
                    self._stopped.wait(ABSENT_RETRY_SECONDS)
                    continue
            except Forbidden as exc:
                if self.optional is None:
                    healthy = False
                    log.warning("%s: %s", self._name(), exc)
                else:
                    log.info("%s: not granted by the operator's role; %s", self._name(),
                             self.optional)
                    self.synced.set()
                    return
            except WatchFailed as exc:
                healthy = False
                log.warning("%s: %s", self._name(), exc)
            except Exception:  # a bug in deliver must not end the watch for ever
                healthy = False
                log.exception("%s: event delivery failed; listing again", self._name())
                self.version = None
            if healthy:
                backoff = _backoffs()
            elif not self._stopped.is_set():
                self._stopped.wait(next(backoff))

    def _name(self) -> str:
        return f"watch {self.kind.plural} in {self.namespace or 'all namespaces'}"

    def current(self) -> bool:
        """Whether what it delivered is every object there is: listed, and the API
        neither absent nor refused since (then a miss in the cache means absent)."""
        return self.version is not None

    def _open(self, query: dict[str, Any], read_timeout: float) -> urllib3.HTTPResponse:
        if self.selector:
            query = {"labelSelector": self.selector, **query}
        method, url, headers, body, post = self.api.param_serialize(
            "GET", self.kind.path(self.namespace), query_params=list(query.items()),
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])
        try:
            resp = self.api.call_api(method, url, headers, body, post,
                                     _request_timeout=(10, read_timeout))
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise WatchFailed(f"API server unreachable ({type(exc).__name__})") from None
        if resp.status == 410:
            resp.read()
            raise Gone()
        if resp.status >= 400:
            text = resp.read().decode("utf-8", "replace")
            error = {403: Forbidden, 404: NotServed}.get(resp.status, WatchFailed)
            raise error(f"HTTP {resp.status}: {' '.join(text.split())[:300]}")
        return resp.response

    def _list(self) -> None:
        """Every matching object, page by page, delivered as ADDED (or MODIFIED: the
        cache tells news itself); those known before and now absent as DELETED."""
        items: list[dict[str, Any]] = []
        cont = ""
        while True:
            metrics.API_REQUESTS.labels(verb="list").inc()
            query: dict[str, Any] = {"limit": self.page_size}
            if cont:
                query["continue"] = cont
            resp = self._open(query, 60)
            try:
                page = json.loads(resp.data)
            except ValueError:
                raise WatchFailed("list answer is not JSON") from None
            items.extend(page.get("items") or ())
            meta = page.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                version = meta.get("resourceVersion")
                break
        listed = set()
        for item in items:
            item.setdefault("apiVersion", self.kind.api_version)
            item.setdefault("kind", self.kind.kind)
            listed.add(self._remember("ADDED", item))
            self.deliver("ADDED", item)
        for key in set(self._known) - listed:
            gone = {"apiVersion": self.kind.api_version, "kind": self.kind.kind,
                    "metadata": {**self._known.pop(key), "resourceVersion": version}}
            self.deliver("DELETED", gone)
        self.version = version
        self.synced.set()
        self._said_absent = False  # said again if the API goes away again
        log.info("%s: listed %d, watching from resourceVersion %s", self._name(),
                 len(items), version)

    def _remember(self, event_type: str, obj: dict[str, Any]) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":
            self._known.pop(key, None)
        else:
            self._known[key] = {k: meta[k] for k in
                                ("namespace", "name", "labels", "ownerReferences") if k in meta}
        return key

    def _watch(self) -> bool:
        """One watch until the server ends it. Returns whether it was healthy (an
        empty watch the server ends at once counts as a failure: no busy loop)."""
        metrics.API_REQUESTS.labels(verb="watch").inc()
        started = time.monotonic()
        resp = self._open({"watch": "true", "resourceVersion": self.version,
                           "allowWatchBookmarks": "true", "timeoutSeconds": self.timeout},
                          self.timeout + 30)
        self._response = resp
        events = 0
        try:
            for line in lines(resp.stream(64 * 1024, decode_content=True)):
                if self._stopped.is_set():
                    break
                try:
                    event = json.loads(line)
                except ValueError:
                    raise WatchFailed("watch event is not JSON") from None
                event_type, obj = event.get("type"), event.get("object") or {}
                if event_type == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise WatchFailed(f"watch error: {obj.get('message') or obj}")
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if event_type != "BOOKMARK":
                    self._remember(event_type, obj)
                    self.deliver(event_type, obj)
                    events += 1
                if version:
                    self.version = version
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if not self._stopped.is_set():
                raise WatchFailed(f"watch broke ({type(exc).__name__})") from None
        finally:
            self._response = None
            resp.release_conn()
        return events > 0 or time.monotonic() - started > 1
