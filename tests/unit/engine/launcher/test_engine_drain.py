"""The drain middleware as ASGI, in front of a small streaming ASGI app: what is counted,
what is refused and when, who may start a drain (no vLLM needed)."""

from __future__ import annotations

import asyncio
import json

from spillway_engine.launcher.drain import DRAIN_PATH, READY_PATH, DrainMiddleware, DrainState


def scope(path: str, method: str = "GET", client: str = "127.0.0.1",
          query: bytes = b"") -> dict:
    return {"type": "http", "path": path, "raw_path": path.encode(), "method": method,
            "client": (client, 4000), "query_string": query}


class Upstream:
    """An ASGI app: /health answers 200; /v1/stream sends chunks until released."""

    def __init__(self):
        self.release = asyncio.Event()
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send):
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/v1/stream":
            await send({"type": "http.response.body", "body": b"a", "more_body": True})
            await self.release.wait()
        await send({"type": "http.response.body", "body": b"end"})


async def call(mw: DrainMiddleware, s: dict) -> tuple[int, bytes]:
    messages: list[dict] = []

    async def send(message):
        messages.append(message)

    await mw(s, None, send)
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return messages[0]["status"], body


def test_drain_waits_for_the_stream_then_refuses_new_requests():
    async def scenario():
        up, state = Upstream(), DrainState()
        mw = DrainMiddleware(up, state)
        assert (await call(mw, scope(READY_PATH)))[0] == 200
        assert up.paths == ["/health"]  # ready is vLLM's health while not draining
        streaming = asyncio.create_task(call(mw, scope("/v1/stream", "POST")))
        await asyncio.sleep(0.01)
        assert state.in_flight == 1
        drain = asyncio.create_task(call(mw, scope(
            DRAIN_PATH, "POST", query=b"timeout=30&accept_seconds=0.2")))
        await asyncio.sleep(0.05)
        assert (await call(mw, scope(READY_PATH)))[0] == 503
        assert (await call(mw, scope("/health")))[0] == 200  # liveness untouched
        # Inside the accept window a late request is still served (and counted).
        assert await call(mw, scope("/v1/completions", "POST")) == (200, b"end")
        await asyncio.sleep(0.25)
        status, body = await call(mw, scope("/v1/completions", "POST"))
        assert status == 503 and b"draining" in body
        assert not drain.done()  # the stream is still in flight
        up.release.set()
        assert await streaming == (200, b"aend")
        status, body = await asyncio.wait_for(drain, 5)
        assert status == 200
        assert json.loads(body) == {"draining": True, "in_flight": 0, "refused": 1,
                                    "drained": True}

    asyncio.run(scenario())


def test_drain_times_out_and_only_loopback_may_start_it():
    async def scenario():
        up, state = Upstream(), DrainState()
        mw = DrainMiddleware(up, state)
        assert (await call(mw, scope(DRAIN_PATH, "POST", client="10.0.0.9")))[0] == 403
        assert state.draining_since is None
        streaming = asyncio.create_task(call(mw, scope("/v1/stream", "POST")))
        await asyncio.sleep(0.01)
        status, body = await call(mw, scope(DRAIN_PATH, "POST",
                                            query=b"timeout=0.3&accept_seconds=0"))
        assert status == 200 and json.loads(body)["drained"] is False
        assert json.loads((await call(mw, scope(DRAIN_PATH)))[1])["in_flight"] == 1
        up.release.set()
        await streaming

    asyncio.run(scenario())
