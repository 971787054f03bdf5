"""Load generator: replays traces with shared prefixes against OpenAI-compatible servers.

Traces are pure, seeded functions (:func:`generate_trace`), so the same trace can be
sent over HTTP (:func:`run_load`, ``spillway loadgen``) or fed straight into the
simulator's virtual-time core (:func:`to_replay_items` + ``simulator.core.replay``).

Trace kinds (every request is a chat completion whose messages are plain words):

- ``chat``: multi-turn conversations; each turn re-sends the whole conversation so far
  (system prompt, earlier user turns and the trace's own assistant replies) plus a new
  user message; after ``turns`` turns a user starts a new conversation.
- ``shared-prefix``: many users share a few long system prompts; each request is one
  system prompt plus a short unique question.
- ``agentic``: agents re-send a long tool context plus the growing list of tool calls
  and results of their loop.
- ``mixed``: the three kinds interleaved (a third of the requests each).

Arrivals are Poisson (exponential gaps) or constant at ``rate`` requests/s, for
``duration`` seconds or ``num_requests`` requests. Working-set size is set by the
number of users/prefixes/agents and the token counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

TRACE_KINDS = ("chat", "shared-prefix", "agentic", "mixed")
ROUTINGS = ("round-robin", "prefix-affinity")
ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class TraceSpec:
    """What to generate. Token counts are words (the simulator maps a word to a token)."""

    kind: str = "chat"
    rate: float = 5.0
    arrival: str = "poisson"
    duration: float | None = 60.0
    num_requests: int | None = None
    seed: int = 0
    max_tokens: int = 64
    # chat
    users: int = 16
    turns: int = 8
    system_tokens: int = 256
    user_tokens: int = 128
    reply_tokens: int = 128
    # shared-prefix
    prefixes: int = 4
    prefix_tokens: int = 2048
    question_tokens: int = 64
    # agentic
    agents: int = 4
    context_tokens: int = 4096
    step_tokens: int = 256
    loop_steps: int = 16

    def validate(self) -> None:
        if self.kind not in TRACE_KINDS:
            raise ValueError(f"unknown trace kind {self.kind!r} (one of {', '.join(TRACE_KINDS)})")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"unknown arrival process {self.arrival!r}")
        if not self.rate > 0:
            raise ValueError("rate must be positive")
        if self.duration is None and self.num_requests is None:
            raise ValueError("give a duration or a number of requests")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("duration must be positive")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the number of requests must be positive")
        for name in ("max_tokens", "users", "turns", "prefixes", "agents", "loop_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in (
            "system_tokens",
            "user_tokens",
            "reply_tokens",
            "prefix_tokens",
            "question_tokens",
            "context_tokens",
            "step_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from the start of the trace
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    session: str  # conversation / agent / prefix id: what prefix-affinity routes on
    kind: str


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"x{rng.randrange(1_000_000)}" for _ in range(n))


def _arrivals(spec: TraceSpec, rng: random.Random) -> list[float]:
    out: list[float] = []
    t = 0.0
    limit = spec.num_requests if spec.num_requests is not None else math.inf
    while len(out) < limit:
        t += rng.expovariate(spec.rate) if spec.arrival == "poisson" else 1.0 / spec.rate
        if spec.duration is not None and t > spec.duration:
            break
        out.append(t)
    return out


class _Chat:
    def __init__(self, spec: TraceSpec, rng: random.Random) -> None:
        self.spec, self.rng = spec, rng
        self.convs: dict[int, list[dict[str, str]]] = {}
        self.turn: dict[int, int] = {}
        self.generation: dict[int, int] = {}

    def next(self, index: int) -> tuple[tuple[dict[str, str], ...], str]:
        spec, rng = self.spec, self.rng
        user = rng.randrange(spec.users)
        conv = self.convs.get(user)
        if conv is None or self.turn[user] >= spec.turns:
            self.generation[user] = self.generation.get(user, -1) + 1
            conv = [{"role": "system", "content": _words(rng, spec.system_tokens)}]
            self.convs[user], self.turn[user] = conv, 0
        conv.append({"role": "user", "content": _words(rng, spec.user_tokens)})
        messages = tuple(dict(m) for m in conv)
        conv.append({"role": "assistant", "content": _words(rng, spec.reply_tokens)})
        self.turn[user] += 1
        return messages, f"chat-{user}-{self.generation[user]}"


class _SharedPrefix:
    def __init__(self, spec: TraceSpec, rng: random.Random) -> None:
        self.spec, self.rng = spec, rng
        self.prefixes = [_words(rng, spec.prefix_tokens) for _ in range(spec.prefixes)]

    def next(self, index: int) -> tuple[tuple[dict[str, str], ...], str]:
        p = self.rng.randrange(self.spec.prefixes)
        question = _words(self.rng, self.spec.question_tokens)
        return (
            {"role": "system", "content": self.prefixes[p]},
            {"role": "user", "content": question},
        ), f"prefix-{p}"


class _Agentic:
    def __init__(self, spec: TraceSpec, rng: random.Random) -> None:
        self.spec, self.rng = spec, rng
        self.loops: dict[int, list[dict[str, str]]] = {}
        self.generation: dict[int, int] = {}

    def next(self, index: int) -> tuple[tuple[dict[str, str], ...], str]:
        spec, rng = self.spec, self.rng
        agent = rng.randrange(spec.agents)
        loop = self.loops.get(agent)
        if loop is None or (len(loop) - 2) // 2 >= spec.loop_steps:
            self.generation[agent] = self.generation.get(agent, -1) + 1
            loop = [
                {"role": "system", "content": _words(rng, spec.context_tokens)},
                {"role": "user", "content": _words(rng, spec.step_tokens)},
            ]
            self.loops[agent] = loop
        messages = tuple(dict(m) for m in loop)
        loop.append({"role": "assistant", "content": _words(rng, spec.step_tokens // 4)})
        loop.append({"role": "tool", "content": _words(rng, spec.step_tokens)})
        return messages, f"agent-{agent}-{self.generation[agent]}"


def generate_trace(spec: TraceSpec) -> list[TraceRequest]:
    """The requests of ``spec``, sorted by arrival; a pure function of ``spec``."""
    spec.validate()
    rng = random.Random(spec.seed)
    arrivals = _arrivals(spec, rng)
    makers = {
        "chat": _Chat(spec, random.Random(rng.random())),
        "shared-prefix": _SharedPrefix(spec, random.Random(rng.random())),
        "agentic": _Agentic(spec, random.Random(rng.random())),
    }
    order = ("chat", "shared-prefix", "agentic")
    out = []
    for i, t in enumerate(arrivals):
        kind = order[i % 3] if spec.kind == "mixed" else spec.kind
        messages, session = makers[kind].next(i)
        out.append(TraceRequest(t, messages, spec.max_tokens, session, kind))
    return out


def to_replay_items(trace: Sequence[TraceRequest]) -> list:
    """The trace as ``simulator.core.ReplayItem`` objects (prompts tokenised the way
    the simulator's chat endpoint does)."""
    from spillway_engine.simulator.core import ReplayItem
    from spillway_engine.word_tokenizer import chat_tokens

    return [
        ReplayItem(r.arrival, chat_tokens(r.messages), r.max_tokens, rid=i, session=r.session)
        for i, r in enumerate(trace)
    ]


# --------------------------------------------------------------------------- HTTP


@dataclass
class Result:
    ok: bool
    status: int | None = None
    error: str | None = None
    url: str = ""
    ttft_measured: float | None = None
    ttft_returned: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Summary:
    requests: int = 0
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    ttft_measured_p50: float | None = None
    ttft_measured_p95: float | None = None
    ttft_returned_p50: float | None = None
    ttft_returned_p95: float | None = None
    latency_p50: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def lines(self) -> list[str]:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1000:.1f} ms"

        rate = self.requests / self.duration_s if self.duration_s else 0.0
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        out = [
            f"requests   {self.requests} ({self.ok} ok, {self.errors} errors) in "
            f"{self.duration_s:.1f} s = {rate:.2f} req/s",
            f"ttft       measured p50 {ms(self.ttft_measured_p50)}  p95 "
            f"{ms(self.ttft_measured_p95)}",
            f"ttft       returned p50 {ms(self.ttft_returned_p50)}  p95 "
            f"{ms(self.ttft_returned_p95)}",
            f"latency    p50 {ms(self.latency_p50)}",
            f"tokens     prompt {self.prompt_tokens}  completion {self.completion_tokens}  "
            f"cached {self.cached_tokens} ({hit:.1%})",
        ]
        for kind, count in sorted(self.error_kinds.items()):
            out.append(f"error      {count} x {kind}")
        return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize(results: Sequence[Result], duration_s: float) -> Summary:
    ok = [r for r in results if r.ok]
    kinds: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error or f"HTTP {r.status}"
            kinds[key] = kinds.get(key, 0) + 1
    measured = [r.ttft_measured for r in ok if r.ttft_measured is not None]
    returned = [r.ttft_returned for r in ok if r.ttft_returned is not None]
    latency = [r.latency for r in ok if r.latency is not None]
    return Summary(
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        error_kinds=kinds,
        duration_s=duration_s,
        ttft_measured_p50=percentile(measured, 50),
        ttft_measured_p95=percentile(measured, 95),
        ttft_returned_p50=percentile(returned, 50),
        ttft_returned_p95=percentile(returned, 95),
        latency_p50=percentile(latency, 50),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        completion_tokens=sum(r.completion_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok),
    )


class Router:
    """Picks a base URL per request: round-robin, or a stable hash of the session."""

    def __init__(self, urls: Sequence[str], routing: str) -> None:
        if not urls:
            raise ValueError("give at least one base URL")
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.routing = routing
        self._next = 0

    def pick(self, request: TraceRequest) -> str:
        if self.routing == "prefix-affinity":
            return self.urls[zlib.crc32(request.session.encode()) % len(self.urls)]
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        return url


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) base URL: {url!r}")
    return url


async def _send(session, url: str, request: TraceRequest, model: str | None, timeout: float):
    import aiohttp

    body: dict[str, Any] = {
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    result = Result(ok=False, url=url)
    start = time.monotonic()
    try:
        async with session.post(
            url + "/v1/chat/completions",
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            result.status = resp.status
            if resp.status != 200:
                text = (await resp.text())[:200]
                result.error = f"HTTP {resp.status}: {text}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                choices = chunk.get("choices") or []
                if choices and result.ttft_measured is None:
                    delta = choices[0].get("delta") or {}
                    if delta.get("content") or choices[0].get("text"):
                        result.ttft_measured = time.monotonic() - start
                extra = chunk.get("spillway")
                if isinstance(extra, dict) and extra.get("ttft_s") is not None:
                    result.ttft_returned = float(extra["ttft_s"])
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
            result.latency = time.monotonic() - start
            result.ok = True
    except TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientError as e:
        result.error = type(e).__name__
    except (ValueError, KeyError) as e:
        result.error = f"bad response: {type(e).__name__}"
    return result


async def run_load(
    trace: Sequence[TraceRequest],
    urls: Sequence[str],
    *,
    routing: str = "round-robin",
    concurrency: int = 64,
    timeout: float = 60.0,
    model: str | None = None,
    time_scale: float = 1.0,
) -> tuple[list[Result], float]:
    """Send ``trace`` at its arrival times (divided by ``time_scale``); at most
    ``concurrency`` requests in flight (later ones wait). Returns results and seconds."""
    import aiohttp

    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    router = Router([check_url(u) for u in urls], routing)
    limit = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    start = time.monotonic()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(request: TraceRequest, url: str) -> None:
            async with limit:
                results.append(await _send(session, url, request, model, timeout))

        tasks = []
        for request in trace:
            delay = start + request.arrival / time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request, router.pick(request))))
        await asyncio.gather(*tasks)
    return results, time.monotonic() - start


# --------------------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``loadgen`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "loadgen",
        help="replay a shared-prefix trace against OpenAI-compatible servers",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--url", action="append", required=True, help="base URL (repeatable)")
    p.add_argument("--trace", choices=TRACE_KINDS, default="chat")
    p.add_argument("--rate", type=float, default=TraceSpec.rate, help="requests per second")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    p.add_argument("--duration", type=float, help="seconds (default 60 unless --requests)")
    p.add_argument("--requests", type=int, help="number of requests")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--routing", choices=ROUTINGS, default="round-robin")
    p.add_argument("--model", help="model name to send (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=TraceSpec.max_tokens)
    p.add_argument("--users", type=int, default=TraceSpec.users)
    p.add_argument("--turns", type=int, default=TraceSpec.turns)
    p.add_argument("--prefixes", type=int, default=TraceSpec.prefixes)
    p.add_argument("--prefix-tokens", type=int, default=TraceSpec.prefix_tokens)
    p.add_argument("--agents", type=int, default=TraceSpec.agents)
    p.add_argument("--context-tokens", type=int, default=TraceSpec.context_tokens)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)
    return p


def spec_from_args(args: argparse.Namespace) -> TraceSpec:
    duration = args.duration
    if duration is None and args.requests is None:
        duration = 60.0
    return TraceSpec(
        kind=args.trace,
        rate=args.rate,
        arrival=args.arrival,
        duration=duration,
        num_requests=args.requests,
        seed=args.seed,
        max_tokens=args.max_tokens,
        users=args.users,
        turns=args.turns,
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        agents=args.agents,
        context_tokens=args.context_tokens,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``spillway loadgen``; 0 when every request succeeded, 1 otherwise, 2 for
    bad arguments."""
    try:
        spec = spec_from_args(args)
        trace = generate_trace(spec)
        for url in args.url:
            check_url(url)
        if args.concurrency < 1 or args.timeout <= 0:
            raise ValueError("concurrency and timeout must be positive")
    except ValueError as e:
        print(f"spillway loadgen: error: {e}", file=sys.stderr)
        return 2
    results, seconds = asyncio.run(
        run_load(
            trace,
            args.url,
            routing=args.routing,
            concurrency=args.concurrency,
            timeout=args.timeout,
            model=args.model,
        )
    )
    summary = summarize(results, seconds)
    if args.json:
        print(json.dumps(asdict(summary), indent=2))
    else:
        print("\n".join(summary.lines()))
    return 0 if summary.errors == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spillway")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
