"""The OpenAI-compatible proxy: parse, route (pure scoring), forward, retry.

State changes come from three places: the backend source (static list or pod
watch), each pod's KV events, and probes of each pod's /health and /metrics. The
request path reads that state, calls :func:`scoring.choose`, and streams the pod's
answer through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import Counter as PCounter
from prometheus_client.parser import text_string_to_metric_families

from .backends import EVENTS_FROM_POD, Backend
from .events import DROP_REASONS, SOURCES_PATH, EventFeed, event_endpoints, subscribe
from .hashing import BlockHasher, HashConfig
from .index import TIERS, ApproxTracker, Match, PrefixIndex
from .rates import PoolRates
from .scoring import DEFAULT_BALANCE, DISK_LOAD_FACTOR, PodState, Ring, choose, cold_key
from .tokens import BadRequest, Prompt, Tokenizer, prompt_of, text_keys

log = logging.getLogger("spillway.router")

MAX_BODY = 32 * 1024 * 1024
#: the router's own estimate of text characters per token (approximate text keys)
CHARS_PER_TOKEN = 4
_HOP = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
    "trailer", "upgrade", "proxy-authorization", "proxy-authenticate",
}  # fmt: skip


@dataclass
class RouterConfig:
    mode: str = "events"  # "events" (approximate where a pod publishes none) | "approx"
    hash_algorithm: str = "sha256"
    hash_seed: str | None = None
    balance: float = DEFAULT_BALANCE
    host_bandwidth: float = 25e9
    prefill_s_per_token: float = 1e-4
    wait_s_per_request: float = 0.05
    disk_load_factor: float = DISK_LOAD_FACTOR
    max_attempts: int = 3
    probe_interval_s: float = 2.0
    eject_s: float = 5.0
    connect_timeout_s: float = 5.0
    # A pod that fails this many health probes in a row has its open answers cut: a
    # partitioned pod sends neither bytes nor a reset, so its streams would hang.
    dead_after_probes: int = 2
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)


class Refused(Exception):
    """A request the router answers itself, with an OpenAI-style error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Routed:
    prompt: Prompt
    candidates: list[Backend]  # best first
    keys: list[int]  # the prompt's block keys, for RouterState.served


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    kind = kind or {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError"}.get(
        status, "ServiceUnavailableError"
    )
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def error(status: int, message: str, kind: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, kind), status=status)


def parse_pod_metrics(text: str) -> tuple[float, int | None]:
    """(waiting + running requests, GPU KV capacity in tokens or None) from vLLM's
    /metrics."""
    load = 0.0
    gpu_tokens = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
                load += s.value
            elif s.name == "vllm:cache_config_info":
                with contextlib.suppress(KeyError, ValueError):
                    gpu_tokens = int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
    return load, gpu_tokens


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = PCounter(
            "spillway_router_requests", "Requests routed", ["model", "pod", "reason"], registry=r
        )
        self.errors = PCounter(
            "spillway_router_errors", "Requests answered with an error", ["code"], registry=r
        )
        self.retries = PCounter(
            "spillway_router_retries", "Requests retried on another pod", registry=r
        )
        self.cached = PCounter(
            "spillway_router_expected_cached_tokens",
            "Prompt tokens the router expected the chosen pod to hold",
            ["tier"],
            registry=r,
        )
        self.prompt_tokens = PCounter(
            "spillway_router_prompt_tokens", "Prompt tokens of routed requests", registry=r
        )
        self.inflight = Gauge("spillway_router_inflight", "In-flight", ["pod"], registry=r)
        self.index_blocks = Gauge(
            "spillway_router_index_blocks",
            "Block keys a pod holds, by where the router learnt it and the tier",
            ["pod", "source", "tier"],
            registry=r,
        )
        self.event_batches = PCounter(
            "spillway_router_event_batches", "KV event batches applied", ["pod"], registry=r
        )
        self.event_drops = PCounter(
            "spillway_router_kv_events_dropped",
            "KV event messages (unknown_medium: events) dropped unapplied, by reason",
            ["reason"],
            registry=r,
        )
        for reason in DROP_REASONS:
            self.event_drops.labels(reason)
        self.decision = Histogram(
            "spillway_router_decision_seconds",
            "Time to pick a pod (hashing and scoring)",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2),
            registry=r,
        )


class RouterState:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.backends: dict[str, Backend] = {}
        self.healthy: dict[str, bool] = {}
        self.ejected_until: dict[str, float] = {}
        self.index = PrefixIndex()  # from KV events
        self.approx = ApproxTracker(PrefixIndex())  # from the router's own decisions
        self.events_live: set[str] = set()
        self.feeds: dict[str, EventFeed] = {}
        self.inflight: Counter[str] = Counter()
        self.pod_load: dict[str, float] = {}
        self.gpu_tokens: dict[str, int] = {}
        self.rates = PoolRates()
        self._rings: dict[str, Ring] = {}
        self._hashers: dict[int, BlockHasher] = {}
        self.metrics = Metrics()

    # ------------------------------------------------------------ backends

    def upsert(self, backend: Backend) -> bool:
        """Add or update a pod; True when it is new (its subscription must start)."""
        new = backend.name not in self.backends
        self.backends[backend.name] = backend
        self.index.set_disk_group(backend.name, backend.profile.disk_group)
        self.healthy.setdefault(backend.name, False)
        self._capacity(backend.name)
        self._rings.pop(backend.model, None)
        return new

    def remove(self, name: str) -> None:
        """The pod is gone: it takes no requests and its index entries go with it."""
        backend = self.backends.pop(name, None)
        if backend is not None:
            self._rings.pop(backend.model, None)
        self.forget_cache(name)
        self.index.set_disk_group(name, None)  # the last member takes the group's entries
        self.approx.forget(name)
        for table in (self.healthy, self.ejected_until, self.pod_load, self.gpu_tokens):
            table.pop(name, None)
        self.feeds.pop(name, None)
        # its series go too (the probe loop only refreshes the pods still listed)
        with contextlib.suppress(KeyError):
            self.metrics.inflight.remove(name)
        for source in ("events", "approx"):
            for tier in TIERS:
                with contextlib.suppress(KeyError):
                    self.metrics.index_blocks.remove(name, source, tier)

    def forget_cache(self, name: str) -> None:
        """The pod's cache is gone (it died or restarted)."""
        self.index.forget(name)
        self.events_live.discard(name)
        self.approx.forget(name)
        if name in self.backends:
            self._capacity(name)

    def _capacity(self, name: str) -> None:
        p = self.backends[name].profile
        gpu = self.gpu_tokens.get(name) or p.max_model_len or 0
        self.approx.set_capacity(
            name, gpu // p.tokens_per_hash, p.host_capacity_tokens // p.tokens_per_hash
        )

    def set_pod_metrics(self, name: str, load: float, gpu_tokens: int | None) -> None:
        self.pod_load[name] = load
        if gpu_tokens and self.gpu_tokens.get(name) != gpu_tokens and name in self.backends:
            self.gpu_tokens[name] = gpu_tokens
            self._capacity(name)

    def set_healthy(self, name: str, ok: bool) -> None:
        was = self.healthy.get(name, False)
        self.healthy[name] = ok
        if was and not ok:
            self.forget_cache(name)

    def eject(self, name: str) -> None:
        """A pod refused a connection: off the list for a while, its cache forgotten."""
        self.ejected_until[name] = time.monotonic() + self.config.eject_s
        self.healthy[name] = False
        self.forget_cache(name)

    def models(self) -> list[str]:
        return sorted({b.model for b in self.backends.values()})

    def ready(self, model: str, only: set[str] | None = None) -> list[Backend]:
        """The model's pods that take requests (of ``only``'s addresses, when given)."""
        now = time.monotonic()
        return [
            b
            for b in self.backends.values()
            if b.model == model
            and self.healthy.get(b.name)
            and self.ejected_until.get(b.name, 0.0) <= now
            and (only is None or b.address in only)
        ]

    def ring(self, model: str, names: Iterable[str]) -> Ring:
        # one ring per model over every known pod, so a pod that is briefly unready
        # does not remap everybody else's keys
        ring = self._rings.get(model)
        if ring is None:
            ring = self._rings[model] = Ring(
                [b.name for b in self.backends.values() if b.model == model]
            )
        return ring

    def on_event_batch(self, name: str) -> None:
        self.events_live.add(name)
        self.metrics.event_batches.labels(name).inc()

    def on_event_drop(self, name: str, reason: str) -> None:
        self.metrics.event_drops.labels(reason).inc()

    def event_feed(self, name: str) -> EventFeed:
        """A feed of one of ``name``'s publishers into the index."""
        return EventFeed(name, self.index, self.on_event_batch, self.on_event_drop)

    # ------------------------------------------------------------ routing

    def keys(self, prompt: Prompt, unit: int) -> list[int]:
        if prompt.tokens is not None:
            hasher = self._hashers.get(unit)
            if hasher is None:
                hasher = self._hashers[unit] = BlockHasher(
                    HashConfig(unit, self.config.hash_algorithm, self.config.hash_seed)
                )
            return hasher.keys(prompt.tokens, prompt.cache_salt)
        return text_keys(prompt.text or "", unit * CHARS_PER_TOKEN)

    def route(
        self, model: str, prompt: Prompt, only: set[str] | None = None
    ) -> tuple[list[Backend], list[int]]:
        """Pods to try, best first (none when none is ready), and the prompt's block
        keys, for :meth:`served` to record where the request went."""
        ready = self.ready(model, only)
        if not ready:
            return [], []
        t0 = time.perf_counter()
        unit = ready[0].profile.tokens_per_hash
        keys = self.keys(prompt, unit)
        n_tokens = len(prompt.tokens) if prompt.tokens is not None else len(keys) * unit
        use_events = self.config.mode == "events" and prompt.tokens is not None
        matches: dict[str, Match] = {}
        for b in ready:
            live = use_events and b.name in self.events_live
            src = self.index if live else self.approx.index
            p = b.profile
            matches.update(src.match(keys, [b.name], gap=p.gap, host_gap=p.host_gap))
        cfg = self.config
        weights = self.rates.weights(b.pool for b in ready)
        states = [
            PodState(
                b.name,
                b.cost(
                    weights[b.pool],
                    host_bandwidth=cfg.host_bandwidth,
                    prefill_s_per_token=cfg.prefill_s_per_token,
                    wait_s_per_request=cfg.wait_s_per_request,
                    disk_load_factor=cfg.disk_load_factor,
                ),
                load=self.inflight[b.name] + self.pod_load.get(b.name, 0.0),
                draining=b.draining,
                weight=weights[b.pool],
            )
            for b in ready
        ]
        key = cold_key(keys, prompt.tokens or [], prompt.session)
        decision = choose(states, n_tokens, matches, self.ring(model, []), key, cfg.balance)
        m = self.metrics
        m.decision.observe(time.perf_counter() - t0)
        m.requests.labels(model, decision.pod, decision.reason).inc()
        m.prompt_tokens.inc(n_tokens)
        m.cached.labels("host").inc(decision.host_tokens)
        m.cached.labels("disk").inc(decision.disk_tokens)
        m.cached.labels("gpu").inc(
            decision.cached_tokens - decision.host_tokens - decision.disk_tokens
        )
        by_name = {b.name: b for b in ready}
        rest = sorted(
            (b for b in ready if b.name != decision.pod),
            key=lambda b: (b.draining, decision.estimates.get(b.name, float("inf")), b.name),
        )
        return [by_name[decision.pod], *rest], keys

    def decide(self, path: str, raw: bytes, only: set[str] | None = None) -> Routed:
        """Parse an OpenAI request and pick its pods (best first): the one decision
        the proxy and the endpoint picker both make. Raises :class:`Refused` with
        the status and message the client gets."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise Refused(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise Refused(400, "'model' must be a non-empty string")
        if model not in self.models():
            raise Refused(404, f"The model `{model}` does not exist.")
        try:
            prompt = prompt_of(path, body, self.config.tokenizers.get(model))
        except BadRequest as e:
            raise Refused(400, str(e)) from None
        candidates, keys = self.route(model, prompt, only)
        if not candidates:
            among = "" if only is None else " among the endpoints the gateway allows"
            raise Refused(503, f"no ready pod serves the model `{model}`{among}")
        limit = candidates[0].profile.max_model_len
        if prompt.tokens is not None and limit and len(prompt.tokens) > limit:
            raise Refused(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {len(prompt.tokens)} input tokens.",
            )
        return Routed(prompt, candidates, keys)

    def served(self, pod: str, prompt: Prompt, keys: list[int]) -> None:
        """``pod`` answered a request with these keys: it now holds them (approximately).
        Not recorded where the pod's events say it exactly (the record would go unused)."""
        exact = self.config.mode == "events" and prompt.tokens is not None
        if pod in self.backends and not (exact and pod in self.events_live):
            self.approx.record(pod, keys)


# ---------------------------------------------------------------- the HTTP side


class RouterApp:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._probe_task: asyncio.Task | None = None
        self.sources: list[Any] = []  # started with the app (e.g. the pod watch)
        self._open: dict[str, set[aiohttp.ClientResponse]] = {}  # pod -> answers in flight
        self._failed_probes: dict[str, int] = {}  # pod -> health probes failed in a row
        self._cuts: dict[str, asyncio.Future] = {}  # pod -> set when its answers are cut

    def build(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    # ------------------------------------------------------------ lifecycle

    async def _start(self, app: web.Application) -> None:
        cfg = self.state.config
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=256),
            auto_decompress=False,  # bytes pass through as the pod sent them
        )
        for backend in list(self.state.backends.values()):
            self._start_pod_tasks(backend)
        self._probe_task = asyncio.create_task(self._probe_loop())
        for source in self.sources:
            await source.start(self)

    async def _stop(self, app: web.Application) -> None:
        for source in self.sources:
            await source.stop()
        tasks = [t for ts in self._tasks.values() for t in ts]
        if self._probe_task is not None:
            tasks.append(self._probe_task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def add_backend(self, backend: Backend) -> None:
        old = self.state.backends.get(backend.name)
        self.state.upsert(backend)
        if old is None or old.events != backend.events:
            self._stop_pod_tasks(backend.name)
            if self.session is not None:
                self._start_pod_tasks(backend)

    def remove_backend(self, name: str) -> None:
        self._stop_pod_tasks(name)
        self.state.remove(name)
        # A pod that leaves while failing its probes is not draining (a drain keeps
        # /health up): cut its answers now, as no probe will look at it again.
        fails = self._failed_probes.pop(name, 0)
        if fails:
            self._cut(name, fails)
        self._cuts.pop(name, None)

    def _start_pod_tasks(self, backend: Backend) -> None:
        if not backend.events or self.state.config.mode != "events":
            return
        if backend.events == EVENTS_FROM_POD:
            # asked once the pod is healthy (see _probe): a restarted engine binds anew
            if self.state.healthy.get(backend.name):
                self._tasks[backend.name] = [asyncio.create_task(self._follow_pod(backend))]
            return
        # one endpoint per data-parallel rank (the pod's declared ports), one feed each
        feeds = [(e, self.state.event_feed(backend.name)) for e in backend.events.split()]
        self.state.feeds[backend.name] = feeds[0][1]
        self._tasks[backend.name] = [asyncio.create_task(subscribe(e, f)) for e, f in feeds]

    async def _follow_pod(self, backend: Backend) -> None:
        """Ask the pod where each of its data-parallel ranks publishes, then follow
        them all into the index under the pod's name. A pod that lists none (events
        off, or a vLLM without the endpoint) stays approximate."""
        assert self.session is not None
        host = backend.address.rsplit(":", 1)[0]
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.state.config.probe_interval_s * 2))
        endpoints: list[str] = []
        for _ in range(10):
            try:
                async with self.session.get(backend.url + SOURCES_PATH, timeout=timeout) as r:
                    if r.status == 404:
                        break
                    if r.status == 200:
                        endpoints = event_endpoints(await r.json(content_type=None), host)
                        break
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
                log.debug("pod %s: %s: %s", backend.name, SOURCES_PATH, e)
            await asyncio.sleep(self.state.config.probe_interval_s)
        if not endpoints:
            log.info("pod %s lists no KV event endpoint: approximate routing", backend.name)
            return
        log.info("pod %s: KV events from %s", backend.name, ", ".join(endpoints))
        feeds = [self.state.event_feed(backend.name) for _ in endpoints]
        self.state.feeds[backend.name] = feeds[0]
        await asyncio.gather(*(subscribe(e, f) for e, f in zip(endpoints, feeds, strict=True)))

    def _stop_pod_tasks(self, name: str) -> None:
        for t in self._tasks.pop(name, []):
            t.cancel()

    async def _probe_loop(self) -> None:
        while True:
            backends = list(self.state.backends.values())
            await asyncio.gather(*(self._probe(b) for b in backends), return_exceptions=True)
            s = self.state
            for b in backends:
                s.metrics.inflight.labels(b.name).set(s.inflight[b.name])
                for source, index in (("events", s.index), ("approx", s.approx.index)):
                    for tier in TIERS:
                        n = index.tier_size(b.name, tier)
                        s.metrics.index_blocks.labels(b.name, source, tier).set(n)
            await asyncio.sleep(s.config.probe_interval_s)

    async def _probe(self, backend: Backend) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.state.config.probe_interval_s * 2))
        ok = False
        try:
            async with self.session.get(backend.url + "/health", timeout=timeout) as r:
                ok = r.status == 200
                await r.read()
            if ok:
                async with self.session.get(backend.url + "/metrics", timeout=timeout) as r:
                    if r.status == 200:
                        load, gpu = parse_pod_metrics(await r.text())
                        self.state.set_pod_metrics(backend.name, load, gpu)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            pass
        if backend.name in self.state.backends:
            fails = 0 if ok else self._failed_probes.get(backend.name, 0) + 1
            self._failed_probes[backend.name] = fails
            if fails >= self.state.config.dead_after_probes:
                self._cut(backend.name, fails)
            if ok and self.state.ejected_until.get(backend.name, 0.0) > time.monotonic():
                return  # still ejected; the next probe after the window readmits it
            was = self.state.healthy.get(backend.name, False)
            self.state.set_healthy(backend.name, ok)
            current = self.state.backends.get(backend.name)
            if ok and not was and current is not None and current.events == EVENTS_FROM_POD:
                self._stop_pod_tasks(backend.name)
                self._start_pod_tasks(current)

    def _cut(self, name: str, fails: int) -> None:
        """End every answer in flight from a pod that stopped answering its probes: the
        read waiting on it raises, and the request is retried elsewhere (no byte sent
        yet) or its stream ends with a retryable error, instead of waiting forever."""
        cut = self._cuts.pop(name, None)
        if cut is not None and not cut.done():
            cut.set_result(None)  # wakes requests still waiting for the answer's head
        for up in list(self._open.get(name, ())):
            log.warning("pod %s failed %d health probes in a row: cutting an answer in "
                        "flight", name, fails)
            up.content.set_exception(
                aiohttp.ServerTimeoutError(f"the pod failed {fails} health probes in a row"))

    # ------------------------------------------------------------ handlers

    async def healthz(self, request: web.Request) -> web.Response:
        s = self.state
        ready = {m: len(s.ready(m)) for m in s.models()}
        return web.json_response({"status": "ok", "ready_pods": ready})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.state.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "spillway"}
            for m in self.state.models()
        ]
        return web.json_response({"object": "list", "data": data})

    def _fail(self, status: int, message: str) -> web.Response:
        self.state.metrics.errors.labels(str(status)).inc()
        return error(status, message)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._fail(413, f"the request body is larger than {MAX_BODY} bytes")
        s = self.state
        try:
            decision = s.decide(request.path, raw)
        except Refused as e:
            return self._fail(e.status, e.message)
        candidates, prompt, keys = decision.candidates, decision.prompt, decision.keys
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        for attempt, backend in enumerate(candidates[: s.config.max_attempts]):
            if attempt:
                s.metrics.retries.inc()
            s.inflight[backend.name] += 1
            started = time.monotonic()
            try:
                done = await self._forward(request, backend, raw, headers)
            finally:
                s.inflight[backend.name] -= 1
            if done is not None:
                s.served(backend.name, prompt, keys)
                tokens = (len(prompt.tokens) if prompt.tokens is not None
                          else len(keys) * backend.profile.tokens_per_hash)
                s.rates.observe(backend.pool, tokens, time.monotonic() - started)
                return done
        return self._fail(503, "every pod tried failed before answering; retry later")

    async def _forward(
        self, request: web.Request, backend: Backend, raw: bytes, headers: dict[str, str]
    ) -> web.StreamResponse | None:
        """The pod's answer, passed through; None when it failed before a byte of it
        reached the client (so another pod may take the request)."""
        assert self.session is not None
        url = backend.url + request.path
        try:
            # The answer's head, unless the pod is found dead first (a pooled
            # connection to a partitioned pod would wait for it forever).
            post = asyncio.ensure_future(self.session.post(url, data=raw, headers=headers))
            cut = self._cuts.get(backend.name)
            if cut is None:
                cut = self._cuts[backend.name] = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait({post, cut}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # the client may go away meanwhile: leave no request behind
                headless = not post.done()
                if headless:
                    post.cancel()
            if headless:
                self.state.eject(backend.name)
                return None
            async with post.result() as up:
                self._open.setdefault(backend.name, set()).add(up)
                try:
                    if up.status in (502, 503, 504):
                        await up.read()
                        self.state.eject(backend.name)
                        return None
                    first = await up.content.readany()
                    return await self._pass_through(request, backend, up, first)
                finally:
                    opened = self._open.get(backend.name, set())
                    opened.discard(up)
                    if not opened:  # no empty set left behind for every pod name seen
                        self._open.pop(backend.name, None)
        except (aiohttp.ClientError, TimeoutError, OSError):
            self.state.eject(backend.name)
            return None

    async def _pass_through(
        self,
        request: web.Request,
        backend: Backend,
        up: aiohttp.ClientResponse,
        first: bytes,
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=up.status, reason=up.reason)
        for k, v in up.headers.items():
            if k.lower() not in _HOP:
                out.headers[k] = v
        chunk = first
        try:
            await out.prepare(request)
            while chunk:
                await out.write(chunk)
                try:
                    chunk = await up.content.readany()
                except (aiohttp.ClientError, TimeoutError, OSError) as e:
                    # the pod died mid-answer: too late to retry; tell an SSE client
                    self.state.eject(backend.name)
                    if "event-stream" in up.headers.get("content-type", ""):
                        msg = {
                            "error": {
                                "message": f"the pod failed mid-stream: {type(e).__name__}",
                                "type": "ServiceUnavailableError",
                                "code": 503,
                            }
                        }
                        await out.write(f"data: {json.dumps(msg)}\n\n".encode())
                    return out
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client went away; leaving the block releases the pod's connection
        return out
