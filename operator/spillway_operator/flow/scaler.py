"""The autoscaler loop: one task per InferenceDeployment.

Every ``intervalSeconds`` it scrapes the ready pods' /metrics concurrently
(bounded, with timeouts), computes offload pressure (``pressure``), exports it as
``spillway_offload_pressure`` on the operator's /metrics, and - only when
``spec.autoscaling.enabled`` - decides and writes the replica count through the
InferenceDeployment's scale subresource (the one writer of spec.replicas; the
reconciler carries it to the Deployment). Status and Events record each decision.

Before a scale-down is written, the pods that should go (the least hot host cache,
``pressure.choose_removals``) get a low ``controller.kubernetes.io/pod-deletion-cost``,
so the ReplicaSet controller removes exactly them, and ``spillway.dev/draining``, so
routers stop sending them new requests. Marks on live pods that are no longer going
(the scale write failed, the decision was reversed) are removed at the next tick.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from spillway_operator.flow import disk_health, render
from spillway_operator.flow.pools import POOL_LABEL, removals
from spillway_operator.flow.pressure import (
    BACKLOG_DRAIN_SECONDS,
    DELETION_COST,
    DRAINING,
    Aggregate,
    Candidate,
    MetricsError,
    PodPressure,
    Policy,
    Rates,
    Sample,
    State,
    Unmeasured,
    aggregate,
    choose_removals,
    decide,
    hot_host_tokens,
    parse_body,
    parse_cost,
    pod_rates,
    pod_reading,
    removal_cost,
    resume_state,
    stale_marks,
    startup_seconds,
)
from spillway_operator.flow.spec import InferenceDeploymentSpec
from spillway_operator.flow.status import merge_patch, read_status, to_wire
from spillway_operator.flow.status_model import AutoscalingStatus, DiskTierStatus
from spillway_operator.flow.throughput import (
    Capacity,
    Learner,
    capacity,
    learn,
    learner,
    params_from_name,
    seed_cost,
)
from spillway_operator.names import LWS_GROUP_INDEX
from spillway_operator.plumbing import metrics
from spillway_operator.plumbing.kube import Kube, NamespaceTerminating, TemporaryError, now_rfc3339

log = logging.getLogger("spillway.scaler")

SCRAPE_TIMEOUT = 3.0
SCRAPE_CONCURRENCY = 16
# vLLM's /metrics is some 100 KiB (a few MiB with many LoRAs and DP ranks); a body
# past this is a broken or hostile pod, refused before any parsing.
MAX_METRICS_BYTES = 4 * 2**20
# Parsing is pure Python: it runs on its own small pool, off the event loop (whose
# liveness endpoint and watches must keep answering) and off the reconcilers' pool.
PARSE_TIMEOUT = 2.0
PARSE_WORKERS = 2
MAX_LISTED_PROBLEMS = 5


class PolicyError(Exception):
    """The scaling policy (the pure code of ``pressure``) raised: this tick takes no
    scaling action, status says so (ScalingActive=False, PolicyFailed), one log line."""


def _policy(fn: Any, *args: Any) -> Any:
    """Run a pure policy function; whatever it raises becomes a PolicyError naming it."""
    try:
        return fn(*args)
    except Exception as exc:
        raise PolicyError(f"{fn.__name__}: {type(exc).__name__}: {exc}"[:300]) from exc


@dataclass(frozen=True)
class Scrape:
    """One pod's scrape: the body, or why there is none (``reason`` is a metric label)."""

    pod: str
    body: bytes | None = None
    reason: str | None = None
    message: str = ""


def policy_of(spec: InferenceDeploymentSpec) -> Policy:
    """The spec's autoscaling as the decision's Policy (the spec's defaults are Policy's;
    the fields the CRD does not expose keep Policy's defaults)."""
    a = spec.autoscaling
    return Policy(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        target=a.target_pressure,
        tolerance=a.tolerance,
        scale_up_window=a.scale_up_stabilization_seconds,
        scale_down_window=a.scale_down_stabilization_seconds,
        rate_half_life=a.rate_half_life_seconds,
        forecast_window=a.forecast_window_seconds,
        serving_rate_half_life=a.serving_rate_half_life_seconds,
    )


def _ready(pod: dict[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _started(pod: dict[str, Any]) -> tuple[str | None, str | None]:
    """(created, first Ready) of a pod that never restarted; (None, None) otherwise: a
    restarted pod's Ready time is its last start's, not its creation's."""
    status = pod.get("status") or {}
    if any((c.get("restartCount") or 0) > 0 for c in status.get("containerStatuses") or []):
        return None, None
    ready = next((c.get("lastTransitionTime") for c in status.get("conditions") or []
                  if c.get("type") == "Ready" and c.get("status") == "True"), None)
    return pod.get("metadata", {}).get("creationTimestamp"), ready


def _annotation(pod: dict[str, Any], name: str) -> str | None:
    return (pod.get("metadata", {}).get("annotations") or {}).get(name)


def _group_index(meta: dict[str, Any]) -> int | None:
    """A LeaderWorkerSet pod's group index (None: not one, or a label not a number)."""
    value = (meta.get("labels") or {}).get(LWS_GROUP_INDEX)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


Key = tuple[str, str]


@dataclass(eq=False)
class Tracked:
    """Everything the autoscaler keeps about one InferenceDeployment: created when the
    object is first observed, dropped when it is deleted (``Autoscaler.observe``), its
    readings reset when this replica starts leading (``fresh``). The object's body is
    not here: it is kept once, in ``Autoscaler.bodies`` (the controller's)."""

    task: asyncio.Task | None = None
    # The last scrape of each ready pod: the next one's pair (pressure.pod_reading).
    samples: dict[str, Sample] = field(default_factory=dict)
    # The decision's windows (pressure.State); None: start from what is observed.
    state: State | None = None
    # Per pod: recent host-tier hits (pressure.hot_host_tokens), for scale-down.
    hot: dict[str, float] = field(default_factory=dict)
    # The deployment's serving rate, learned from its pods (throughput.learn), and the
    # (GPU, parameters per GPU) its seed was made for.
    learner: Learner | None = None
    seeded_for: tuple[str | None, float | None] | None = None
    # The ready pods of the last tick that could not be measured, and why (status).
    problems: list[str] = field(default_factory=list)
    # Pods in a bad-counter episode (restart, broken histogram...): name -> reason.
    bad_pods: dict[str, str] = field(default_factory=dict)
    capacity: Capacity | None = None  # the serving rate of the last tick (status)
    # Per pod: its disk-tier counters (disk_health), and status.diskTier they make.
    disk: dict[str, disk_health.PodDisk] = field(default_factory=dict)
    disk_status: DiskTierStatus | None = None
    exported: bool = False  # spillway_offload_pressure has its series
    failing: bool = False  # the last tick failed (logged once per episode)
    policy_failing: bool = False  # the policy raised (logged once per episode)

    def fresh(self) -> None:
        """Forget the readings and windows: a new leader decides from what it observes."""
        self.samples, self.state, self.hot, self.learner = {}, None, {}, None
        self.seeded_for, self.bad_pods, self.capacity = None, {}, None
        self.disk = {}  # disk_status stays: it is rebuilt from the live status


class Autoscaler:
    def __init__(self, kube: Kube, port: int = render.ENGINE_PORT,
                 bodies: dict[Key, dict[str, Any]] | None = None):
        self.kube = kube
        self.port = port
        # Each object's latest body, kept once: the controller's own map when it shares
        # it (share_bodies), else the autoscaler's (observe fills it).
        self.bodies: dict[Key, dict[str, Any]] = bodies if bodies is not None else {}
        self._own_bodies = bodies is None
        self.objects: dict[Key, Tracked] = {}
        self._session: aiohttp.ClientSession | None = None
        self._parser = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="metrics-parse")
        # Loops run only while active: from activate() (Controller.start: on start-up
        # without election, or when this replica becomes the leader) until deactivate().
        # Objects are kept either way, so a standby knows them when it takes over.
        self.active = False

    def share_bodies(self, bodies: dict[Key, dict[str, Any]]) -> None:
        """Read the bodies from ``bodies`` (the controller's map of latest bodies, which
        it fills before it calls observe) instead of keeping a copy."""
        self.bodies, self._own_bodies = bodies, False

    @property
    def _tasks(self) -> dict[Key, asyncio.Task]:
        return {k: r.task for k, r in self.objects.items() if r.task is not None}

    def observe(self, key: Key, body: dict[str, Any] | None) -> None:
        if body is None:
            self._forget(key)
            return
        if self._own_bodies:
            self.bodies[key] = body
        rec = self.objects.setdefault(key, Tracked())
        # A new object's loop waits for its first reconcile (its status then has an
        # observedGeneration: the Deployment exists) and starts a while after it, as
        # the HPA's does: ticking at once read a Deployment and listed pods that did
        # not exist yet, and wrote a status, for each of a thousand new objects while
        # the reconciler was creating their children.
        if self.active and rec.task is None and \
                (body.get("status") or {}).get("observedGeneration"):
            rec.task = asyncio.create_task(self._loop(key, settle=True))

    def _forget(self, key: Key) -> None:
        """The object is gone: its loop, its record and its pressure series with it."""
        rec = self.objects.pop(key, None)
        if self._own_bodies:
            self.bodies.pop(key, None)
        if rec is None:
            return
        if rec.task is not None:
            rec.task.cancel()
        if rec.exported:
            metrics.OFFLOAD_PRESSURE.remove(*key)

    @staticmethod
    def _first_delay(interval: float) -> float:
        """A new object's wait before its first tick: half to one interval, at most 15 s."""
        return random.uniform(0.5, 1.0) * min(interval, 15.0)

    def activate(self) -> None:
        """Start a loop per known object, with fresh samples and windows: a new leader
        decides from what it observes from now on (see ``pressure.resume_state``), and
        the loops start spread over a second so their first scrapes do not come at once."""
        self.active = True
        for key, rec in self.objects.items():
            rec.fresh()
            if rec.task is None:
                rec.task = asyncio.create_task(self._loop(key, random.uniform(0, 1)))

    def deactivate(self) -> None:
        """Stop every loop (this replica stopped leading) and withdraw its pressure
        series: only the leader's /metrics carry spillway_offload_pressure."""
        self.active = False
        for key, rec in self.objects.items():
            if rec.task is not None:
                rec.task.cancel()
                rec.task = None
            rec.failing = rec.policy_failing = False
            if rec.exported:
                metrics.OFFLOAD_PRESSURE.remove(*key)
                rec.exported = False

    async def stop(self) -> None:
        tasks = [r.task for r in self.objects.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session:
            await self._session.close()
        self._parser.shutdown(wait=False, cancel_futures=True)

    async def _loop(self, key: Key, delay: float = 0.0, settle: bool = False) -> None:
        """``settle``: a new object, whose first tick waits ``_first_delay``."""
        if delay:
            await asyncio.sleep(delay)
        while True:
            interval = 15.0
            rec = self.objects.get(key)
            try:
                body = self.bodies.get(key)
                if body is None or rec is None:
                    return
                spec = InferenceDeploymentSpec.model_validate(body.get("spec") or {})
                interval = float(spec.autoscaling.interval_seconds)
                if settle:
                    settle = False
                    await asyncio.sleep(self._first_delay(interval))
                    continue  # the body as it is by then
                if self.kube.namespace_terminating(key[0]):
                    # It goes with its namespace: no scrape, no status, no scale.
                    await asyncio.sleep(interval)
                    continue
                await self.tick(key, body, spec, time.monotonic())
                if rec.failing:
                    rec.failing = False
                    log.info("autoscaler %s/%s: recovered", *key)
            except asyncio.CancelledError:
                raise
            except ValidationError:
                pass  # the reconciler reports a bad spec
            except NamespaceTerminating:
                pass  # its namespace began to go during the tick: nothing to report
            except ApiException as exc:
                if exc.status != 404:  # 404: deleted meanwhile; its DELETED event stops us
                    log.exception("autoscaler %s/%s: tick failed", *key)
            except TemporaryError as exc:  # API server away: one line, then quiet
                if rec is not None and not rec.failing:
                    log.warning("autoscaler %s/%s: %s; retrying every %.0fs", *key, exc,
                                interval)
                    rec.failing = True
            except Exception:  # one traceback per episode, not one per interval
                if rec is not None and not rec.failing:
                    log.exception("autoscaler %s/%s: tick failed; retrying every %.0fs",
                                  *key, interval)
                    rec.failing = True
            await asyncio.sleep(interval)

    async def _scrape(self, pod: str, ip: str) -> Scrape:
        """GET the pod's /metrics: a capped body, or why not. Never raises for the
        pod's own failings (slow, huge, refused, broken)."""
        if self._session is None:
            # No transparent decompression: a small gzip body must not turn into a
            # huge one past the cap.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT), auto_decompress=False)
        url = f"http://{ip}:{self.port}/metrics"
        try:
            async with self._session.get(url, headers={"Accept-Encoding": "identity"}) as resp:
                if resp.status != 200:
                    return Scrape(pod, reason="http", message=f"HTTP {resp.status}")
                too_large = Scrape(pod, reason="too_large",
                                   message=f"body over {MAX_METRICS_BYTES} bytes")
                if (resp.content_length or 0) > MAX_METRICS_BYTES:
                    return too_large
                body = bytearray()
                async for chunk in resp.content.iter_chunked(64 * 1024):
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        return too_large
                return Scrape(pod, body=bytes(body))
        except TimeoutError:
            return Scrape(pod, reason="timeout", message=f"no full answer in {SCRAPE_TIMEOUT:g}s")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return Scrape(pod, reason="unreachable", message=type(exc).__name__)

    async def _parse(self, scrape: Scrape, now: float) -> Sample:
        """The scrape's Sample, parsed on the parse pool within PARSE_TIMEOUT."""
        if scrape.body is None:
            raise MetricsError(scrape.reason or "unreachable", scrape.message)
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._parser, parse_body, scrape.body, now), PARSE_TIMEOUT)
        except TimeoutError:
            raise MetricsError("parse_timeout", f"parsing took over {PARSE_TIMEOUT:g}s") from None

    def _record(self, key: Key) -> Tracked:
        """The object's record; one for an object ticked without being observed (a
        test, a tick racing a deletion) lives as long as the object does not go."""
        return self.objects.setdefault(key, Tracked())

    async def tick(self, key: Key, body: dict[str, Any], spec: InferenceDeploymentSpec,
                   now: float) -> None:
        ns, name = key
        rec = self._record(key)
        owner = render.Owner(name, ns, body["metadata"]["uid"])
        pods = await asyncio.to_thread(self.kube.pods_of, ns, name, render.selector_string(owner))
        # A multi-node replica is its group's leader: workers export no engine metrics.
        live = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")
                and render.serves(p)]
        ready = [p for p in live if _ready(p) and p.get("status", {}).get("podIP")]
        failed: PolicyError | None = None
        try:
            agg = await self._measure(key, ready, spec, now, body)
        except PolicyError as exc:
            agg, failed = Aggregate(None, {}, 0, len(ready)), exc
        if agg.pressure is not None:
            metrics.OFFLOAD_PRESSURE.labels(ns, name).set(agg.pressure)
            rec.exported = True

        current = int(body.get("spec", {}).get("replicas", spec.replicas))
        marked: list[str] = []
        desired, decision, reason, term = current, "disabled", "autoscaling is off", None
        if spec.autoscaling.enabled and failed is None:
            starting = len(live) - len(ready)
            try:
                desired, decision, reason, term, marked = await self._scale(
                    key, body, spec, now, current, live, ready, starting, agg)
            except PolicyError as exc:
                failed = exc
        if failed is not None:
            if spec.autoscaling.enabled:
                desired, decision, term = current, "hold", None
                reason = f"PolicyFailed: {failed}; replicas held until the policy recovers"
            if not rec.policy_failing:
                rec.policy_failing = True
                log.error("autoscaler %s/%s: the scaling policy failed (%s); holding "
                          "replicas at %d", ns, name, failed, current)
                log.debug("autoscaler %s/%s: policy traceback", ns, name, exc_info=failed)
        elif rec.policy_failing:
            rec.policy_failing = False
            log.info("autoscaler %s/%s: the scaling policy recovered", ns, name)
        await self._unmark_stale(ns, live, desired, marked)
        status = body.get("status") or {}
        old = read_status(status).autoscaling or AutoscalingStatus()
        await self._write_status(key, status.get("autoscaling") or {}, old, agg, desired,
                                 decision, reason, term, status.get("diskTier"))

    def _learner(self, rec: Tracked, spec: InferenceDeploymentSpec,
                 body: dict[str, Any]) -> Learner:
        """The deployment's serving-rate learner, seeded from the plan's GPU and the
        model's size (the emulated GPU's, when it states one), per GPU of a replica's
        tensor/pipeline-parallel engine; a new seed when either changes."""
        plan = (body.get("status") or {}).get("plan") or {}
        gpu = plan.get("gpu") or spec.resources.gpu_product.lower()
        emulated = spec.engine.emulate_gpu
        params = (emulated.model_params if emulated is not None else None) or \
            params_from_name(spec.model.name)
        if params is not None:
            params /= spec.engine.tensor_parallel_size * spec.engine.pipeline_parallel_size
        if rec.learner is None or rec.seeded_for != (gpu, params):
            rec.learner, rec.seeded_for = learner(seed_cost(gpu, params)), (gpu, params)
        return rec.learner

    async def _measure(self, key: Key, ready: list[dict[str, Any]],
                       spec: InferenceDeploymentSpec, now: float,
                       body: dict[str, Any] | None = None) -> Aggregate:
        """Scrape the ready pods and turn this and the last scrape into pressure.

        A pod whose metrics cannot be read or parsed, or whose counters cannot be
        trusted (a restart, a histogram that lost buckets, a rate of 0 or NaN), counts
        as unmeasured (listed in the record's ``problems``, one log line per episode of
        bad counters) and teaches the serving rate nothing; the other pods are measured
        as usual.
        """
        rec = self._record(key)
        sem = asyncio.Semaphore(SCRAPE_CONCURRENCY)

        async def one(pod: dict[str, Any]) -> tuple[str, Sample | MetricsError]:
            name = pod["metadata"]["name"]
            async with sem:
                scrape = await self._scrape(name, pod["status"]["podIP"])
            try:
                return name, await self._parse(scrape, now)
            except MetricsError as exc:
                return name, exc

        results = await asyncio.gather(*(one(p) for p in ready))
        prev, hot = rec.samples, rec.hot
        tau = max(float(spec.autoscaling.scale_down_stabilization_seconds),
                  4 * float(spec.autoscaling.interval_seconds))
        max_dt = 3 * float(spec.autoscaling.interval_seconds) + SCRAPE_TIMEOUT
        cur = {n: r for n, r in results if isinstance(r, Sample)}
        listed = (read_status((body or {}).get("status")).disk_tier or DiskTierStatus())
        rec.disk, rec.disk_status = disk_health.assess(
            rec.disk, cur, [p["metadata"]["name"] for p in ready],
            listed.failing_pods or [], now,
            disk_health.hold_seconds(float(spec.autoscaling.interval_seconds)))
        served = [_policy(pod_rates, prev.get(n), s, max_dt) for n, s in cur.items()]
        state = _policy(learn, self._learner(rec, spec, body or {}), now,
                        [r for r in served if isinstance(r, Rates)],
                        float(spec.autoscaling.serving_rate_half_life_seconds))
        rec.learner = state
        cap = _policy(capacity, state)
        # What waits is demand to clear within about one model load of this deployment.
        drain = _policy(startup_seconds, [_started(p) for p in ready]) or BACKLOG_DRAIN_SECONDS
        per_pod: list[PodPressure | Unmeasured] = []
        problems: list[str] = []
        bad: dict[str, str] = {}
        for pod_name, result in results:
            if isinstance(result, MetricsError):
                metrics.SCRAPE_FAILURES.labels(reason=result.reason).inc()
                problems.append(f"{pod_name}: {result}")
                per_pod.append(Unmeasured(result.reason, str(result), bad=True))
                continue
            reading = _policy(pod_reading, prev.get(pod_name), result, max_dt, cap, drain)
            if isinstance(reading, Unmeasured) and reading.bad:
                problems.append(f"{pod_name}: {reading.message}")
                bad[pod_name] = reading.reason
            per_pod.append(reading)
            hot[pod_name] = _policy(hot_host_tokens, hot.get(pod_name, 0.0),
                                    prev.get(pod_name), result, tau)
        self._log_bad_counters(key, rec, bad, cur)
        rec.samples = cur
        # Kept while a pod is unmeasured for a tick; gone with the pod.
        rec.hot = {p["metadata"]["name"]: hot.get(p["metadata"]["name"], 0.0) for p in ready}
        rec.problems = problems
        rec.capacity = cap
        return _policy(aggregate, per_pod)

    @staticmethod
    def _log_bad_counters(key: Key, rec: Tracked, bad: dict[str, str],
                          measured: dict[str, Sample]) -> None:
        """One line when a pod's counters go bad (a restart, a broken histogram...), one
        when they are good again; quiet in between and for pods that went away."""
        for pod, reason in bad.items():
            if pod not in rec.bad_pods:
                log.warning("autoscaler %s/%s: pod %s unmeasured: %s; it scales nothing "
                            "until its counters are good again", *key, pod, reason)
        for pod in set(rec.bad_pods) - set(bad):
            if pod in measured:
                log.info("autoscaler %s/%s: pod %s measured again", *key, pod)
        rec.bad_pods = bad

    async def _scale(self, key: Key, body: dict[str, Any], spec: InferenceDeploymentSpec,
                     now: float, current: int, live: list[dict[str, Any]],
                     ready: list[dict[str, Any]], starting: int, agg: Aggregate
                     ) -> tuple[int, str, str, str, list[str]]:  # fmt: skip
        """Decide, and write a changed replica count; returns (replicas, action, reason,
        the term behind it, the pods marked to go). A scale-down first marks the pods
        that should go, and unmarks them again when the scale write fails."""
        ns, name = key
        rec = self._record(key)
        state = rec.state
        if state is None:  # operator start or a new leader: windows start from now
            state = resume_state(now, current)
        policy = replace(policy_of(spec), lead_seconds=_policy(
            startup_seconds, [_started(p) for p in ready]))
        d = _policy(decide, policy, now, current, len(ready), starting, agg, state)
        rec.state = d.state
        marked: list[str] = []
        if d.replicas != current:
            if d.replicas < current:
                marked = await self._mark_pools(key, spec, live, ready, current, d.replicas)
            try:
                await asyncio.to_thread(self.kube.patch_scale, ns, name, d.replicas)
            except BaseException:
                await self._unmark(ns, marked, quiet=True)
                raise
            going = ""
            if marked:
                going = "; removing " + ", ".join(
                    f"{p} ({rec.hot.get(p, 0.0):.0f} recent host-hit tokens)" for p in marked)
            await asyncio.to_thread(
                self.kube.post_event, body, "Normal",
                "ScaledUp" if d.replicas > current else "ScaledDown",
                f"replicas {current} -> {d.replicas}: {d.reason}{going}")
            log.info("%s/%s: replicas %d -> %d (%s)", ns, name, current, d.replicas, d.reason)
        return d.replicas, d.action, d.reason, d.term, marked

    async def _mark_pools(self, key: Key, spec: InferenceDeploymentSpec,
                          live: list[dict[str, Any]], ready: list[dict[str, Any]],
                          current: int, desired: int) -> list[str]:
        """_mark, within each GPU pool whose share shrinks (its workload removes pods)."""
        if not spec.resources.gpu_pools:
            return await self._mark(key, live, ready, len(live) - desired)
        marked: list[str] = []
        for pool, give_up in removals(spec, current, desired).items():
            mine = [p for p in live if (p["metadata"].get("labels") or {}).get(POOL_LABEL) == pool]
            marked += await self._mark(key, mine, [p for p in ready if p in mine], give_up)
        return marked

    async def _mark(self, key: Key, live: list[dict[str, Any]],
                    ready: list[dict[str, Any]], remove: int) -> list[str]:
        """Mark the ready pods that a scale-down taking ``remove`` of ``live`` should
        remove (a deletion cost below the kept pods', and draining); their names."""
        ns = key[0]
        rec = self._record(key)
        hot, samples = rec.hot, rec.samples
        ready_names = {p["metadata"]["name"] for p in ready}
        candidates = []
        for p in live:
            meta = p["metadata"]
            pod = meta["name"]
            sample = samples.get(pod)
            candidates.append(Candidate(
                name=pod, ready=pod in ready_names, hot=hot.get(pod, 0.0),
                host_tokens=sample.values.get("host_tokens", 0.0) if sample else 0.0,
                created=meta.get("creationTimestamp") or "",
                marked=_annotation(p, DRAINING) == "true",
                group=_group_index(meta)))
        chosen = _policy(choose_removals, candidates, remove)
        kept = [parse_cost(_annotation(p, DELETION_COST)) for p in live
                if p["metadata"]["name"] not in chosen]
        cost = str(removal_cost(kept))
        done: list[str] = []
        try:
            for pod in chosen:
                try:
                    await asyncio.to_thread(self.kube.annotate_pod, ns, pod,
                                            {DELETION_COST: cost, DRAINING: "true"})
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    continue  # gone meanwhile: one fewer to mark
                done.append(pod)
        except BaseException:
            await self._unmark(ns, done, quiet=True)
            raise
        return done

    async def _unmark(self, ns: str, pods: list[str], quiet: bool = False) -> None:
        """Take our marks off ``pods``. ``quiet``: best effort, on the way out of a
        failed write (a mark left behind is stale and goes at the next tick)."""
        for pod in pods:
            try:
                await asyncio.to_thread(self.kube.annotate_pod, ns, pod,
                                        {DELETION_COST: None, DRAINING: None})
            except ApiException as exc:
                if exc.status != 404 and not quiet:
                    raise
            except Exception:
                if not quiet:
                    raise
                log.warning("%s/%s: scale-down mark left for the next tick", ns, pod)

    async def _unmark_stale(self, ns: str, live: list[dict[str, Any]], replicas: int,
                            chosen: list[str]) -> None:
        """Unmark live pods (as listed this tick) that no scale-down takes any more."""
        marked = [p["metadata"]["name"] for p in live if _annotation(p, DRAINING) == "true"]
        stale = stale_marks(marked, len(live), replicas, chosen)
        if stale:
            log.info("%s: unmarking %s (no scale-down takes them)", ns, ", ".join(stale))
            await self._unmark(ns, stale)

    async def _write_status(self, key: Key, live: dict[str, Any],
                            old: AutoscalingStatus, agg: Aggregate, desired: int,
                            decision: str, reason: str, term: str | None = None,
                            live_disk: dict[str, Any] | None = None) -> None:
        """Write status.autoscaling where it differs from ``live`` (what the API server
        holds), clearing what no longer holds (problems of a pod that recovered or is
        gone), and status.diskTier where it differs from ``live_disk`` (removed once no
        pod fails): steady state writes nothing."""
        if agg.pressure is not None:
            pressure = round(agg.pressure, 2)
            components = {k: round(v, 2) for k, v in agg.components.items()}
        else:  # keep the last known reading; the reason says why there is none now
            pressure = old.pressure
            components = old.components if old.pressure is not None else None
        rec = self._record(key)
        problems = rec.problems
        cap = rec.capacity
        new = AutoscalingStatus(
            pressure=pressure,
            components=components,
            # Like the pressure: the count behind the reading shown.
            measured_pods=agg.measured if agg.pressure is not None else old.measured_pods,
            unmeasured_pods=len(problems) or None,
            metrics_problems=[p[:200] for p in problems[:MAX_LISTED_PROBLEMS]] or None,
            desired_replicas=desired,
            last_decision=decision,
            last_decision_reason=reason,
            last_decision_term=term or None,
            serving_rate=None if cap is None else {
                "prefillTokensPerSecond": round(cap.prefill_tokens_per_s),
                "decodeTokensPerSecond": round(cap.decode_tokens_per_s),
                "maxBatch": round(cap.max_batch, 1),
                "learnedIntervals": round(cap.learned, 1)},
            last_scale_time=now_rfc3339() if decision in ("scale-up", "scale-down")
            else old.last_scale_time,
        )
        body: dict[str, Any] = {}
        if patch := merge_patch(live, to_wire(new)):
            log.debug("%s/%s: status.autoscaling patch of %s", *key, ", ".join(patch))
            body["autoscaling"] = patch
        disk = None if rec.disk_status is None else to_wire(rec.disk_status)
        if disk is None and live_disk is not None:
            body["diskTier"] = None  # no pod fails any more
        elif disk is not None and (
                changed := disk if live_disk is None else merge_patch(live_disk, disk)):
            body["diskTier"] = changed
        if body:
            await asyncio.to_thread(self.kube.patch_status, key[0], key[1], body)
