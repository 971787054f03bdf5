"""How fast the simulator's bookkeeping runs: requests/s of the virtual-time core.

Replays load-generator traces through ``EngineCore`` (no HTTP, no sleeping) for several
plans and prints one table row per (plan, trace). Target: at least 500 requests per
second of one core. ``req/cpu-s`` divides by the process's CPU time (robust when other
work shares the machine); ``req/wall-s`` by the wall clock. The ``+metrics`` rows also
feed the Prometheus exporter (histograms per token), as the HTTP server does.

    python bench/simulator.py [--requests N] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine"))

from spillway_cli.loadgen import TraceSpec, generate_trace, to_replay_items  # noqa: E402
from spillway_engine.simulator.core import EngineCore, replay  # noqa: E402
from spillway_engine.simulator.plan_input import gpu_blocks_for_tokens, load_plan  # noqa: E402
from spillway_engine.simulator.prom import SimulatorMetrics  # noqa: E402

PLANS = ROOT / "tests" / "fixtures" / "plans"
CASES = [
    ("llama-3.2-1b-upstream.json", "Llama-3.2-1B"),
    ("gemma-3-1b-it-spillway.json", "Gemma-3-1B (7 groups)"),
    ("qwen3-next-80b-a3b-instruct-upstream.json", "Qwen3-Next TP4 (Mamba)"),
    ("deepseek-v2-lite-spillway.json", "DeepSeek-V2-Lite (MLA)"),
]
TRACES = {
    "chat": dict(
        kind="chat", users=32, turns=8, system_tokens=256, user_tokens=128, reply_tokens=128
    ),
    "shared-prefix": dict(
        kind="shared-prefix", prefixes=40, prefix_tokens=2048, question_tokens=64
    ),
    "agentic": dict(kind="agentic", agents=8, context_tokens=4096, step_tokens=256, loop_steps=8),
}


def run_case(plan_file: str, trace: str, requests: int, with_metrics: bool) -> dict:
    plan = load_plan(PLANS / plan_file)
    core = EngineCore(plan, gpu_blocks=gpu_blocks_for_tokens(plan, 65536), seed=1)
    if with_metrics:
        SimulatorMetrics(core)
    spec = TraceSpec(
        rate=8, num_requests=requests, duration=None, max_tokens=64, seed=2, **TRACES[trace]
    )
    items = to_replay_items(generate_trace(spec))
    start, cpu_start = time.perf_counter(), time.process_time()
    reqs = replay(core, items)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    c = core.counters
    return {
        "requests": len(reqs),
        "prompt": sum(r.prompt_len for r in reqs) / len(reqs),
        "wall": wall,
        "cpu": cpu,
        "rps": len(reqs) / cpu,
        "wall_rps": len(reqs) / wall,
        "modelled": core.now,
        "host": c.cached_host / max(1, c.prompt_tokens),
        "device": c.cached_device / max(1, c.prompt_tokens),
        "preempt": c.preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="one plan, 300 requests")
    args = parser.parse_args(argv)
    cases = CASES[:1] if args.quick else CASES
    requests = 300 if args.quick else args.requests
    header = (
        f"{'plan':26} {'trace':14} {'mode':9} {'reqs':>5} {'prompt':>7} {'cpu s':>6} "
        f"{'req/cpu-s':>9} {'req/wall-s':>10} {'model s':>8} {'dev hit':>7} {'host hit':>8} "
        f"{'preempt':>7}"
    )
    print(header)
    print("-" * len(header))
    worst = float("inf")
    for plan_file, label in cases:
        for trace in TRACES:
            for with_metrics in (False, True):
                r = run_case(plan_file, trace, requests, with_metrics)
                if not with_metrics:
                    worst = min(worst, r["rps"])
                mode = "+metrics" if with_metrics else "core"
                print(
                    f"{label:26} {trace:14} {mode:9} {r['requests']:>5} {r['prompt']:>7.0f} "
                    f"{r['cpu']:>6.2f} {r['rps']:>9.0f} {r['wall_rps']:>10.0f} "
                    f"{r['modelled']:>8.1f} {r['device']:>7.1%} {r['host']:>8.1%} "
                    f"{r['preempt']:>7}",
                    flush=True,
                )
    print(f"\nslowest core row: {worst:.0f} requests per CPU second (target >= 500)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
