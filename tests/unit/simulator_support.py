"""Shared helpers for the simulator tests: plan fixtures and small prompt builders."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from spillway_engine.planner.plan import read_plan
from spillway_engine.simulator.core import EngineCore, LatencyModel, SchedulerConfig
from spillway_engine.simulator.plan_input import SimPlan, gpu_blocks_for_tokens, parse_plan

PLANS = Path(__file__).parents[1] / "fixtures" / "plans"
LLAMA = "llama-3.2-1b-upstream.json"
GEMMA = "gemma-3-1b-it-spillway.json"
QWEN_NEXT = "qwen3-next-80b-a3b-instruct-upstream.json"
DEEPSEEK = "deepseek-v2-lite-spillway.json"


def plan_dict(name: str = LLAMA, **overrides: Any) -> dict[str, Any]:
    data = json.loads((PLANS / name).read_text())
    data.update(overrides)
    return data


def sim_plan(name: str = LLAMA, num_chunks: int | None = None) -> SimPlan:
    data = plan_dict(name)
    if num_chunks is not None:
        tpc = data["kv_groups"][0]["tokens_per_block"] * data["blocks_per_chunk"]
        data.update(num_chunks=num_chunks, capacity_tokens=num_chunks * tpc)
        spillway = data.get("spillway")
        if data["offloader"] == "spillway" and spillway:
            # the unit pool holds num_chunks chunks of every group: that many units
            # times the units of one chunk of every group (the plan's own rule)
            per_chunk = sum(g["units"] for g in spillway["groups"])
            spillway.update(
                num_units=num_chunks * per_chunk,
                num_chunks=num_chunks,
                capacity_tokens=num_chunks * spillway["chunk_tokens"],
            )
    return parse_plan(read_plan(json.dumps(data), name))


def make_core(
    name: str = LLAMA,
    *,
    gpu_tokens: int = 16384,
    num_chunks: int | None = None,
    seed: int = 0,
    jitter: float = 0.0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> EngineCore:
    plan = sim_plan(name, num_chunks)
    return EngineCore(
        plan,
        gpu_blocks=gpu_blocks_for_tokens(plan, gpu_tokens),
        latency=LatencyModel(jitter=jitter),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        seed=seed,
    )


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 32000) for _ in range(n)]


def run_one(core: EngineCore, prompt: list[int], max_tokens: int = 4):
    req = core.add_request(prompt, max_tokens)
    core.run_until_idle()
    return req
