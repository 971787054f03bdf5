"""Leader election on a ``coordination.k8s.io/v1`` Lease.

Several operator replicas run at once; only the one holding the Lease reconciles,
autoscales and writes. The rules are the ones Kubernetes' own controllers follow:

- every ``retry_period`` a candidate reads the Lease. It takes it when nobody holds
  it, when the holder released it (empty holder), or when the record has not changed
  for ``lease_duration`` seconds *of the candidate's own clock*, counted from the moment
  the candidate first saw that record (never from the timestamps in the record, so
  clock skew between machines does not matter, only clock rate);
- the holder renews every ``retry_period``; writes are allowed only while its last
  successful renew was *sent* less than ``renew_deadline`` ago. A leader that cannot
  renew (API server unreachable, process paused) therefore stops writing at least
  ``lease_duration - renew_deadline`` seconds before any standby may take over: the
  standby's clock starts after the renew reached the server, the leader's before;
- every write of the Lease is an update with the record's resourceVersion, so two
  candidates racing for an expired Lease cannot both win (one gets 409 Conflict);
- on a clean shutdown the holder releases the Lease (empty holder, 1 s duration) so a
  standby takes over at its next retry instead of after ``lease_duration``.

The decisions are pure functions of (the Lease as last read, when it was first seen,
now); ``LeaderElector`` is the thin loop that performs them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from spillway_operator.plumbing import metrics

log = logging.getLogger("spillway.leader")

LEASE_API = "coordination.k8s.io/v1"
# Candidates that are not leading wait a random part of this factor more than the
# retry period, so replicas started together do not ask in lockstep.
JITTER = 0.2


@dataclass(frozen=True)
class LeaseTiming:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.lease_duration > self.renew_deadline:
            raise ValueError(f"lease duration ({self.lease_duration:g}s) must be longer than "
                             f"the renew deadline ({self.renew_deadline:g}s)")
        if not self.renew_deadline > (1 + JITTER) * self.retry_period:
            raise ValueError(f"renew deadline ({self.renew_deadline:g}s) must be longer than "
                             f"{1 + JITTER:g} x the retry period ({self.retry_period:g}s)")
        if self.retry_period <= 0:
            raise ValueError("retry period must be positive")


@dataclass(frozen=True)
class Election:
    """Where and as whom this process stands for election (from the command line)."""

    namespace: str
    name: str
    identity: str
    timing: LeaseTiming = LeaseTiming()


@dataclass(frozen=True)
class Record:
    """The fields of a Lease's spec that election reads and writes."""

    holder: str = ""
    duration: int = 15
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0


@dataclass(frozen=True)
class Seen:
    """The Lease as last read: its record, its resourceVersion, and the local monotonic
    time at which this record (not merely this read) was first seen."""

    record: Record
    resource_version: str
    since: float


@dataclass(frozen=True)
class Step:
    """What a candidate does now: ``create`` or ``update`` the Lease with ``record``,
    or ``follow`` (someone else holds a valid Lease)."""

    action: str
    record: Record | None = None


def micro_time(when: datetime | None = None) -> str:
    """A Lease MicroTime: RFC 3339 with microseconds, UTC."""
    return (when or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record_of(lease: dict[str, Any]) -> Record:
    spec = lease.get("spec") or {}
    return Record(
        holder=spec.get("holderIdentity") or "",
        duration=int(spec.get("leaseDurationSeconds") or 0),
        acquire_time=spec.get("acquireTime"),
        renew_time=spec.get("renewTime"),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


def lease_spec(record: Record) -> dict[str, Any]:
    return {
        "holderIdentity": record.holder,
        "leaseDurationSeconds": record.duration,
        "acquireTime": record.acquire_time,
        "renewTime": record.renew_time,
        "leaseTransitions": record.transitions,
    }


def seen(previous: Seen | None, record: Record, resource_version: str, now: float) -> Seen:
    """Remember a read: the clock of a record restarts only when the record changed."""
    if previous is not None and previous.record == record:
        return replace(previous, resource_version=resource_version)
    return Seen(record, resource_version, now)


def expired(s: Seen, now: float) -> bool:
    return now >= s.since + s.record.duration


def decide(identity: str, current: Seen | None, now: float, wall: str,
           timing: LeaseTiming) -> Step:
    """The next step of candidate ``identity``, given the Lease as last seen."""
    duration = max(1, round(timing.lease_duration))
    if current is None:
        return Step("create", Record(identity, duration, wall, wall, 0))
    rec = current.record
    if rec.holder == identity:
        return Step("update", replace(rec, duration=duration, renew_time=wall))
    if rec.holder and not expired(current, now):
        return Step("follow")
    # Free (released) or expired: take it over.
    return Step("update", Record(identity, duration, wall, wall, rec.transitions + 1))


def may_write(renewed_at: float | None, now: float, timing: LeaseTiming) -> bool:
    """Whether a leader whose last successful renew was sent at ``renewed_at`` may still
    write: only before its renew deadline."""
    return renewed_at is not None and now - renewed_at < timing.renew_deadline


def default_identity(pod_name: str | None = None) -> str:
    """``<pod or host name>_<random>``: unique even for two processes on one host."""
    return f"{pod_name or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class LeaseClient:
    """get / create / update of one Lease through the operator's Kube (its own
    ApiClient and connection pool, so renewals never queue behind reconciles)."""

    def __init__(self, kube: Any, namespace: str, name: str):
        from spillway_operator.plumbing.kube import api_path

        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.collection = f"{api_path(LEASE_API)}/namespaces/{namespace}/leases"
        self.path = f"{self.collection}/{name}"

    def get(self, timeout: float) -> tuple[Record, str] | None:
        lease = self.kube.get(self.path, gated=False, timeout=timeout)
        if lease is None:
            return None
        return record_of(lease), lease["metadata"]["resourceVersion"]

    def create(self, record: Record, timeout: float) -> str:
        lease = self.kube.request(
            "post", self.collection, gated=False, timeout=timeout,
            body={"apiVersion": LEASE_API, "kind": "Lease",
                  "metadata": {"name": self.name, "namespace": self.namespace},
                  "spec": lease_spec(record)})
        return lease["metadata"]["resourceVersion"]

    def update(self, record: Record, resource_version: str, timeout: float) -> str:
        lease = self.kube.request(
            "put", self.path, gated=False, timeout=timeout,
            body={"apiVersion": LEASE_API, "kind": "Lease",
                  "metadata": {"name": self.name, "namespace": self.namespace,
                               "resourceVersion": resource_version},
                  "spec": lease_spec(record)})
        return lease["metadata"]["resourceVersion"]


class LeaderElector:
    """The election loop. ``on_started`` runs when this process becomes the leader,
    ``on_stopped`` when it stops being one (renew deadline passed, Lease lost or
    released); both are plain functions called on the event loop."""

    def __init__(self, client: LeaseClient, identity: str, timing: LeaseTiming,
                 on_started: Callable[[], None], on_stopped: Callable[[], None],
                 clock: Callable[[], float] | None = None):
        import time

        self.client = client
        self.identity = identity
        self.timing = timing
        self.on_started = on_started
        self.on_stopped = on_stopped
        self.clock = clock or time.monotonic
        self.leading = False
        self.renewed_at: float | None = None
        self.current: Seen | None = None
        self.leader: str | None = None  # the holder last seen
        self.origin = ""  # how this candidate last got the Lease, for the log
        # One thread of its own: the default pool may be full of reconciles.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lease")
        self._failing = False
        metrics.LEADER.set(0)

    # ------------------------------------------------------------ the write gate

    def may_write(self) -> bool:
        """The gate every write of the operator passes (Kube.request)."""
        return self.leading and may_write(self.renewed_at, self.clock(), self.timing)

    # ------------------------------------------------------------ one round

    def try_once(self) -> None:
        """Read the Lease, then create, renew, take over or follow (blocking I/O)."""
        from spillway_operator.plumbing.kube import Rejected, TemporaryError

        timeout = self.timing.renew_deadline / 2
        sent = self.clock()
        try:
            got = self.client.get(timeout)
            now = self.clock()
            self.current = (None if got is None
                            else seen(self.current, got[0], got[1], now))
            step = decide(self.identity, self.current, now, micro_time(), self.timing)
            if step.action == "follow":
                self._note_holder(self.current.record.holder if self.current else None)
                return
            assert step.record is not None
            held = self.current.record.holder if self.current else None
            sent = self.clock()  # the write's send time bounds the new deadline
            if step.action == "create":
                rv = self.client.create(step.record, timeout)
            else:
                assert self.current is not None
                rv = self.client.update(step.record, self.current.resource_version, timeout)
            self.current = Seen(step.record, rv, self.clock())
            self.renewed_at = sent
            if held != self.identity:
                self.origin = ("a new lease" if held is None else "the lease was released"
                               if not held else f"the lease of {held} expired")
            elif not self.leading:  # still its own, renewed after the deadline passed
                self.origin = "renewed its own lease after missing the renew deadline"
            self._note_holder(self.identity)
            if self._failing:
                log.info("lease %s/%s: reachable again", self.client.namespace,
                         self.client.name)
                self._failing = False
        except (TemporaryError, Rejected, ApiException) as exc:
            # 409: another candidate wrote first; anything else: try again next round.
            status = getattr(exc, "status", None)
            if status != 409 and not self._failing:
                log.warning("lease %s/%s: %s", self.client.namespace, self.client.name,
                            str(exc).splitlines()[0][:300])
                self._failing = True

    def _note_holder(self, holder: str | None) -> None:
        if holder != self.leader:
            if holder and holder != self.identity:
                log.info("lease %s/%s: the leader is %s; standing by", self.client.namespace,
                         self.client.name, holder)
            self.leader = holder

    # ------------------------------------------------------------ transitions

    def check(self) -> None:
        """Start or stop leading, as the Lease and the renew deadline now say."""
        fresh = self.leader == self.identity and may_write(self.renewed_at, self.clock(),
                                                           self.timing)
        if fresh and not self.leading:
            self.leading = True
            metrics.LEADER.set(1)
            log.info("became the leader: %s holds lease %s/%s (%s)", self.identity,
                     self.client.namespace, self.client.name, self.origin)
            self.on_started()
        elif self.leading and not fresh:
            self.leading = False
            metrics.LEADER.set(0)
            if self.leader != self.identity:
                why = f"the lease is held by {self.leader or 'nobody'}"
            else:
                why = f"no renew within the renew deadline ({self.timing.renew_deadline:g}s)"
            log.warning("stopped leading lease %s/%s: %s; writes stop now",
                        self.client.namespace, self.client.name, why)
            self.on_stopped()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        watchdog = asyncio.create_task(self._watchdog())
        try:
            while True:
                await loop.run_in_executor(self._pool, self.try_once)
                self.check()
                period = self.timing.retry_period
                if not self.leading:
                    period *= 1 + random.uniform(0, JITTER)
                await asyncio.sleep(period)
        finally:
            watchdog.cancel()

    async def _watchdog(self) -> None:
        """Stops leading at the renew deadline even while a renew request hangs."""
        while True:
            await asyncio.sleep(min(0.25, self.timing.retry_period / 4))
            if self.leading:
                self.check()

    async def release(self) -> None:
        """On shutdown: stop leading, then hand the Lease over (empty holder)."""
        was_leading = self.leading
        self.renewed_at = None
        self.check()
        if not was_leading or self.current is None:
            return
        rec = replace(self.current.record, holder="", duration=1, renew_time=micro_time())
        loop = asyncio.get_running_loop()

        def put() -> None:
            from spillway_operator.plumbing.kube import Rejected, TemporaryError

            try:
                assert self.current is not None
                self.client.update(rec, self.current.resource_version, 5)
                log.info("released lease %s/%s", self.client.namespace, self.client.name)
            except (TemporaryError, Rejected, ApiException) as exc:
                log.warning("could not release lease %s/%s: %s", self.client.namespace,
                            self.client.name, exc)
        await loop.run_in_executor(self._pool, put)
