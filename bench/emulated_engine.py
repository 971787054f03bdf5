"""One emulated engine: start-up time, memory, and requests per second on one core.

    python bench/emulated_engine.py [--models llama,gemma3,qwen3-next] [--seconds 20]
                                    [--clients 16] [--no-pin]

(from the repository root; prints a table, asserts nothing.)

For each tiny model (spillway_engine.emulator.tiny: a Llama, a Gemma-3-style
sliding-window + full model, a Qwen3-Next-style Gated DeltaNet hybrid) it plans the
model for an H100 (max_model_len 1024, 16 MiB host pool) and launches the pod's
entry point, ``spillway-engine serve --emulate-gpu --emulate-speed 0`` (vLLM 0.33's
API server and engine core, Spillway's plan check and offloader with its pool in the
shared region, as on a GPU node; no step-time sleeping), pinned with
``taskset -c 0`` to one core, API server and engine core together (a pod with
``cpu: 1``). It measures

* start-up: launch until ``/health`` answers 200 (wall seconds, and the CPU seconds the
  engine's processes spent by then: nearly all of it is Python importing vLLM in both
  processes), and vLLM's own "init engine" seconds;
* memory: RSS of every process of the engine (API server, engine core, helpers)
  after the load, and the bytes of shared memory they map (the host pool's region
  and vLLM's message rings), counted once per file;
* throughput: requests per second completed by ``--clients`` closed-loop clients
  (the client runs unpinned, off the engine's core) for ``--seconds`` each with
  short prompts (32 tokens) and long prompts (896 tokens), every prompt unique (no
  prefix-cache hits), 16 tokens out each (``ignore_eos``); and requests per CPU-second
  of the engine's processes, what the engine sustains on a core of its own.

The wall figures depend on what else the machine runs (the load average is printed
beside them); the CPU-second figures much less.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "engine"), str(ROOT / "operator")]

import aiohttp  # noqa: E402

from e2e.engine_process import (  # noqa: E402
    Server,
    free_port,
    group_pids,
    kill_group,
    launch,
    plan_for,
    wait_ready,
    write_plan,
)
from spillway_engine.emulator.tiny import (  # noqa: E402
    gemma3_config,
    llama_config,
    qwen3_next_config,
    write_model,
)

MIB = 1 << 20
KV_BYTES = 64 * MIB  # the emulated GPU's KV budget (CPU tensors)
OUT_TOKENS = 16
PROMPTS = {"short": 32, "long": 896}
VOCAB = (3, 500)
MODELS = {
    "llama": lambda: llama_config(num_layers=2),
    "gemma3": lambda: gemma3_config(num_layers=4, sliding_window=64),
    "qwen3-next": lambda: qwen3_next_config(num_layers=4),
}


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    m = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(m.group(1)) / 1024 if m else 0.0


def argv0(pid: int) -> str:
    """The process's argv[0] (vLLM renames its engine core ``VLLM::EngineCore`` there;
    /proc/PID/comm keeps only 15 characters)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of the processes and of their children that have exited."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)"
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / tick


def shm_bytes(pids: list[int], folders: list[Path]) -> int:
    """Bytes of the shared-memory files the processes map (each file once)."""
    seen: dict[str, int] = {}
    prefixes = tuple(str(f) for f in folders)
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            path = parts[5].removesuffix(" (deleted)") if len(parts) == 6 else ""
            if path.startswith(prefixes) and path not in seen:
                try:
                    seen[path] = os.stat(path).st_blocks * 512  # allocated, not apparent
                except OSError:  # unlinked while mapped: count the mapping's length
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    seen[path] = hi - lo
    return sum(seen.values())


async def closed_loop(url: str, prompt_tokens: int, clients: int, seconds: float,
                      seed: int) -> tuple[int, int, float]:
    """(completed, failed, elapsed): ``clients`` tasks, each one request at a time."""
    done = failed = 0
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=120)

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal done, failed
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            body = {"model": "tiny", "prompt": [rng.randrange(*VOCAB) for _ in range(
                prompt_tokens)], "max_tokens": OUT_TOKENS, "temperature": 0,
                "ignore_eos": True}
            try:
                async with session.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
                    else:
                        failed += 1
            except aiohttp.ClientError:
                failed += 1

    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    return done, failed, time.monotonic() - start


def bench_model(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    root = work / name
    model_dir = write_model(root / "model", MODELS[name]())
    plan = plan_for(model_dir)
    plan_path = write_plan(root / "plan", plan, model_dir)
    shm = root / "shm"
    shm.mkdir(parents=True, exist_ok=True)
    log = root / "engine.log"
    port = free_port()
    pin = [] if args.no_pin or not shutil.which("taskset") else ["taskset", "-c", "0"]
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = launch(plan_path, log, port, KV_BYTES, prefix=pin,
                  env={"SPILLWAY_SHARED_REGION": "1", "SPILLWAY_SHM_DIR": str(shm)})
    server = Server(name, proc, port, log, plan, 0.0)
    row: dict[str, Any] = {"model": name, "groups": len(plan.kv_groups), "load": load0}
    try:
        wait_ready(server)
        row["startup_s"] = time.monotonic() - t0
        row["startup_cpu_s"] = cpu_seconds(group_pids(proc.pid))
        m = re.search(r"init engine .* took ([\d.]+) s", server.log_text())
        row["init_s"] = float(m.group(1)) if m else float("nan")
        url = f"http://127.0.0.1:{port}"
        for i, (kind, tokens) in enumerate(PROMPTS.items()):
            asyncio.run(closed_loop(url, tokens, 2, 3, 99 + i))  # warm the path
            cpu0 = cpu_seconds(group_pids(proc.pid))
            done, failed, elapsed = asyncio.run(
                closed_loop(url, tokens, args.clients, args.seconds, i))
            cpu = cpu_seconds(group_pids(proc.pid)) - cpu0
            row[f"{kind}_rps"] = done / elapsed
            # What a core of its own would sustain: requests per CPU-second the
            # engine's processes spent (the wall rate shares the core with the machine).
            row[f"{kind}_per_cpu_s"] = done / cpu if cpu > 0 else float("nan")
            row[f"{kind}_failed"] = failed
        pids = group_pids(proc.pid)
        # After exec, the launched process is vLLM's API server; the engine core is its
        # child; anything else (resource tracker, compile workers) is "other".
        row["api_mib"] = rss_mib(proc.pid)
        row["core_mib"] = sum(rss_mib(p) for p in pids if argv0(p) == "VLLM::EngineCore")
        row["other_mib"] = sum(rss_mib(p) for p in pids) - row["api_mib"] - row["core_mib"]
        row["shm_mib"] = shm_bytes(pids, [shm, Path("/dev/shm")]) / MIB
    finally:
        kill_group(proc)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seconds", type=float, default=20.0, help="per prompt length")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--no-pin", action="store_true", help="do not pin the engine to core 0")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = set(names) - set(MODELS)
    if unknown:
        ap.error(f"unknown model(s) {sorted(unknown)}; known: {', '.join(MODELS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-emulated-") as tmp:
        for name in names:
            print(f"{name}: starting ...", file=sys.stderr, flush=True)
            rows.append(bench_model(name, Path(tmp), args))
    pinned = "one core (taskset -c 0)" if not args.no_pin else "unpinned"
    print(f"\nOne emulated engine ({pinned}, --emulate-speed 0, emulated KV "
          f"{KV_BYTES // MIB} MiB, host pool 16 MiB in the shared region); "
          f"{args.clients} closed-loop clients, {args.seconds:g} s per prompt length, "
          f"{OUT_TOKENS} tokens out; {os.cpu_count()} CPUs on this machine\n")
    head = (f"{'model':<11} {'groups':>6} {'start-up s':>10} {'start-up CPU s':>14} "
            f"{'init s':>6} {'API server MiB':>14} {'engine core MiB':>15} {'other MiB':>9} "
            f"{'shm MiB':>7} {'rps short':>9} {'rps long':>8} {'req/CPU-s short':>15} "
            f"{'req/CPU-s long':>14} {'load avg':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<11} {r['groups']:>6} {r['startup_s']:>10.1f} "
              f"{r['startup_cpu_s']:>14.1f} {r['init_s']:>6.2f} {r['api_mib']:>14.0f} "
              f"{r['core_mib']:>15.0f} {r['other_mib']:>9.0f} {r['shm_mib']:>7.1f} "
              f"{r['short_rps']:>9.1f} {r['long_rps']:>8.1f} {r['short_per_cpu_s']:>15.1f} "
              f"{r['long_per_cpu_s']:>14.1f} {r['load']:>8.1f}")
    failed = sum(r["short_failed"] + r["long_failed"] for r in rows)
    print(f"\nshort: {PROMPTS['short']}-token prompts; long: {PROMPTS['long']}-token prompts; "
          f"failed requests: {failed}. start-up: launch to /health 200; init: vLLM's 'init "
          "engine (profile, create kv cache, warmup model)'; start-up CPU s: CPU seconds its "
          "processes spent until then. rps: requests per wall second on the shared core; "
          "req/CPU-s: requests per CPU-second of the engine's processes, what a core of its "
          "own sustains. other: the engine's helper processes (resource tracker, compile "
          "workers). load avg: 1-minute, at launch.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
