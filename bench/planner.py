"""Planner latency: make_plan per model (target < 1 ms), and the CLI end to end (< 1 s).

Run: python -m bench.planner [--repeat N]. Prints a table; asserts nothing. The planner
must not import vLLM, and the last line checks that it did not. Wall time (median, max)
and CPU time of the planning thread (median): on a machine other processes load, the
wall time counts the waits for a core and the CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from spillway_engine.planner.plan import PlanRequest, make_plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "fixtures" / "models"
FRONTIER = ROOT / "tests" / "contract" / "frontier_configs"

CASES = [
    ("llama-3.1-70b-instruct", 8),
    ("gemma-3-27b-it", 1),
    ("gpt-oss-120b", 1),
    ("qwen3-next-80b-a3b-instruct", 4),
    ("deepseek-v3", 8),
    ("jamba-mini-1.5", 2),
    ("nemotron-h-8b-base-8k", 1),
    ("phi-3-mini-4k-instruct", 1),
    # the 2026 frontier (tests/contract/frontier_configs)
    ("kimi-linear-48b-a3b", 1),
    ("granite-4.0-h-small", 2),
    ("qwen3.5-35b-a3b", 2),
    ("minimax-m2", 8),
    ("olmo-3-7b", 1),
    ("step-3.5-flash", 8),
    ("gemma-4-31b", 2),
    ("gemma-4-e2b", 1),
    ("glm-5.3-flash", 4),
    ("deepseek-v4-flash", 8),
]
#: cases planned on another GPU or with a drafter: name -> PlanRequest fields
EXTRA = {
    "kimi-linear-48b-a3b": {"max_model_len": 4096},
    "granite-4.0-h-small": {"max_model_len": 2048},
    "gemma-4-31b": {"gpu": "a100"},  # Hopper refused by name (FlashAttention 4)
    "gemma-4-e2b": {"gpu": "a100"},
    # Spillway's connector refuses DeepSeek-V4's packed groups; vLLM's offloader plans
    "deepseek-v4-flash": {"offloader": "upstream"},
}
SPECULATIVE = [("qwen3.5-35b-a3b", 2, 3), ("deepseek-v3", 8, 1), ("deepseek-v4-flash", 8, 3)]
#: an fp8 KV cache where it changes the backend: (name, TP)
FP8 = [("glm-5.3-flash", 4)]
#: a separate drafter: (target, TP, method, draft tokens, drafter's config)
DRAFTERS = [
    ("llama-3.1-8b-instruct", 1, "eagle3", 3, "eagle3-llama3.1-instruct-8b"),
    ("qwen3-8b", 2, "draft_model", 4, "qwen3-0.6b"),
    ("llama-3.1-70b-instruct", 8, "draft_model", 5, "llama-3.2-1b"),
]


def _config(name: str) -> dict:
    # the frontier copies first: they add what the first set lacks (Granite's layer_types)
    path = FRONTIER / f"{name}.json"
    return json.loads((path if path.exists() else MODELS / f"{name}.json").read_text())["config"]


def bench_plan(
    name: str, tp: int, repeat: int, draft: str | None = None, **fields: object
) -> tuple[float, float, float, int]:
    config = _config(name)
    draft_config = None if draft is None else _config(draft)
    request = PlanRequest(
        tensor_parallel_size=tp, cpu_memory_bytes=64 * 2**30, **{**EXTRA.get(name, {}), **fields}
    )
    make_plan(config, request, draft_config)  # warm caches (pydantic validators)
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.thread_time()
        plan = make_plan(config, request, draft_config)
        cpu.append((time.thread_time() - start_cpu) * 1000)
        wall.append((time.perf_counter() - start) * 1000)
    return statistics.median(wall), max(wall), statistics.median(cpu), len(plan.kv_groups)


def bench_cli(repeat: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "spillway_cli.main",
        "plan",
        "--model-config",
        str(MODELS / "gemma-3-27b-it.json"),
        "--cpu-memory",
        "64Gi",
    ]
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    print(
        f"{'model':48} {'TP':>3} {'groups':>6} {'median ms':>10} {'max ms':>8} "
        f"{'CPU median ms':>14}"
    )

    def row(label: str, tp: int, figures: tuple[float, float, float, int]) -> None:
        median, worst, cpu, groups = figures
        print(f"{label:48} {tp:>3} {groups:>6} {median:>10.3f} {worst:>8.3f} {cpu:>14.3f}")

    for name, tp in CASES:
        row(name, tp, bench_plan(name, tp, args.repeat))
    for name, tp, tokens in SPECULATIVE:
        figures = bench_plan(
            name, tp, args.repeat, speculative_method="mtp", num_speculative_tokens=tokens
        )
        row(f"{name} + MTP x{tokens}", tp, figures)
    for name, tp in FP8:
        row(f"{name} fp8", tp, bench_plan(name, tp, args.repeat, kv_cache_dtype="fp8"))
    for name, tp, method, tokens, draft in DRAFTERS:
        figures = bench_plan(
            name,
            tp,
            args.repeat,
            draft,
            speculative_method=method,
            num_speculative_tokens=tokens,
            speculative_model=draft,
        )
        row(f"{name} + {draft} x{tokens}", tp, figures)
    print(f"\nspillway plan (gemma-3-27b-it, table), median of 5 runs: {bench_cli(5):.2f} s")
    print(f"vllm imported by the planner: {'vllm' in sys.modules}")


if __name__ == "__main__":
    main()
