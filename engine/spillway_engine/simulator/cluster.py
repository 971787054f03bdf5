"""Several simulated replicas in one virtual clock, for autoscaling benchmarks.

:class:`VirtualCluster` routes requests to replicas (round-robin or prefix-affinity on
the request's session, like the load generator), runs every replica's core up to a
common virtual time, scales the number of replicas up or down while traffic flows
(a removed replica takes no new requests and leaves once drained), and serves each
replica's ``/metrics`` text so the operator's autoscaler can be driven by exactly what
it would scrape from real pods — hours of traffic in seconds.

Example::

    cluster = VirtualCluster(plan, replicas=2, routing="prefix-affinity")
    def autoscale(c):  # called every `tick` virtual seconds
        texts = c.scrape_all()
        c.scale_to(decide(texts))
    cluster.replay(to_replay_items(generate_trace(spec)), tick=15.0, on_tick=autoscale)
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import generate_latest

from spillway_engine.simulator.core import (
    EngineCore,
    LatencyModel,
    ReplayItem,
    RequestRejected,
    SchedulerConfig,
    SimRequest,
)
from spillway_engine.simulator.plan_input import SimPlan
from spillway_engine.simulator.prom import SimulatorMetrics


@dataclass
class Replica:
    name: str
    core: EngineCore
    metrics: SimulatorMetrics
    draining: bool = False


class VirtualCluster:
    def __init__(
        self,
        plan: SimPlan,
        *,
        replicas: int = 1,
        routing: str = "round-robin",
        gpu_blocks: int | None = None,
        latency: LatencyModel | None = None,
        scheduler: SchedulerConfig | None = None,
        seed: int = 0,
        break_stalls: bool = False,
    ) -> None:
        if routing not in ("round-robin", "prefix-affinity"):
            raise ValueError(f"unknown routing {routing!r}")
        if replicas < 1:
            raise ValueError("a cluster needs at least one replica")
        self.plan = plan
        self.routing = routing
        self._kw = dict(gpu_blocks=gpu_blocks, latency=latency, scheduler=scheduler)
        self._seed = seed
        self._made = 0
        self._rr = 0
        self.now = 0.0
        self.replicas: list[Replica] = []
        self.retired: list[Replica] = []
        self.rejected = 0
        #: break a replica's stall (``EngineCore.break_stall``) instead of raising
        self.break_stalls = break_stalls
        #: stalls broken so far
        self.stalls = 0
        self.scale_to(replicas)

    # membership ----------------------------------------------------------------
    @property
    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if not r.draining]

    def _new_replica(self) -> Replica:
        core = EngineCore(self.plan, seed=self._seed + self._made, **self._kw)  # type: ignore[arg-type]
        core.advance_to(self.now)
        name = f"replica-{self._made}"
        self._made += 1
        return Replica(name, core, SimulatorMetrics(core, engine="0"))

    def scale_to(self, n: int) -> None:
        """Serve with ``n`` replicas: revive draining ones first, then start new ones;
        scaling down drains the newest replicas."""
        if n < 1:
            raise ValueError("a cluster needs at least one replica")
        serving = self.serving
        for r in self.replicas:
            if len(serving) >= n:
                break
            if r.draining:
                r.draining = False
                serving.append(r)
        while len(serving) < n:
            replica = self._new_replica()
            self.replicas.append(replica)
            serving.append(replica)
        for r in serving[n:]:
            r.draining = True
        self._reap()

    def _reap(self) -> None:
        for r in [r for r in self.replicas if r.draining and not r.core.has_work()]:
            self.replicas.remove(r)
            self.retired.append(r)

    # traffic -------------------------------------------------------------------
    def route(self, item: ReplayItem) -> Replica:
        serving = self.serving
        if self.routing == "prefix-affinity" and item.session is not None:
            return serving[zlib.crc32(item.session.encode()) % len(serving)]
        replica = serving[self._rr % len(serving)]
        self._rr += 1
        return replica

    def submit(self, item: ReplayItem) -> SimRequest | None:
        """Run the cluster up to the item's arrival, then queue it on a replica."""
        self.run_until(item.arrival)
        try:
            return self.route(item).core.add_request(
                item.prompt, item.max_tokens, item.arrival, item.rid
            )
        except RequestRejected:
            self.rejected += 1
            return None

    def run_until(self, t: float) -> None:
        """Advance every replica to virtual time ``t`` (a replica may end a step past it)."""
        for r in self.replicas:
            self.stalls += r.core.run_until(t, break_stalls=self.break_stalls)
        self.now = max(self.now, t)
        self._reap()

    def drain(self, limit: float = 1e9) -> None:
        """Run until every replica is idle (or virtual time ``limit``)."""
        while any(r.core.has_work() for r in self.replicas) and self.now < limit:
            self.run_until(self.now + 1.0)

    def replay(
        self,
        items: Iterable[ReplayItem],
        *,
        tick: float | None = None,
        on_tick: Callable[[VirtualCluster], None] | None = None,
    ) -> list[SimRequest]:
        """Submit ``items`` in arrival order, calling ``on_tick(self)`` every ``tick``
        virtual seconds; then drain. Returns the accepted requests."""
        accepted = []
        next_tick = tick if tick else None
        for item in sorted(items, key=lambda it: it.arrival):
            while next_tick is not None and next_tick <= item.arrival:
                self.run_until(next_tick)
                if on_tick is not None:
                    on_tick(self)
                next_tick += tick  # type: ignore[operator]
            req = self.submit(item)
            if req is not None:
                accepted.append(req)
        self.drain()
        return accepted

    # observation -----------------------------------------------------------------
    def scrape(self, replica: Replica) -> str:
        """The replica's ``/metrics`` text, as the HTTP server would serve it now."""
        replica.metrics.sync()
        return generate_latest(replica.metrics.registry).decode()

    def scrape_all(self) -> dict[str, str]:
        return {r.name: self.scrape(r) for r in self.replicas}
