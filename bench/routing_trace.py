"""The routing benches' trace and plan: bench/routing.py's virtual-time rows and its
``--gateway`` rows (bench/routing_gateway.py) replay the same requests on the same plan.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from spillway_cli.loadgen import TraceSpec, generate_trace, to_replay_items
from spillway_engine.planner.plan import read_plan
from spillway_engine.simulator.core import ReplayItem
from spillway_engine.simulator.plan_input import parse_plan

ROOT = Path(__file__).resolve().parents[1]
PLAN_FILE = ROOT / "tests" / "fixtures" / "plans" / "llama-3.2-1b-upstream.json"
GPU_KV_TOKENS = 8192
HOST_CHUNKS = 64  # 64 x 256 = 16,384 host tokens per replica: the host tier matters


def load_plan():
    data = json.loads(PLAN_FILE.read_text())
    tpc = data["kv_groups"][0]["tokens_per_block"] * data["blocks_per_chunk"]
    data.update(num_chunks=HOST_CHUNKS, capacity_tokens=HOST_CHUNKS * tpc)
    plan = read_plan(json.dumps(data), PLAN_FILE.name)
    return plan, parse_plan(plan)


def trace(n: int, duration: float, seed: int) -> list[ReplayItem]:
    """Per replica: 1.5 chat req/s over 12 users, 1 shared-prefix req/s over 3 prefixes."""
    return [item for item, _ in _trace(n, duration, seed)]


def trace_messages(n: int, duration: float, seed: int) -> dict:
    """:func:`trace`'s requests as chat messages, by ``rid`` (what the simulator's chat
    endpoint tokenizes into the same prompt ids)."""
    return {item.rid: messages for item, messages in _trace(n, duration, seed)}


def _trace(n: int, duration: float, seed: int) -> list[tuple[ReplayItem, tuple]]:
    chat = TraceSpec(kind="chat", rate=1.5 * n, duration=duration, seed=seed, users=12 * n,
                     turns=8, system_tokens=512, user_tokens=96, reply_tokens=96,
                     max_tokens=64)  # fmt: skip
    shared = TraceSpec(kind="shared-prefix", rate=1.0 * n, duration=duration, seed=seed + 1,
                       prefixes=3 * n, prefix_tokens=2048, question_tokens=64,
                       max_tokens=32)  # fmt: skip
    chats, prefixed = generate_trace(chat), generate_trace(shared)
    items = list(zip(to_replay_items(chats), [r.messages for r in chats], strict=True)) + [
        (replace(it, rid=f"s{it.rid}", session=f"p-{it.session}"), r.messages)
        for it, r in zip(to_replay_items(prefixed), prefixed, strict=True)
    ]
    return sorted(items, key=lambda pair: pair[0].arrival)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
