"""spillway-router's HTTP side, in process, in front of real engine simulators
(spillway_engine.simulator: the OpenAI subset with a modelled prefix cache, whose
answers say how many prompt tokens came from its device and host caches).

The simulators publish no KV events, so the router runs its approximate mode here;
the event-fed index is exercised against real vLLM in tests/contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp.test_utils import TestServer

from spillway_engine.planner.plan import read_plan
from spillway_engine.simulator.server import SimulatorApp
from spillway_router.app import RouterApp, RouterConfig, RouterState, parse_pod_metrics
from spillway_router.backends import Backend, profile_from_plan
from tests.unit.simulator_support import LLAMA, PLANS, make_core, tokens

MODEL = "m"
PROFILE = profile_from_plan(read_plan((PLANS / LLAMA).read_bytes(), LLAMA))


@dataclass
class Cluster:
    router: RouterApp
    url: str
    sims: list[TestServer]
    http: aiohttp.ClientSession

    async def post(self, path: str, body: object) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(self.url + path, data=data) as r:
            return r.status, json.loads(await r.read())

    async def complete(self, prompt: list[int], **kw: object) -> dict:
        status, reply = await self.post(
            "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, **kw}
        )
        assert status == 200, reply
        return reply


async def _until(predicate, tries: int = 400) -> None:
    for _ in range(tries):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


@contextlib.asynccontextmanager
async def cluster(n: int = 2, dead: int = 0,
                  probe_interval_s: float = 0.05) -> AsyncIterator[Cluster]:
    sims = [TestServer(SimulatorApp(make_core(LLAMA), speed=1000, model_name=MODEL).build())
            for _ in range(n)]  # fmt: skip
    for s in sims:
        await s.start_server()
    state = RouterState(RouterConfig(mode="approx", probe_interval_s=probe_interval_s,
                                     eject_s=60))
    router = RouterApp(state)
    for i, s in enumerate(sims):
        router.add_backend(Backend(f"pod{i}", MODEL, str(s.make_url("")).rstrip("/"), None,
                                   PROFILE))  # fmt: skip
    for i in range(dead):  # nothing listens there
        router.add_backend(Backend(f"dead{i}", MODEL, "http://127.0.0.1:9", None, PROFILE))
    front = TestServer(router.build())
    await front.start_server()
    http = aiohttp.ClientSession()
    try:
        await _until(lambda: len(state.ready(MODEL)) == n)
        yield Cluster(router, str(front.make_url("")).rstrip("/"), sims, http)
    finally:
        await http.close()
        await front.close()
        for s in sims:
            await s.close()


def test_shared_prefix_lands_where_it_was_cached() -> None:
    async def run() -> None:
        async with cluster(2) as c:
            base = tokens(512, seed=1)
            first = await c.complete(base + tokens(8, seed=2))
            assert first["spillway"]["cached_tokens_device"] == 0
            for i in range(6):
                reply = await c.complete(base + tokens(8, seed=10 + i))
                # every follow-up found the 512-token prefix on its pod
                assert reply["spillway"]["cached_tokens_device"] >= 496
            routed = c.router.state.metrics.requests
            counts = {
                p: routed.labels(MODEL, p, r)._value.get()
                for p in ("pod0", "pod1")
                for r in ("prefix",)
            }
            assert sorted(counts.values()) == [0, 6]

    asyncio.run(run())


def test_streaming_passes_through_unchanged() -> None:
    async def run() -> None:
        async with cluster(1) as c:
            body = {"model": MODEL, "prompt": tokens(64, 3), "max_tokens": 5, "stream": True}
            async with c.http.post(c.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                via_router = (await r.read()).decode()
            direct_url = str(c.sims[0].make_url("/v1/completions"))
            async with c.http.post(direct_url, json=body) as r:
                direct = (await r.read()).decode()
            events = [e for e in via_router.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert len(events) == len([e for e in direct.split("\n\n") if e])

    asyncio.run(run())


def test_openai_style_errors() -> None:
    async def run() -> None:
        async with cluster(1) as c:
            cases = [
                (b"{not json", 400),
                (b"[1, 2]", 400),
                ({"prompt": [1, 2]}, 400),
                ({"model": "other", "prompt": [1, 2]}, 404),
                ({"model": MODEL, "prompt": {"x": 1}}, 400),
                ({"model": MODEL, "prompt": [5] * (PROFILE.max_model_len + 1)}, 400),
            ]
            for body, status in cases:
                got, reply = await c.post("/v1/completions", body)
                assert got == status, (body, reply)
                assert reply["object"] == "error" and reply["code"] == status
            got, reply = await c.post("/v1/chat/completions", {"model": MODEL, "messages": []})
            assert got == 400
            async with c.http.get(c.url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
            async with c.http.get(c.url + "/healthz") as r:
                assert (await r.json())["ready_pods"] == {MODEL: 1}
            async with c.http.get(c.url + "/metrics") as r:
                text = await r.text()
            assert 'spillway_router_errors_total{code="404"} 1.0' in text

    asyncio.run(run())


def test_no_ready_pod_is_503() -> None:
    async def run() -> None:
        async with cluster(0, dead=1) as c:
            got, reply = await c.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
            assert got == 503 and "no ready pod" in reply["message"]

    asyncio.run(run())


def test_a_dead_pod_is_retried_elsewhere_and_forgotten() -> None:
    async def run() -> None:
        async with cluster(2) as c:
            state = c.router.state
            base = tokens(256, seed=5)
            await c.complete(base)
            holder = next(p for p in ("pod0", "pod1") if state.approx.index.size(p))
            other = "pod1" if holder == "pod0" else "pod0"
            # the holder dies; the router has not noticed yet (still marked healthy)
            await c.sims[int(holder[-1])].close()
            reply = await c.complete([*base, 7, 8])
            assert reply["choices"]
            assert state.approx.index.size(holder) == 0
            assert state.approx.index.size(other) > 0
            assert state.ready(MODEL) == [state.backends[other]]
            assert state.metrics.retries._value.get() >= 1
            assert sum(state.inflight.values()) == 0

    asyncio.run(run())


def test_a_pod_dying_mid_stream_ends_the_stream_with_an_error() -> None:
    """A simulator process killed (SIGKILL) while it streams an answer."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sim = subprocess.Popen(
        [sys.executable, "-m", "spillway_engine.simulator", "--plan", str(PLANS / LLAMA),
         "--port", str(port), "--speed", "1", "--served-model-name", MODEL],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip

    async def run() -> None:
        state = RouterState(RouterConfig(mode="approx", probe_interval_s=0.05, eject_s=60))
        router = RouterApp(state)
        router.add_backend(Backend("pod0", MODEL, f"http://127.0.0.1:{port}", None, PROFILE))
        front = TestServer(router.build())
        await front.start_server()
        try:
            await _until(lambda: bool(state.ready(MODEL)), tries=1500)
            body = {"model": MODEL, "prompt": tokens(64, 4), "max_tokens": 500, "stream": True}
            async with (
                aiohttp.ClientSession() as http,
                http.post(str(front.make_url("/v1/completions")), json=body) as r,
            ):
                assert r.status == 200
                assert (await r.content.readline()).startswith(b"data: ")
                sim.kill()  # the pod dies mid-answer (500 tokens take seconds at speed 1)
                rest = (await r.read()).decode()
            assert '"type": "ServiceUnavailableError"' in rest
            assert "[DONE]" not in rest
            assert state.ready(MODEL) == [] and sum(state.inflight.values()) == 0
        finally:
            await front.close()

    try:
        asyncio.run(run())
    finally:
        sim.kill()
        sim.wait(timeout=30)


def _garbage(rng: random.Random) -> bytes:
    shapes = [
        lambda: rng.randbytes(rng.randrange(0, 200)),
        lambda: b'{"model": ' * rng.randrange(1, 50),
        lambda: b"[" * 5000,
        lambda: json.dumps(rng.choice([None, 1, "x", [], {}, [1.5], True])).encode(),
        lambda: json.dumps({"model": rng.choice([None, 3, "", "nope", ["m"]])}).encode(),
        lambda: json.dumps(
            {
                "model": MODEL,
                "prompt": rng.choice(
                    [None, 3, [], [None], [[]], [1.5, 2], {"a": 1}, [True, False], [-1] * 9999]
                ),
            }
        ).encode(),
        lambda: json.dumps(
            {
                "model": MODEL,
                "messages": rng.choice([None, [], "hi", [1], [None], {"role": "user"}]),
            }
        ).encode(),
        lambda: '{"model": "m", "prompt": "\udcff"}'.encode("utf-8", "surrogatepass"),
    ]
    return rng.choice(shapes)()


def test_fuzz_malformed_requests_never_break_the_router() -> None:
    async def run() -> None:
        # probes time out after twice the interval (at least 1 s): the fuzz, the router
        # and the pod share one event loop, and on a loaded machine (make test runs two
        # workers on two cores) a 1 s probe timed out, so 15 of 3,000 answers were 503s
        # that were not the router blaming the pod for a client's request
        async with cluster(1, probe_interval_s=2.5) as c:
            fds = len(os.listdir("/proc/self/fd"))
            rng = random.Random(17)
            statuses: dict[int, int] = {}
            sem = asyncio.Semaphore(32)

            async def one(http: aiohttp.ClientSession, i: int) -> None:
                path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
                async with sem, http.post(c.url + path, data=_garbage(rng)) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1

            open_fds = []
            for rnd in range(2):
                async with aiohttp.ClientSession() as fuzz:
                    await asyncio.gather(*(one(fuzz, rnd * 1500 + i) for i in range(1500)))
                # the client gone, its connections close on the router's side too; what
                # may stay is the keep-alive pool to the pod (both ends in this process),
                # bounded by the concurrency, not by the number of requests
                await _until(lambda: len(os.listdir("/proc/self/fd")) <= fds + 2 * 32 + 8)
                open_fds.append(len(os.listdir("/proc/self/fd")))
            assert open_fds[1] <= open_fds[0] + 4, open_fds
            assert set(statuses) <= {200, 400, 404}, statuses
            assert statuses.get(400, 0) > 1000
            state = c.router.state
            assert sum(state.inflight.values()) == 0
            assert state.ready(MODEL)  # the pod was never blamed for a client's mistake
            reply = await c.complete(tokens(32, 9))
            assert reply["choices"]

    asyncio.run(run())


def test_parse_pod_metrics_reads_load_and_gpu_capacity() -> None:
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 3.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 2.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'
    )
    assert parse_pod_metrics(text) == (5.0, 1600)
    assert parse_pod_metrics("") == (0.0, None)
