"""The seeded traces the autoscaling bench replays (generators, not data).

Each trace is a :class:`Scenario`: the requests (a pure function of the seed), the plan
the replicas run, their GPU KV size, the model load time, and the phases the bench
reports separately. Token counts are words (the simulator maps a word to a token).

``bursty``
    A compressed day with one burst: 2 -> 10 req/s (x5), a 270 s ramp up, 450 s at the
    peak, a 270 s ramp down; 40 % of requests share one of 12 system prompts of 2,048
    tokens, 60 % are 8-turn chats whose users join with the load. Llama-3.2-1B (one
    KV-cache group), 16,384 tokens of GPU KV per replica. 1,800 s.
``diurnal``
    A day compressed into 2,400 s: the rate follows a cosine from 1.2 req/s at night to
    12 req/s (x10) at noon and back, same mix and model as ``bursty``; the ramp is slow
    (20 minutes from trough to peak), so a policy that sees it coming wins.
``multitenant``
    Multi-tenant chat on a hybrid model (Gemma-3-1B: six sliding-window groups of
    window 512 + one full-attention group, Spillway's unit pool of 630 chunks = 161,280
    tokens, the planner's plan). 8 tenants, each with a 3,072-token system prompt its
    users share (tenant popularity Zipf-like), in 6-turn conversations; 16,384 tokens
    of GPU KV per replica, so the host tier holds most of the tenants' prompts. Load
    rises 2 -> 14 req/s and falls twice (a morning and an afternoon peak). 2,400 s.
``flash``
    A flash crowd: 2 req/s, then x5 within one minute at 600 s, held for 10 minutes,
    back within one minute; model loads take 120 s, so every policy is late and the
    question is how late and how much it keeps afterwards. 1,800 s.
``longctx``
    Long-context retrieval: prompts of 8k-32k tokens (log-uniform), a 512-token
    instruction shared by all, a quarter of them on one of 6 hot documents (8k-16k
    tokens) and the rest on documents of their own, 96-token answers; 0.25 -> 2 req/s
    (x8) and back (200 s ramps, 400 s held). Llama-3.2-1B with 1M tokens of GPU KV (what
    an H100 holds for it): prefill throughput binds long before the KV cache does. Its
    TTFT target is 4 s, twice what the longest prompt takes to prefill on an idle
    replica (four 8,192-token chunks). 1,200 s (its prompts make it the costliest trace
    to simulate).
``agentic``
    Agent sessions: each opens on one of 4 agents' 6,144-token system prompt and tool
    list, then 4-16 turns; after each 192-token reply a tool call of 1-30 s (log-uniform,
    plus 3 s for the reply) returns 100-1,500 tokens of output that the next turn
    appends. Sessions start at 0.06 -> 0.6 per second (x10, 250 s ramps, 350 s held).
    Llama-3.2-1B with 32,768 tokens of GPU KV: between turns the GPU drops what a
    session's next turn needs, the host tier (262,144 tokens a replica) keeps it.
    1,200 s.
"""

from __future__ import annotations

import bisect
import math
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from spillway_cli.loadgen import TraceSpec, generate_trace, to_replay_items
from spillway_engine.simulator.core import ReplayItem
from spillway_engine.word_tokenizer import chat_tokens

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "tests" / "fixtures" / "plans"
LLAMA_PLAN = PLANS / "llama-3.2-1b-upstream.json"
GEMMA_PLAN = PLANS / "gemma-3-1b-it-spillway.json"


@dataclass(frozen=True)
class Scenario:
    """One trace and the fleet it runs on."""

    name: str
    items: list[ReplayItem]
    duration: float
    plan_file: Path
    gpu_kv_tokens: int
    load_delay: float
    phases: tuple[tuple[str, float, float], ...]  # (name, start, end)
    summary: str = ""
    rate: Callable[[float], float] | None = field(default=None, compare=False)
    #: the trace's own TTFT target (s), where 2 s is not what its users are promised
    ttft_target: float | None = None


# ----------------------------------------------------------------------------- rates


def _warp(rate: Callable[[float], float], duration: float, step: float = 1.0):
    """Cumulative intensity on a grid, and its inverse: arrivals of a rate-1 Poisson
    process in "operational time" s map to a Poisson process of intensity ``rate``."""
    ts, cum = [0.0], [0.0]
    t = 0.0
    while t < duration:
        nt = min(duration, t + step)
        cum.append(cum[-1] + 0.5 * (rate(t) + rate(nt)) * (nt - t))
        ts.append(nt)
        t = nt

    def inverse(s: float) -> float:
        i = min(max(bisect.bisect_left(cum, s), 1), len(cum) - 1)
        c0, c1 = cum[i - 1], cum[i]
        return ts[i - 1] + (ts[i] - ts[i - 1]) * ((s - c0) / (c1 - c0) if c1 > c0 else 0.0)

    return cum[-1], inverse


def _stream(spec: TraceSpec, rate: Callable[[float], float], duration: float, tag: str):
    """``spec``'s requests with arrivals following ``rate`` (a time-warped rate-1 stream)."""
    total, inverse = _warp(rate, duration)
    if total <= 0:
        return []
    items = to_replay_items(generate_trace(replace(spec, rate=1.0, duration=total)))
    return [
        ReplayItem(inverse(it.arrival), it.prompt, it.max_tokens, session=f"{tag}/{it.session}")
        for it in items
    ]


def _trapezoid(t: float, start: float, rise: float, hold: float) -> float:
    """0 before ``start``, up to 1 over ``rise`` seconds, 1 for ``hold``, down over
    ``rise``, then 0."""
    if t <= start or t >= start + 2 * rise + hold:
        return 0.0
    if t < start + rise:
        return (t - start) / rise
    if t <= start + rise + hold:
        return 1.0
    return (start + 2 * rise + hold - t) / rise


def _numbered(items: list[ReplayItem]) -> list[ReplayItem]:
    items.sort(key=lambda it: it.arrival)
    return [replace(it, rid=i) for i, it in enumerate(items)]


# ----------------------------------------------------------------------------- bursty


@dataclass(frozen=True)
class Shape:
    """The bursty trace's shape (see the module docstring)."""

    duration: float = 1800.0
    base_rate: float = 2.0
    burst_factor: float = 5.0
    burst_start: float = 0.20  # fractions of duration
    ramp: float = 0.15
    plateau: float = 0.25
    shared_share: float = 0.4
    prefixes: int = 12
    prefix_tokens: int = 2048
    question_tokens: int = 64
    base_users: int = 12
    turns: int = 8
    system_tokens: int = 512
    user_tokens: int = 128
    reply_tokens: int = 256
    max_tokens: int = 256

    def bump(self, t: float) -> float:
        d = self.duration
        return _trapezoid(t, self.burst_start * d, self.ramp * d, self.plateau * d)

    def phases(self) -> list[tuple[float, float]]:
        """[start, end) of the phases before, during and after the burst (ramps included)."""
        d = self.duration
        t0 = self.burst_start * d
        t3 = t0 + (2 * self.ramp + self.plateau) * d
        return [(0.0, t0), (t0, t3), (t3, d)]

    def total_rate(self, t: float) -> float:
        return self.base_rate * (1.0 + (self.burst_factor - 1.0) * self.bump(t))


def _chat_spec(shape: Shape) -> TraceSpec:
    return TraceSpec(kind="chat", users=shape.base_users, turns=shape.turns,
                     system_tokens=shape.system_tokens, user_tokens=shape.user_tokens,
                     reply_tokens=shape.reply_tokens, max_tokens=shape.max_tokens)  # fmt: skip


def _shared_spec(shape: Shape, seed: int) -> TraceSpec:
    return TraceSpec(kind="shared-prefix", prefixes=shape.prefixes,
                     prefix_tokens=shape.prefix_tokens, question_tokens=shape.question_tokens,
                     max_tokens=shape.max_tokens, seed=seed)  # fmt: skip


def _mixed(shape: Shape, seed: int, rate: Callable[[float], float], base: float,
           extra_users: int) -> list[ReplayItem]:  # fmt: skip
    """The shared-prefix + chat mix at total rate ``rate``: the shared stream follows
    ``shared_share`` of it; chat has ``base_users`` users at ``base`` * the chat share
    all the time plus ``extra_users`` who carry the rest (so a user's pace is the same
    at every load and the working set grows with it)."""
    d = shape.duration
    c = 1.0 - shape.shared_share
    chat = _chat_spec(shape)
    items = _stream(_shared_spec(shape, seed * 3 + 1),
                    lambda t: shape.shared_share * rate(t), d, "sp")  # fmt: skip
    items += _stream(replace(chat, seed=seed * 3 + 2), lambda t: c * base, d, "base")
    items += _stream(replace(chat, seed=seed * 3 + 3, users=max(1, extra_users)),
                     lambda t: c * max(0.0, rate(t) - base), d, "burst")  # fmt: skip
    return _numbered(items)


def make_trace(shape: Shape, seed: int) -> list[ReplayItem]:
    """The seeded bursty trace: shared-prefix stream + base chat users + burst-only chat
    users."""
    extra = max(1, round(shape.base_users * (shape.burst_factor - 1.0)))
    return _mixed(shape, seed, shape.total_rate, shape.base_rate, extra)


def bursty(seed: int, duration: float = 1800.0) -> Scenario:
    shape = Shape(duration=duration)
    (b0, b1), (b2, b3), (b4, b5) = shape.phases()
    return Scenario(
        "bursty", make_trace(shape, seed), duration, LLAMA_PLAN, 16384, 120.0,
        (("before", b0, b1), ("burst", b2, b3), ("after", b4, b5)),
        "2 -> 10 req/s burst (270 s ramps), shared prompts + chat, Llama-3.2-1B",
        shape.total_rate,
    )  # fmt: skip


# ----------------------------------------------------------------------------- diurnal


def diurnal(seed: int, duration: float = 2400.0, low: float = 1.2, high: float = 12.0
            ) -> Scenario:  # fmt: skip
    def rate(t: float) -> float:
        return low + (high - low) * 0.5 * (1.0 - math.cos(2 * math.pi * t / duration))

    shape = Shape(duration=duration, base_rate=low)
    extra = round(shape.base_users * (high / low - 1.0))
    q = duration / 4
    return Scenario(
        "diurnal", _mixed(shape, seed, rate, low, extra), duration, LLAMA_PLAN, 16384,
        120.0, (("rise", 0.0, q), ("peak", q, 3 * q), ("fall", 3 * q, duration)),
        f"{low:g} -> {high:g} req/s (x10) cosine day, shared prompts + chat, Llama-3.2-1B",
        rate,
    )  # fmt: skip


# ----------------------------------------------------------------------------- flash crowd


def flash(seed: int, duration: float = 1800.0, base: float = 2.0, factor: float = 5.0,
          start: float = 600.0, rise: float = 60.0, hold: float = 600.0) -> Scenario:  # fmt: skip
    def rate(t: float) -> float:
        return base * (1.0 + (factor - 1.0) * _trapezoid(t, start, rise, hold))

    shape = Shape(duration=duration, base_rate=base)
    extra = round(shape.base_users * (factor - 1.0))
    end = start + 2 * rise + hold
    return Scenario(
        "flash", _mixed(shape, seed, rate, base, extra), duration, LLAMA_PLAN, 16384, 120.0,
        (("before", 0.0, start), ("crowd", start, end), ("after", end, duration)),
        f"{base:g} -> {base * factor:g} req/s within {rise:.0f} s at {start:.0f} s, held "
        f"{hold:.0f} s, Llama-3.2-1B", rate,
    )  # fmt: skip


# ----------------------------------------------------------------------------- multi-tenant


@dataclass(frozen=True)
class Tenants:
    duration: float = 2400.0
    low: float = 2.0
    high: float = 14.0
    tenants: int = 8
    system_tokens: int = 3072
    turns: int = 6
    user_tokens: int = 96
    reply_tokens: int = 192
    max_tokens: int = 192

    def rate(self, t: float) -> float:
        # Two peaks (morning, afternoon) over the span: |sin| of a half-day each.
        x = math.sin(2 * math.pi * t / self.duration)
        return self.low + (self.high - self.low) * x * x

    def weights(self) -> list[float]:
        return [1.0 / (k + 1) for k in range(self.tenants)]  # Zipf-like popularity


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(1_000_000)}" for _ in range(n))


def multitenant_items(spec: Tenants, seed: int) -> list[ReplayItem]:
    """Conversations that start on a tenant's shared system prompt and grow by one user
    turn (and the previous reply) per request; a new conversation opens whenever the
    arrivals outpace the open ones (each open conversation takes a turn at a time)."""
    rng = random.Random(seed * 7 + 5)
    systems = [_words(rng, spec.system_tokens) for _ in range(spec.tenants)]
    total, inverse = _warp(spec.rate, spec.duration)
    weights = spec.weights()
    s, conv_id = 0.0, 0
    open_convs: list[tuple[int, list[dict[str, str]], str]] = []  # tenant, messages, id
    items: list[ReplayItem] = []
    while True:
        s += rng.expovariate(1.0)
        if s > total:
            break
        t = inverse(s)
        # A user continues one of the open conversations, or opens a new one as often
        # as it keeps the number open proportional to the load.
        want_open = max(4, round(6 * spec.rate(t)))
        if open_convs and (len(open_convs) >= want_open or rng.random() < 0.75):
            k = rng.randrange(len(open_convs))
            tenant, conv, cid = open_convs[k]
        else:
            tenant = rng.choices(range(spec.tenants), weights)[0]
            conv, cid = [{"role": "system", "content": systems[tenant]}], f"mt/{conv_id}"
            conv_id += 1
            open_convs.append((tenant, conv, cid))
            k = len(open_convs) - 1
        conv.append({"role": "user", "content": _words(rng, spec.user_tokens)})
        items.append(ReplayItem(t, chat_tokens(conv), spec.max_tokens, session=cid))
        conv.append({"role": "assistant", "content": _words(rng, spec.reply_tokens)})
        if (len(conv) - 1) // 2 >= spec.turns:
            open_convs.pop(k)
    return _numbered(items)


def multitenant(seed: int, duration: float = 2400.0) -> Scenario:
    spec = Tenants(duration=duration)
    q = duration / 8
    return Scenario(
        "multitenant", multitenant_items(spec, seed), duration, GEMMA_PLAN, 16384, 120.0,
        (("peak1", 0.0, 4 * q), ("peak2", 4 * q, duration)),
        f"{spec.tenants} tenants x {spec.system_tokens}-token system prompts, "
        f"{spec.turns}-turn chats, {spec.low:g} -> {spec.high:g} req/s twice, "
        "Gemma-3-1B (7 KV-cache groups, Spillway unit pool)", spec.rate,
    )  # fmt: skip


# ----------------------------------------------------------------------------- long context


def _tokens(rng: random.Random, n: int) -> array:
    """``n`` random token ids (no two documents share a prefix by chance)."""
    return array("I", rng.choices(range(16, 32000), k=n))


@dataclass(frozen=True)
class Retrieval:
    """The long-context retrieval trace's shape (see the module docstring)."""

    duration: float = 1200.0
    low: float = 0.25
    high: float = 2.0
    start: float = 200.0
    rise: float = 200.0
    hold: float = 400.0
    shortest: int = 8000
    longest: int = 32000
    instruction_tokens: int = 512
    hot_documents: int = 6
    hot_share: float = 0.25
    question_tokens: int = 64
    max_tokens: int = 96

    def rate(self, t: float) -> float:
        return self.low + (self.high - self.low) * _trapezoid(t, self.start, self.rise, self.hold)


def retrieval_items(spec: Retrieval, seed: int) -> list[ReplayItem]:
    rng = random.Random(seed * 11 + 7)
    instruction = _tokens(rng, spec.instruction_tokens)
    hot = [_tokens(rng, rng.randint(spec.shortest, spec.longest // 2))
           for _ in range(spec.hot_documents)]  # fmt: skip
    total, inverse = _warp(spec.rate, spec.duration)
    items: list[ReplayItem] = []
    s, n = 0.0, 0
    lo, hi = math.log(spec.shortest), math.log(spec.longest)
    while True:
        s += rng.expovariate(1.0)
        if s > total:
            break
        want = round(math.exp(rng.uniform(lo, hi)))
        if rng.random() < spec.hot_share:
            k = rng.randrange(spec.hot_documents)
            doc, session = hot[k], f"doc/{k}"
        else:
            doc = _tokens(rng, max(0, want - spec.instruction_tokens - spec.question_tokens))
            session = f"q/{n}"
        prompt = instruction + doc + _tokens(rng, spec.question_tokens)
        items.append(ReplayItem(inverse(s), prompt, spec.max_tokens, session=session))
        n += 1
    return _numbered(items)


def longctx(seed: int, duration: float = 1200.0) -> Scenario:
    spec = Retrieval(duration=duration)
    end = spec.start + 2 * spec.rise + spec.hold
    return Scenario(
        "longctx", retrieval_items(spec, seed), duration, LLAMA_PLAN, 1 << 20, 120.0,
        (("before", 0.0, spec.start), ("peak", spec.start, end), ("after", end, duration)),
        f"{spec.shortest // 1000}k-{spec.longest // 1000}k-token prompts, "
        f"{spec.hot_documents} hot documents, {spec.low:g} -> {spec.high:g} req/s, "
        "Llama-3.2-1B, 1M tokens of GPU KV", spec.rate, ttft_target=4.0,
    )  # fmt: skip


# ----------------------------------------------------------------------------- agentic


@dataclass(frozen=True)
class Agents:
    """The agentic trace's shape (see the module docstring)."""

    duration: float = 1200.0
    low: float = 0.06  # sessions started per second
    high: float = 0.6
    start: float = 200.0
    rise: float = 250.0
    hold: float = 350.0
    agents: int = 4
    system_tokens: int = 6144
    task_tokens: int = 256
    min_turns: int = 4
    max_turns: int = 16
    reply_tokens: int = 192
    min_tool_tokens: int = 100
    max_tool_tokens: int = 1500
    min_pause: float = 1.0
    max_pause: float = 30.0
    reply_seconds: float = 3.0

    def rate(self, t: float) -> float:
        return self.low + (self.high - self.low) * _trapezoid(t, self.start, self.rise, self.hold)


def agentic_items(spec: Agents, seed: int) -> list[ReplayItem]:
    """Each session: a system prompt, a task, then turns whose prompt is the whole
    session so far; a turn's reply and the tool output it asked for are appended, and
    the next turn comes a tool call later (generators, not data: arrival times are
    fixed in advance, as an open-loop replay needs)."""
    rng = random.Random(seed * 13 + 3)
    systems = [_words(rng, spec.system_tokens) for _ in range(spec.agents)]
    total, inverse = _warp(spec.rate, spec.duration)
    items: list[ReplayItem] = []
    s, sid = 0.0, 0
    log_pause = (math.log(spec.min_pause), math.log(spec.max_pause))
    log_tool = (math.log(spec.min_tool_tokens), math.log(spec.max_tool_tokens))
    while True:
        s += rng.expovariate(1.0)
        if s > total:
            break
        t = inverse(s)
        agent = rng.randrange(spec.agents)
        conv = [{"role": "system", "content": systems[agent]},
                {"role": "user", "content": _words(rng, spec.task_tokens)}]  # fmt: skip
        for _ in range(rng.randint(spec.min_turns, spec.max_turns)):
            if t >= spec.duration:
                break
            items.append(ReplayItem(t, array("I", chat_tokens(conv)), spec.reply_tokens,
                                    session=f"ag/{sid}"))  # fmt: skip
            conv.append({"role": "assistant", "content": _words(rng, spec.reply_tokens)})
            tool = round(math.exp(rng.uniform(*log_tool)))
            conv.append({"role": "tool", "content": _words(rng, tool)})
            t += spec.reply_seconds + math.exp(rng.uniform(*log_pause))
        sid += 1
    return _numbered(items)


def agentic(seed: int, duration: float = 1200.0) -> Scenario:
    spec = Agents(duration=duration)
    end = spec.start + 2 * spec.rise + spec.hold
    return Scenario(
        "agentic", agentic_items(spec, seed), duration, LLAMA_PLAN, 32768, 120.0,
        (("before", 0.0, spec.start), ("peak", spec.start, end), ("after", end, duration)),
        f"agent sessions ({spec.system_tokens}-token shared context, {spec.min_turns}-"
        f"{spec.max_turns} turns, {spec.min_pause:g}-{spec.max_pause:g} s tool calls), "
        f"{spec.low:g} -> {spec.high:g} sessions/s, Llama-3.2-1B, 32k tokens of GPU KV",
        spec.rate,
    )  # fmt: skip


TRACES: dict[str, Callable[..., Scenario]] = {
    "bursty": bursty,
    "diurnal": diurnal,
    "multitenant": multitenant,
    "flash": flash,
    "longctx": longctx,
    "agentic": agentic,
}
