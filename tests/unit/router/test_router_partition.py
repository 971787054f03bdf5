"""spillway-router in front of a pod that goes silent: a network partition (the real-node
fault bench cuts a pod with iptables) leaves the router's connections open with nothing
coming back, neither bytes nor a reset. The pod's health probes fail; after
``dead_after_probes`` of them its answers in flight are cut, so a stream ends with an
OpenAI-shaped retryable error and a request that had no byte yet goes to another pod,
instead of both waiting forever.

The silent pod is a real HTTP server whose handlers stop answering (as a partitioned
pod's do, seen from the router); the healthy one is the engine simulator.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from spillway_engine.simulator.server import SimulatorApp
from spillway_router.app import RouterApp, RouterConfig, RouterState
from spillway_router.backends import Backend
from tests.unit.router.test_router_proxy import MODEL, PROFILE, _until
from tests.unit.simulator_support import LLAMA, make_core, tokens

HANG_LIMIT_S = 30  # far past the probes' cut (about 2 s here): only a hang reaches it


class SilentPod:
    """Healthy until a completion arrives; from then on nothing answers (its health
    probes included). ``stream_first``: send the stream's head and one chunk first."""

    def __init__(self, stream_first: bool) -> None:
        self.stream_first = stream_first
        self.silent = asyncio.Event()
        self._never = asyncio.Event()

    def build(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.silent.is_set():
            await self._never.wait()
        return web.Response(text="")

    async def metrics(self, request: web.Request) -> web.Response:
        return await self.health(request)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        if self.stream_first:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.silent.set()
        await self._never.wait()
        raise AssertionError("unreachable")


async def _front(silent: SilentPod, healthy: bool,
                 dead_after: int = 2) -> tuple[RouterApp, list[TestServer]]:
    servers = [TestServer(silent.build())]
    if healthy:
        sim = SimulatorApp(make_core(LLAMA), speed=1000, model_name=MODEL)
        servers.append(TestServer(sim.build()))
    for s in servers:
        await s.start_server()
    state = RouterState(RouterConfig(mode="approx", probe_interval_s=0.05, eject_s=60,
                                     dead_after_probes=dead_after))
    router = RouterApp(state)
    for i, s in enumerate(servers):
        router.add_backend(Backend(f"pod{i}", MODEL, str(s.make_url("")).rstrip("/"), None,
                                   PROFILE))
    front = TestServer(router.build())
    await front.start_server()
    await _until(lambda: len(state.ready(MODEL)) == len(servers), tries=1000)
    return router, [front, *servers]


def test_a_stream_from_a_pod_gone_silent_ends_with_a_retryable_error() -> None:
    async def run() -> None:
        silent = SilentPod(stream_first=True)
        router, servers = await _front(silent, healthy=False)
        try:
            body = {"model": MODEL, "prompt": tokens(64, 4), "max_tokens": 50, "stream": True}
            async with (
                aiohttp.ClientSession() as http,
                http.post(str(servers[0].make_url("/v1/completions")), json=body) as r,
            ):
                assert r.status == 200
                assert (await r.content.readline()).startswith(b"data: ")
                rest = (await asyncio.wait_for(r.read(), HANG_LIMIT_S)).decode()
            error = json.loads(rest.strip().split("data: ", 1)[1])["error"]
            assert error["code"] == 503 and error["type"] == "ServiceUnavailableError", rest
            assert "[DONE]" not in rest
            assert sum(router.state.inflight.values()) == 0
            assert router._open == {}  # nothing kept for answers that ended
            assert router.state.ready(MODEL) == []
        finally:
            for s in servers:
                await s.close()

    asyncio.run(run())


def test_a_request_a_silent_pod_never_answered_goes_to_another_pod() -> None:
    async def run() -> None:
        silent = SilentPod(stream_first=False)
        router, servers = await _front(silent, healthy=True)
        try:
            async with aiohttp.ClientSession() as http:
                # cold prompts go by hashing: send until one lands on the silent pod
                for seed in range(40):
                    body = {"model": MODEL, "prompt": tokens(64, 100 + seed), "max_tokens": 2}
                    url = str(servers[0].make_url("/v1/completions"))
                    async with http.post(url, json=body) as r:
                        reply = await asyncio.wait_for(r.read(), HANG_LIMIT_S)
                        assert r.status == 200, reply
                    if silent.silent.is_set():
                        break
            assert silent.silent.is_set(), "no request reached the silent pod"
            assert router.state.metrics.retries._value.get() >= 1
            assert [b.name for b in router.state.ready(MODEL)] == ["pod1"]
            assert sum(router.state.inflight.values()) == 0
            assert router._open == {}  # nothing kept for answers that ended
        finally:
            for s in servers:
                await s.close()

    asyncio.run(run())


def test_a_silent_pod_the_pod_watch_removes_has_its_stream_cut() -> None:
    """The kubelet's readiness probe can find the pod first: the pod watch removes it
    before the router's own probes reach their count. Its stream still ends."""
    async def run() -> None:
        silent = SilentPod(stream_first=True)
        router, servers = await _front(silent, healthy=False, dead_after=10_000)
        try:
            body = {"model": MODEL, "prompt": tokens(64, 5), "max_tokens": 50, "stream": True}
            async with (
                aiohttp.ClientSession() as http,
                http.post(str(servers[0].make_url("/v1/completions")), json=body) as r,
            ):
                assert (await r.content.readline()).startswith(b"data: ")
                await _until(lambda: router._failed_probes.get("pod0", 0) >= 1, tries=1000)
                router.remove_backend("pod0")  # what the watch does for a NotReady pod
                rest = (await asyncio.wait_for(r.read(), HANG_LIMIT_S)).decode()
            assert '"type": "ServiceUnavailableError"' in rest and "[DONE]" not in rest
        finally:
            for s in servers:
                await s.close()

    asyncio.run(run())
