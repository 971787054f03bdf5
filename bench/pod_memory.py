"""Pod memory: the plan's figures against the real processes of an emulated engine.

``python bench/pod_memory.py [--cases llama,gemma3,...] [--pool-mib 64]`` (as root:
it mounts a tmpfs and makes a memory cgroup per case; run from the repository root
with the engine and operator folders on PYTHONPATH).

Each case serves a tiny model with ``spillway-engine serve --emulate-gpu`` (vLLM
0.33.0's real API server, engine core(s), scheduler and Spillway's offloader; only the
GPU is emulated) in its own mount namespace whose ``/dev/shm`` is a tmpfs of the
plan's ``pod.shm_bytes`` (the pod's emptyDir), with the host pool in vLLM's real
shared region (``SPILLWAY_SHARED_REGION=1``, as on CUDA), inside its own cgroup-v1
memory group (the container's). After start-up it sends prompts that fill the pool,
sampling every process twice a second, then prints planned vs measured peaks:

* region: the tmpfs in use (every engine's pool, plus vLLM's rings) against the
  plan's ``pod.pool_bytes_per_pod`` / ``pod.shm_bytes``;
* processes: RssAnon + RssFile of every process but the GPU workers (API server(s),
  engine core(s), under DP vLLM's process manager and DP coordinator, and the
  kernel-setup helpers), peak of their sum, against the measured terms of
  :mod:`spillway_engine.planner.pod_sizing` (processes are told apart by vLLM's
  ``VLLM::<name>`` process titles). With one worker and no DP, vLLM's ``uni`` executor
  runs the worker inside the engine core; under DP each worker is a process of its own
  (``mp``), whose CPU side is shown beside the plan's GPU-worker estimate (the CUDA
  context, NCCL and pinned staging are not measurable here and stay estimates);
* cgroup: ``memory.max_usage_in_bytes`` of the group (anon + shmem + page cache it
  faulted first; files already cached on this machine are not charged to it).

Last run (2026-11-30, 2 cores shared with other jobs, 64 MiB pool per engine, 12
prompts of 600 tokens; MiB):

| case | DP | shm plan/meas | API | cores | DP | helpers | procs | plan | workers/est. |
|---|---|---|---|---|---|---|---|---|---|
| llama (one group) | 1 | 320 / 64 | 943 | 1,044 | - | 1,208 | 3,194 | 3,457 +8% | core / 6,144 |
| gemma3 (SWA + full) | 1 | 320 / 64 | 943 | 1,044 | - | 1,272 | 3,259 | 3,458 +6% | core / 6,144 |
| qwen3next (GDN) | 1 | 320 / 64 | 942 | 1,048 | - | 1,172 | 3,162 | 3,476 +10% | core / 6,144 |
| qwen3next | 2 | 1,348 / 128 | 2,798 | 1,818 | 847 | 2,709 | 8,172 | 8,616 +5% | 2,092 / 12,288 |
| deepseek (MLA) | 1 | 320 / 64 | 942 | 1,046 | - | 1,197 | 3,185 | 3,456 +9% | core / 6,144 |

(procs: measured peak of every process but the GPU workers; plan: the measured terms;
workers/est.: the separate GPU workers' CPU side, or "core" when the worker runs in the
engine core, beside the plan's GPU-worker estimate.)

(region planned 64 per engine = measured in every case: the shm in use is the pool.
The helpers vary by about 150 MiB per engine from run to run, so the margins move by a
few percent; the earlier runs gave +6 to +11%.) The DP 2 engine started only once the
emulated worker answered vLLM's ``execute_dummy_batch`` (an idle rank's step), and the
MLA model once the emulated platform named vLLM's CPU MLA prefill class.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "engine"), str(ROOT / "operator")]

from e2e import engine_process  # noqa: E402
from e2e.engine_process import (  # noqa: E402
    Server,
    free_port,
    group_pids,
    kill_group,
    launch,
    plan_for,
    post,
    wait_ready,
    write_plan,
)
from spillway_engine.emulator.tiny import (  # noqa: E402
    deepseek_v2_config,
    gemma3_config,
    llama_config,
    qwen3_next_config,
    write_model,
)
from spillway_engine.planner import pod_sizing  # noqa: E402
from spillway_engine.planner.plan import Plan  # noqa: E402

MIB = 1 << 20
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


#: case -> (config, data-parallel size, what it stands for)
CASES: dict[str, tuple[dict[str, Any], int, str]] = {
    "llama": (llama_config(num_layers=2), 1, "single group"),
    "gemma3": (gemma3_config(num_layers=4, sliding_window=64), 1, "sliding window + full"),
    "qwen3next": (qwen3_next_config(), 1, "GDN hybrid"),
    "qwen3next-dp2": (qwen3_next_config(), 2, "GDN hybrid, DP 2"),
    "deepseek": (deepseek_v2_config(), 1, "MLA"),
}


@dataclass
class Peak:
    api: int = 0
    cores: int = 0
    dp: int = 0
    others: int = 0
    processes: int = 0  # every process but separate GPU workers: the measured terms' part
    workers: int = 0  # GPU worker processes (data parallelism's mp executor)
    shm: int = 0
    cgroup: int = 0


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for key in ("RssAnon", "RssFile", "RssShmem", "VmHWM"):
        m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
        if m:
            out[key] = int(m.group(1)) * 1024
    return out


#: vLLM's process titles (``VLLM::<name>``, set_process_title) -> the bench's role
_TITLES = (("APIServer", "api"), ("EngineCore", "cores"), ("Worker", "workers"),
           ("DPCoordinator", "dp"))  # fmt: skip


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "api"  # the API server, or under DP the process manager above them
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    for title, role in _TITLES:
        if f"VLLM::{title}" in cmd or title in comm:
            return role
    return "others"


def _shm_used(volume: Path) -> int:
    st = os.statvfs(volume)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _sample(server: Server, volume: Path, cgroup: Path, peak: Peak) -> None:
    roles: dict[str, int] = {"api": 0, "cores": 0, "dp": 0, "others": 0, "workers": 0}
    for pid in group_pids(server.proc.pid):
        s = _status(pid)
        role = _role(pid, server.proc.pid)
        if role in roles:
            roles[role] += s.get("RssAnon", 0) + s.get("RssFile", 0)
    peak.api = max(peak.api, roles["api"])
    peak.cores = max(peak.cores, roles["cores"])
    peak.dp = max(peak.dp, roles["dp"])
    peak.others = max(peak.others, roles["others"])
    peak.workers = max(peak.workers, roles["workers"])
    peak.processes = max(peak.processes, sum(roles.values()) - roles["workers"])
    peak.shm = max(peak.shm, _shm_used(volume))
    with contextlib.suppress(OSError):
        peak.cgroup = int((cgroup / "memory.max_usage_in_bytes").read_text())


def _fill(server: Server, n: int, seed: int) -> None:
    tokens = [(seed * 7919 + i * 104729) % 497 + 3 for i in range(n)]
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 2, "temperature": 0}
    post(server.url("/v1/completions"), body)


def run_case(name: str, pool_mib: int, work: Path, requests: int) -> tuple[Plan, Peak, str]:
    config, dp, _ = CASES[name]
    model = write_model(work / name / "model", config)
    plan = plan_for(model, cpu_memory_bytes=pool_mib * MIB, data_parallel_size=dp)
    volume = work / name / "shm"
    volume.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={plan.pod.shm_bytes}", "tmpfs", str(volume)],
        check=True,
    )
    cgroup = CGROUP_V1 / f"spillway-bench-{os.getpid()}-{name}"
    cgroup.mkdir()
    prefix = [
        "sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh",
        "unshare", "--mount", "--propagation", "private",
        "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', str(volume),
    ]  # fmt: skip
    root = work / name / "run"
    plan_path = write_plan(root, plan, model)
    port = free_port()
    env = {"SPILLWAY_SHM_DIR": "/dev/shm", "SPILLWAY_SHARED_REGION": "1"}
    kv_bytes = 80 * max(4096, plan.worker_bytes_per_block)  # 80 GPU blocks (MLA's are larger)
    proc = launch(plan_path, root / "engine.log", port, kv_bytes, env=env, prefix=prefix)
    server = Server(name, proc, port, root / "engine.log", plan, 0.0)
    peak = Peak()
    note = ""
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            _sample(server, volume, cgroup, peak)
            time.sleep(0.5)

    thread = threading.Thread(target=sampler, daemon=True)
    try:
        wait_ready(server)
        thread.start()
        for i in range(requests):
            _fill(server, 600, i)
        _sample(server, volume, cgroup, peak)
    except Exception as e:  # a case the emulator cannot serve: say why, go on
        note = str(e).strip().splitlines()[0][:100]
        errs = [x for x in server.log_text().splitlines() if "Error:" in x]
        if errs:
            note += " | " + errs[-1].strip()[:160]
    finally:
        stop.set()
        kill_group(proc)
        subprocess.run(["umount", "--lazy", str(volume)], check=False)
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    return plan, peak, note


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f}"


def measured_terms(plan: Plan) -> int:
    """The plan's process terms that these runs measure (all but the GPU workers)."""
    p = plan.parallelism
    return pod_sizing.measurable_process_bytes(
        plan.spillway.num_units, p.data_parallel_size, p.world_size
    )


def worker_estimate(plan: Plan) -> int:
    """The plan's GPU-worker term (CUDA context, NCCL, pinned staging: an estimate)."""
    p = plan.parallelism
    return p.data_parallel_size * p.world_size * pod_sizing.WORKER_PROCESS_BYTES


def table(rows: list[tuple[str, Plan, Peak, str]]) -> str:
    head = (
        "| case | DP | chunks/engine | region planned | shm planned | shm measured "
        "| API server(s) | engine core(s) | DP coordinator | helpers | processes measured "
        "| processes planned (measured terms) | over | GPU workers measured (CPU side) "
        "/ estimate | cgroup peak | planned >= measured |"
    )
    lines = [head, "|" + "---|" * 16]
    for name, plan, peak, note in rows:
        if note:
            lines.append(f"| {name} |" + " |" * 14 + f" not served: {note} |")
            continue
        planned_proc = measured_terms(plan)
        over = (planned_proc - peak.processes) / max(peak.processes, 1)
        ok = (
            plan.pod.shm_bytes >= peak.shm
            and planned_proc >= peak.processes
            and worker_estimate(plan) >= peak.workers
        )
        measured_workers = _mib(peak.workers) if peak.workers else "in the core"
        workers = f"{measured_workers} / {_mib(worker_estimate(plan))}"
        lines.append(
            f"| {name} | {plan.parallelism.data_parallel_size} | {plan.spillway.num_chunks} "
            f"| {_mib(plan.pod.pool_bytes_per_pod or 0)} | {_mib(plan.pod.shm_bytes)} "
            f"| {_mib(peak.shm)} | {_mib(peak.api)} | {_mib(peak.cores)} | {_mib(peak.dp)} "
            f"| {_mib(peak.others)} | {_mib(peak.processes)} | {_mib(planned_proc)} "
            f"| {over:+.0%} | {workers} | {_mib(peak.cgroup)} | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines) + "\n(MiB; peaks of samples every 0.5 s during start-up and load)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    p.add_argument("--pool-mib", type=int, default=64, help="host pool per engine")
    p.add_argument("--requests", type=int, default=12, help="600-token prompts per case")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--start-timeout", type=int, default=300, help="seconds to wait per engine")
    args = p.parse_args(argv)
    engine_process.START_TIMEOUT_S = args.start_timeout
    if os.geteuid() != 0:
        print("pod_memory: needs root (tmpfs mounts, memory cgroups)", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="pod-memory-") as tmp:
        for name in args.cases.split(","):
            if name not in CASES:
                print(f"pod_memory: unknown case {name!r}", file=sys.stderr)
                return 2
            t0 = time.monotonic()
            plan, peak, note = run_case(name, args.pool_mib, Path(tmp), args.requests)
            print(f"[{name}] {time.monotonic() - t0:.0f} s {note}", file=sys.stderr, flush=True)
            rows.append((name, plan, peak, note))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {"case": n, "note": note, "plan_pod": plan.pod.model_dump(), **vars(peak)}
                    for n, plan, peak, note in rows
                ],
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
