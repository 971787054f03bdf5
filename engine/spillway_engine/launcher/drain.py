"""Drains that drop nothing: the engine stops taking requests and finishes those in flight
before it is stopped.

What vLLM 0.33's server does on SIGTERM (vllm/entrypoints/launchers/launcher.py,
vllm/v1/engine/core.py): with ``--shutdown-timeout 0`` (its default) the engine core
aborts every request in flight and the listening socket closes at once; an open stream
gets no last chunk and hangs until the process is killed. With a timeout it drains
the requests in flight, but ``/health`` keeps answering 200 and a new request is
answered 200 with empty text and ``finish_reason: abort`` (EngineCore
``_reject_add_in_shutdown``): a client cannot tell it from an answer. Neither lets a
Service or a router move traffic away first.

So the drain happens before SIGTERM, in the pod's preStop hook, which the kubelet runs
when the pod is deleted (scale-down, rollout, eviction) and waits for, within the
grace period:

1. ``spillway-engine drain`` (the preStop command) POSTs ``/spillway/drain`` on the
   engine's port over loopback; this ASGI middleware (added to vLLM's app with
   ``--middleware``) starts draining: ``/spillway/ready``, the readiness probe, answers
   503, so the pod leaves the Service's endpoints (and spillway-router, which also
   drops a terminating pod, stops sending).
2. For ``accept_seconds`` (the endpoints and the routers learn of it through watches)
   new requests are still taken; after that they are refused with 503 and a
   ``Retry-After``, which clients and routers retry elsewhere, never a silent empty
   answer.
3. The POST returns when no request is in flight (streams included: a request counts
   until its last byte is sent), or at its timeout; then the kubelet sends SIGTERM and
   vLLM stops with nothing left to abort.

``/health`` (liveness) stays vLLM's own: a draining engine is alive. One state per API
server process: with several API server processes (``--api-server-count``) the
preStop reaches one of them.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from spillway_engine.seam import DRAIN_PATH, READY_PATH

MIDDLEWARE = "spillway_engine.launcher.drain.DrainMiddleware"
#: Paths that are not requests to drain: probes, metrics, discovery.
_UNCOUNTED = frozenset({"/health", "/ping", "/metrics", "/load", "/version",
                        "/kv_event_sources", READY_PATH, DRAIN_PATH})
DEFAULT_ACCEPT_SECONDS = 5.0

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class DrainState:
    draining_since: float | None = None
    accept_seconds: float = DEFAULT_ACCEPT_SECONDS
    in_flight: int = 0
    refused: int = 0

    def start(self, accept_seconds: float, now: float) -> None:
        if self.draining_since is None:  # a second preStop call joins the first
            self.draining_since, self.accept_seconds = now, accept_seconds

    def refusing(self, now: float) -> bool:
        return (self.draining_since is not None
                and now >= self.draining_since + self.accept_seconds)

    def drained(self, now: float) -> bool:
        return self.refusing(now) and self.in_flight == 0

    def view(self) -> dict[str, Any]:
        return {"draining": self.draining_since is not None, "in_flight": self.in_flight,
                "refused": self.refused}


STATE = DrainState()


async def _answer(send: Send, status: int, body: dict[str, Any],
                  headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _query(scope: Scope, key: str, default: float) -> float:
    values = parse_qs((scope.get("query_string") or b"").decode()).get(key)
    try:
        return float(values[0]) if values else default
    except ValueError:
        return default


class DrainMiddleware:
    """Pure ASGI (a streaming response is counted until it ends)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 state: DrainState | None = None):
        self.app = app
        self.state = state or STATE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, s, now = scope.get("path", ""), self.state, time.monotonic()
        if path == DRAIN_PATH:
            await self._drain(scope, send)
        elif path == READY_PATH:
            if s.draining_since is not None:
                await _answer(send, 503, {"ready": False, **s.view()})
            else:  # ready is vLLM's own health while not draining
                await self.app({**scope, "path": "/health", "raw_path": b"/health"},
                               receive, send)
        elif path in _UNCOUNTED:
            await self.app(scope, receive, send)
        elif s.refusing(now):
            s.refused += 1
            await _answer(send, 503, {"error": {
                "message": "this engine is draining (its pod is stopping): retry on another",
                "type": "ServiceUnavailable", "code": 503}}, [(b"retry-after", b"1")])
        else:
            s.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                s.in_flight -= 1

    async def _drain(self, scope: Scope, send: Send) -> None:
        s = self.state
        if scope.get("method") == "GET":
            await _answer(send, 200, s.view())
            return
        client = (scope.get("client") or ("", 0))[0]
        if not _loopback(client):  # the pod's own preStop only, never the network
            await _answer(send, 403, {"error": "drain is accepted from loopback only"})
            return
        s.start(_query(scope, "accept_seconds", DEFAULT_ACCEPT_SECONDS), time.monotonic())
        deadline = time.monotonic() + _query(scope, "timeout", 600.0)
        while not s.drained(time.monotonic()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await _answer(send, 200, {**s.view(), "drained": s.drained(time.monotonic())})


# ---------------------------------------------------------------- the preStop command


def drain_main(argv: Sequence[str]) -> int:
    """``spillway-engine drain``: start the drain and wait for it (the pod's preStop).

    Exit 0 when drained or when no engine listens (nothing to drain); 1 on a timeout
    or an unexpected answer (the kubelet records it and goes on to SIGTERM)."""
    p = argparse.ArgumentParser(prog="spillway-engine drain", description=drain_main.__doc__)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="a loopback address the engine "
                   "listens on (the pod's own network namespace)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the requests in flight")
    p.add_argument("--accept-seconds", type=float, default=DEFAULT_ACCEPT_SECONDS,
                   help="seconds new requests are still taken while routers catch up")
    args = p.parse_args(list(argv))
    url = (f"http://{args.host}:{args.port}{DRAIN_PATH}?timeout={args.timeout}"
           f"&accept_seconds={args.accept_seconds}")
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout + 30) as resp:
            result = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(f"spillway-engine drain: HTTP {exc.code}: {exc.read()[:300]!r}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"spillway-engine drain: no engine to drain ({exc})", file=sys.stderr)
        return 0
    print(f"spillway-engine drain: {json.dumps(result)}", file=sys.stderr)
    return 0 if result.get("drained") else 1
