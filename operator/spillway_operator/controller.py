"""The controller loop: kopf watches, a keyed work queue, workers that reconcile.

kopf's watch-event handlers only enqueue keys; they keep no state in the objects
(no finalizers, no progress annotations), so a steady state makes no writes. The
queue deduplicates keys, retries temporary failures with capped exponential
back-off, and re-reconciles everything periodically to repair drift on children
we do not watch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from spillway_operator.flow.reconciler import Reconciler
from spillway_operator.flow.scaler import Autoscaler
from spillway_operator.plumbing import metrics
from spillway_operator.plumbing.cache import older
from spillway_operator.plumbing.kube import Rejected, TemporaryError

log = logging.getLogger("spillway.controller")

Key = tuple[str, str]  # (namespace, name)


@dataclass
class Backoff:
    base: float = 1.0
    cap: float = 300.0
    failures: dict[Key, int] = field(default_factory=dict)

    def next(self, key: Key) -> float:
        n = self.failures.get(key, 0)
        self.failures[key] = n + 1
        return min(self.cap, self.base * 2**n)

    def reset(self, key: Key) -> None:
        self.failures.pop(key, None)


def only_status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether ``new`` differs from ``old`` only in the reconciler's own part of the
    status (its own writes): nothing to reconcile. The spec is covered by the
    generation, which the API server bumps on every spec change; status.autoscaling
    is the autoscaler's, and the reconciler's ScalingActive condition follows it while
    autoscaling is on (off, the reconciler reads nothing of it); status.diskTier is the
    autoscaler's too, and the Degraded condition follows it always."""
    a, b = old.get("metadata") or {}, new.get("metadata") or {}
    sa, sb = old.get("status") or {}, new.get("status") or {}
    scaling = bool(((new.get("spec") or {}).get("autoscaling") or {}).get("enabled"))
    return all(a.get(k) == b.get(k) for k in
               ("generation", "labels", "annotations", "deletionTimestamp", "uid")) and \
        (not scaling or sa.get("autoscaling") == sb.get("autoscaling")) and \
        sa.get("diskTier") == sb.get("diskTier")


class Controller:
    def __init__(self, reconciler: Reconciler, workers: int = 4, resync_seconds: float = 300,
                 backoff: Backoff | None = None, autoscaler: Autoscaler | None = None,
                 discovery_seconds: float = 30):
        self.reconciler = reconciler
        # How often the optional APIs the reconciles depend on are asked about
        # (_rediscover; only with an endpoint picker: the InferencePool API).
        self.discovery_seconds = discovery_seconds
        self.autoscaler = autoscaler
        self.workers = workers
        # Their own threads: asyncio's default pool has min(32, CPUs + 4) threads, six
        # on a two-core node, which capped "workers" there whatever it was set to (a
        # reconcile mostly waits for the API server).
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="reconcile")
        self.resync_seconds = resync_seconds
        self.backoff = backoff or Backoff()
        self.objects: dict[Key, dict[str, Any]] = {}  # latest body from the watch
        if autoscaler is not None:
            autoscaler.share_bodies(self.objects)  # the body is kept once, here
        # (0: its spec is not reconciled yet, 1: anything else; arrival order; key):
        # new and changed objects go before status follow-ups and drift checks, so a
        # burst of them is not held up by their own children's events.
        self._queue: asyncio.PriorityQueue[tuple[int, int, Key]] = asyncio.PriorityQueue()
        self._arrivals = itertools.count()
        self._queued: set[Key] = set()
        self._urgent = 0  # queued keys of urgency 0
        # Per key: the generation whose children were applied with the status write
        # left for later (a burst of new objects: children first, statuses after).
        self._applied: dict[Key, int] = {}
        self._active: set[Key] = set()
        self._dirty: set[Key] = set()  # changed while being reconciled
        # The one pending retry of each key. A retry scheduled on top of another (an
        # event or a resync reconciled a failing key in between) replaces it: else
        # each such reconcile started one more chain of retries, for ever.
        self._retries: dict[Key, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task] = []
        # Keys whose last reconcile failed temporarily: one warning when a key starts
        # failing, quiet retries after it, one line when it recovers.
        self._failing: dict[Key, str] = {}

    # ------------------------------------------------------------ inputs

    def observe(self, body: dict[str, Any], event_type: str | None) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if event_type == "DELETED":
            self.objects.pop(key, None)
            self._applied.pop(key, None)
            self._cancel_retry(key)
            self.backoff.reset(key)
            self._failing.pop(key, None)
            if self.autoscaler:
                self.autoscaler.observe(key, None)
            return
        previous = self.objects.get(key)
        self.objects[key] = body
        if self.autoscaler:
            self.autoscaler.observe(key, body)
        if previous is None or not only_status_changed(previous, body):
            self.enqueue(key)

    def enqueue(self, key: Key, delay: float = 0.0) -> None:
        if delay > 0:
            self._cancel_retry(key)
            self._retries[key] = asyncio.get_running_loop().call_later(delay, self._retry, key)
            return
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            urgency = self._urgency(key)
            self._urgent += urgency == 0
            self._queue.put_nowait((urgency, next(self._arrivals), key))
        metrics.QUEUE_DEPTH.set(len(self._queued))

    def _urgency(self, key: Key) -> int:
        body = self.objects.get(key) or {}
        observed = (body.get("status") or {}).get("observedGeneration")
        generation = (body.get("metadata") or {}).get("generation")
        return 0 if observed != generation and self._applied.get(key) != generation else 1

    def _retry(self, key: Key) -> None:
        self._retries.pop(key, None)
        self.enqueue(key)

    def _cancel_retry(self, key: Key) -> None:
        if (handle := self._retries.pop(key, None)) is not None:
            handle.cancel()

    # ------------------------------------------------------------ workers

    async def _work(self) -> None:
        while True:
            urgency, _, key = await self._queue.get()
            self._urgent -= urgency == 0
            self._queued.discard(key)
            body = self.objects.get(key)
            if body is None:
                continue
            self._active.add(key)
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._threads, self.reconciler.reconcile, body, self.bursting)
            except TemporaryError as exc:
                delay = self.backoff.next(key)
                self._temporary(key, str(exc), delay)
                metrics.RECONCILES.labels(outcome="retry").inc()
                self.enqueue(key, delay)
            except Rejected as exc:  # e.g. the status write itself: retrying cannot help
                log.warning("reconcile %s/%s: refused by the API server: %s", *key, exc)
                metrics.RECONCILES.labels(outcome="refused").inc()
                self.backoff.reset(key)
            except Exception:  # a bug: never let one object stop the loop
                delay = self.backoff.next(key)
                log.exception("reconcile %s/%s failed; retrying in %.0fs", *key, delay)
                metrics.RECONCILES.labels(outcome="error").inc()
                self.enqueue(key, delay)
            else:
                # The status write's answer: the next reconcile must not compare against
                # the status before it (the watch may not have delivered it yet), or it
                # writes it again, with its Events.
                written = getattr(result, "written", None)
                if written is not None and key in self.objects and \
                        older(self.objects[key], written):
                    self.objects[key] = written
                if getattr(result, "deferred", False):
                    self._applied[key] = (body.get("metadata") or {}).get("generation")
                    self._dirty.add(key)  # the status: after the urgent keys
                else:
                    self._applied.pop(key, None)
                if self._failing.pop(key, None) is not None:
                    log.info("reconcile %s/%s: recovered", *key)
                if result.requeue_after is not None:
                    self.enqueue(key, max(result.requeue_after, self.backoff.next(key)))
                else:
                    self.backoff.reset(key)
                    self._cancel_retry(key)
            finally:
                self._active.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)

    def _temporary(self, key: Key, message: str, delay: float) -> None:
        """Log a temporary failure: a warning when the key starts failing (or fails
        differently), debug while it keeps failing the same way."""
        kind = message.split(": ", 1)[-1].split(" (")[0][:80]  # the path varies, not this
        if self._failing.get(key) != kind:
            log.warning("reconcile %s/%s: %s; retrying with back-off", *key, message)
        else:
            log.debug("reconcile %s/%s: still failing; retrying in %.0fs", *key, delay)
        self._failing[key] = kind

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            for key in list(self.objects):
                # A key in back-off is already queued for later: resync must not
                # turn its back-off into a retry every resync period.
                if key not in self._failing:
                    self.enqueue(key)

    async def _rediscover(self) -> None:
        """GIE's InferencePool CRD may be installed or removed while the operator runs:
        ask every discovery_seconds, and when it came or went (here or in a reconcile's
        own discovery), reconcile every object, so each gets its pool, or a status that
        says it has none, without a restart."""
        seen = 0
        while True:
            try:
                changes = await asyncio.get_running_loop().run_in_executor(
                    self._threads, self.reconciler.recheck_routing)
            except TemporaryError as exc:  # an outage: the reconciles report it
                log.debug("discovery of the InferencePool API failed: %s", exc)
            except Exception:  # a bug: logged, and the loop goes on
                log.exception("discovery of the InferencePool API failed")
            else:
                if changes != seen:
                    seen = changes
                    log.info("the InferencePool API came or went; reconciling every object")
                    for key in list(self.objects):
                        self.enqueue(key)
            await asyncio.sleep(self.discovery_seconds)

    @property
    def bursting(self) -> bool:
        """New or changed objects wait in the queue: their children go before anything
        that can wait (statuses, Events)."""
        return self._urgent > 0

    @property
    def leading(self) -> bool:
        return bool(self._tasks)

    def start(self) -> None:
        """Start reconciling (and autoscaling): on start-up without leader election,
        or when this replica becomes the leader. Every known object is reconciled
        once, since a standby kept its cache but reconciled nothing."""
        if self._tasks:
            return
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self.workers)]
        self._tasks.append(asyncio.create_task(self._resync()))
        if getattr(self.reconciler, "endpoint_picker", None) is not None:
            self._tasks.append(asyncio.create_task(self._rediscover()))
        for key in list(self.objects):
            self.enqueue(key)
        if self.autoscaler:
            self.autoscaler.activate()

    def pause(self) -> None:
        """Stop reconciling and autoscaling (this replica stopped leading); the watches
        keep the cache fresh. A reconcile already running in a thread finishes, but its
        writes are refused by the Kube gate, which no longer allows them."""
        if self.autoscaler:
            self.autoscaler.deactivate()
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        for key in list(self._retries):
            self._cancel_retry(key)
        self._failing.clear()
        self.backoff.failures.clear()
        self._applied.clear()

    async def stop(self) -> None:
        if self.autoscaler:
            await self.autoscaler.stop()
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)
