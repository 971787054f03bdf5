"""The simulator's HTTP face: an aiohttp app that paces the core against the wall clock.

Modelled time runs ``speed`` times faster than the wall clock (``--speed 10``: a
modelled second takes 0.1 s). A request's arrival is the modelled "now" when it is
received; the engine task steps the core and sleeps until the wall clock catches up
with the core's clock, so latencies seen by clients are the modelled ones divided by
``speed``. If this machine's CPU cannot keep up (high ``speed``, heavy traffic), the
modelled clock runs slower than ``speed`` x wall time instead of jumping ahead:
modelled latencies (metrics, the ``spillway`` response field) stay those of the model;
wall-clock latencies grow. Metrics report modelled seconds.

Endpoints (vLLM's OpenAI-compatible server, the subset load tests use):
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` optional, with
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``,
``GET /metrics``. Responses carry an extra ``spillway`` object (modelled TTFT and the
prompt tokens served from the device / host caches) that real vLLM does not send.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from spillway_engine.simulator.core import EngineCore, RequestRejected, SimRequest
from spillway_engine.simulator.prom import SimulatorMetrics
from spillway_engine.word_tokenizer import chat_tokens, detokenize, tokenize

DEFAULT_MAX_TOKENS = 16


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(message: str, status: int = 400) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


class SimulatorApp:
    """Owns the core, the metrics and the engine task."""

    def __init__(self, core: EngineCore, *, speed: float = 1.0, model_name: str | None = None):
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.core = core
        self.speed = speed
        self.model_name = model_name or core.plan.model_name
        self.metrics = SimulatorMetrics(core, model_name=self.model_name)
        self._wake = asyncio.Event()
        self._outbox: list[tuple[asyncio.Queue, int, bool]] = []
        self._t0 = 0.0
        self._task: asyncio.Task | None = None

    # clock -------------------------------------------------------------------
    def model_now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    async def _engine_loop(self) -> None:
        core = self.core
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            if core.step() == 0.0:
                # Only loads are pending: wait for the first to finish or a new request.
                nxt = core.next_event_time()
                timeout = None
                if nxt is not None:
                    timeout = max(0.0, (nxt - self.model_now()) / self.speed)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                if nxt is not None:
                    core.advance_to(min(nxt, self.model_now()))
                continue
            delay = (core.now - self.model_now()) / self.speed
            await asyncio.sleep(max(0.0, delay))
            # Tokens of this step are released when its modelled duration has passed.
            outbox, self._outbox = self._outbox, []
            for queue, token, done in outbox:
                queue.put_nowait((token, done))

    def arrival_time(self) -> float:
        """Modelled arrival time of a request received now.

        An idle core catches up with the wall clock first. A busy core that lags
        behind it (this host's CPU cannot keep up with ``speed``) stamps arrivals
        with its own clock, so the lag does not show up as modelled queueing.
        """
        wall = self.model_now()
        if not self.core.has_work():
            self.core.advance_to(wall)
        return min(wall, self.core.now)

    async def start(self, app: web.Application) -> None:
        self._t0 = time.monotonic() - self.core.now / self.speed
        self._task = asyncio.create_task(self._engine_loop())

    async def stop(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def build(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    # simple endpoints ----------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.sync()
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "spillway-simulator",
                        "root": self.model_name,
                        "parent": None,
                        "max_model_len": self.core.max_model_len,
                    }
                ],
            }
        )

    # generation ----------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _BadRequest(f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise _BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise _BadRequest(f"The model `{model}` does not exist.", 404)
        return body

    @staticmethod
    def _max_tokens(body: dict[str, Any]) -> int:
        value = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
        if value is None:
            value = DEFAULT_MAX_TOKENS
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _BadRequest("max_tokens must be a positive integer")
        return value

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = tokenize(prompt)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                ids = list(prompt)
            elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                ids = tokenize(prompt[0])
            else:
                raise _BadRequest("prompt must be a string or a list of token ids")
            return await self._generate(request, body, ids, chat=False)
        except _BadRequest as e:
            return _error(str(e), e.status)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("messages must be a non-empty list")
            try:
                ids = chat_tokens(messages)
            except ValueError as e:
                raise _BadRequest(str(e)) from e
            return await self._generate(request, body, ids, chat=True)
        except _BadRequest as e:
            return _error(str(e), e.status)

    def _submit(self, ids: list[int], max_tokens: int) -> tuple[SimRequest, asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        try:
            req = self.core.add_request(ids, max_tokens, arrival=self.arrival_time())
        except RequestRejected as e:
            raise _BadRequest(str(e)) from e
        req.sink = lambda _r, token, done: self._outbox.append((queue, token, done))
        self._wake.set()
        return req, queue

    def _extras(self, req: SimRequest) -> dict[str, Any]:
        return {
            "ttft_s": req.ttft,
            "cached_tokens_device": req.local_hit,
            "cached_tokens_host": req.external_hit,
            "num_preemptions": req.num_preemptions,
        }

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        return {
            "prompt_tokens": req.prompt_len,
            "completion_tokens": req.num_output,
            "total_tokens": req.prompt_len + req.num_output,
            "prompt_tokens_details": {"cached_tokens": req.local_hit + req.external_hit},
        }

    async def _generate(
        self, request: web.Request, body: dict[str, Any], ids: list[int], *, chat: bool
    ) -> web.StreamResponse:
        max_tokens = self._max_tokens(body)
        stream = bool(body.get("stream", False))
        req, queue = self._submit(ids, max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        try:
            if not stream:
                tokens: list[int] = []
                while True:
                    token, done = await queue.get()
                    tokens.append(token)
                    if done:
                        break
                text = detokenize(tokens)
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                return web.json_response(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": self.model_name,
                        "choices": [choice],
                        "usage": self._usage(req),
                        "spillway": self._extras(req),
                    }
                )
            return await self._stream(request, body, req, queue, rid, created, chat)
        finally:
            if self.core.abort(req):
                self.metrics.on_abort()

    async def _stream(self, request, body, req, queue, rid, created, chat):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))

        async def send(payload: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        first = True
        while True:
            token, done = await queue.get()
            text = ("" if first else " ") + detokenize([token])
            if chat:
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text}
            choice["logprobs"] = None
            choice["finish_reason"] = "length" if done else None
            chunk = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            if done:
                chunk["spillway"] = self._extras(req)
            await send(chunk)
            first = False
            if done:
                break
        if include_usage:
            await send(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self._usage(req),
                }
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
