"""Disk tier: latency of a chunk load against a host copy, and hits in real engines.

Run from the repository root: ``python -m bench.disk_tier [--chunks N] [--dir PATH]``
for the latency table, ``python -m bench.disk_tier --engines`` for the hit table
(below).
(default: 48 chunks per file size, in a temporary directory under ``$TMPDIR``; about
15 s where fsynced writes run at 100-200 MB/s). Prints a markdown table; asserts nothing
but that every load returns the bytes stored.

File sizes are the per-group chunk files of two real plans (``plan.disk.file_bytes`` of
``make_plan(config, PlanRequest(cpu_memory_bytes=8 GiB, disk_bytes=200 GiB))`` for
``tests/fixtures/models/{llama-3.2-1b,gemma-3-12b-it}.json``); a chunk set (one span,
every offloaded group) is ``files`` such files. Per file size:

* host copy: ``np.copyto`` of a buffer of that size into another preallocated, already
  touched one (what a hit in the host pool costs, at most; the real pool copies into
  pinned memory for the GPU, which this machine does not have);
* disk cold / warm: :meth:`ChunkDir.read_into` (the very call a load job of
  :class:`SpillwayDiskTier` makes on its read thread: vLLM's fs tier reader, one file
  into a row of the primary view) of a chunk stored earlier, after
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file (cold: the clean pages leave the
  page cache, so the read goes to the device) and again without it (warm);
  the job's hand-off to and from the thread pool is not timed;
* store: :meth:`ChunkDir.put` with fsync of the file and its directory (a store job's
  work), per chunk and as throughput (MB = 10^6 bytes).

Times are per chunk file, median and p95 over the chunks; the ratios are medians over
the host copy's median.

``--engines``: one workload through vLLM 0.33.0's real server on the emulated GPU
(``spillway-engine serve --emulate-gpu``, tiny Llama, 80 GPU blocks of 16 tokens),
four ways, same trace and same budgets: one replica with the host pool only (1 MiB:
16 chunks of 256 tokens), one with host + a node-local disk tier (128 MiB), two
replicas with host pools only, two replicas with host + one shared disk folder
(256 MiB, a half each). The trace: 24 prefixes of 512 tokens (two chunks), 3 rounds,
each round every prefix once in a seeded random order plus a fresh 40-token suffix,
2 output tokens, requests one after another and alternating between the replicas
(round robin: the worst case for a replica's own cache). Columns, summed over
replicas: prefix tokens held per replica (host + disk capacity), tokens served from
the GPU prefix cache, from the host pool and disk (vLLM's external hits), of them
chunks loaded from disk (and from another replica's files), the hit rate (GPU +
external over prompt tokens), and KV mismatches (pages read that differ from
recomputation). Greedy outputs must be equal across the four (the bench exits
non-zero otherwise). About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spillway_engine.planner.plan import PlanRequest, make_plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "fixtures" / "models"
CASES = ("llama-3.2-1b", "gemma-3-12b-it")
CPU_BYTES = 8 << 30
DISK_BYTES = 200 << 30


@dataclass
class Row:
    model: str
    file_bytes: int
    files: int
    host: list[float]
    cold: list[float]
    warm: list[float]
    store: list[float]


def plan_files(name: str) -> list[int]:
    config = json.loads((MODELS / f"{name}.json").read_text())["config"]
    plan = make_plan(
        config, PlanRequest(model_name=name, cpu_memory_bytes=CPU_BYTES, disk_bytes=DISK_BYTES)
    )
    assert plan.disk is not None, f"{name}: no disk tier in the plan"
    return list(plan.disk.file_bytes)


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def time_host(size: int, n: int) -> list[float]:
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.ones(size, dtype=np.uint8)  # touched: no page faults in the timed copy
    np.copyto(dst, src)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


def time_disk(root: str, size: int, n: int) -> tuple[list[float], list[float], list[float]]:
    from vllm.v1.kv_offload.base import make_offload_key

    from spillway_engine.offloader.disk_tier import SpillwayDiskTier

    # Row 0: what a store copies out of; row 1: where a load lands.
    primary = np.zeros((2, size), dtype=np.uint8)
    primary[0] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    primary[1] = 1
    tier = SpillwayDiskTier(
        None,
        memoryview(primary),
        "SpillwayDiskTier",
        root_dir=root,
        budget_bytes=(n + 1) * (size + (1 << 20)),
        plan_key=f"bench-{size}",
        n_read_threads=1,
        n_write_threads=1,
        fsync=True,
        shared=False,
    )
    chunks = tier.chunks
    view = memoryview(primary)
    flat = view.cast("B")
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(n)]
    store, cold, warm = [], [], []
    try:
        for i, key in enumerate(keys):
            primary[0, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
            t0 = time.perf_counter()
            ok = chunks.put(key, [flat[0:size]])
            store.append(time.perf_counter() - t0)
            assert ok, "the tier refused a store"
        for label, out in (("cold", cold), ("warm", warm)):
            for i, key in enumerate(keys):
                if label == "cold":
                    drop_cache(chunks.path_of(key))
                primary[1, :8] = 0
                t0 = time.perf_counter()
                chunks.read_into(key, view, [size], size)
                out.append(time.perf_counter() - t0)
                assert int.from_bytes(primary[1, :8].tobytes(), "little") == i
                assert primary[1, 8:4096].tobytes() == primary[0, 8:4096].tobytes()
        assert primary[1, 8:].tobytes() == primary[0, 8:].tobytes()
    finally:
        tier.shutdown()
    return store, cold, warm


def fs_type(path: str) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if path.startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def ms(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs) * 1e3, float(np.percentile(xs, 95)) * 1e3


def print_table(rows: list[Row]) -> None:
    print(
        "| model | file | files/set | host copy ms (p50/p95) | disk cold ms (p50/p95) "
        "| cold/host | disk warm ms (p50/p95) | warm/host | store+fsync ms (p50/p95) "
        "| store MB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        host, cold, warm, store = ms(r.host), ms(r.cold), ms(r.warm), ms(r.store)
        mbps = r.file_bytes * len(r.store) / sum(r.store) / 1e6
        print(
            f"| {r.model} | {r.file_bytes / 2**20:g} MiB | {r.files} "
            f"| {host[0]:.2f} / {host[1]:.2f} "
            f"| {cold[0]:.2f} / {cold[1]:.2f} | {cold[0] / host[0]:.1f}x "
            f"| {warm[0]:.2f} / {warm[1]:.2f} | {warm[0] / host[0]:.1f}x "
            f"| {store[0]:.1f} / {store[1]:.1f} | {mbps:.0f} |"
        )


# ------------------------------------------------------------------ --engines

ENGINE_PREFIXES, ENGINE_ROUNDS, PREFIX_TOKENS, SUFFIX_TOKENS = 24, 3, 512, 40
ENGINE_HOST_BYTES, ENGINE_DISK_BYTES, GPU_KV_BYTES = 1 << 20, 128 << 20, 80 * 4096
SETUPS = (  # name, replicas, disk: None, "local" or "shared"
    ("host only, 1 replica", 1, None),
    ("host + local disk, 1 replica", 1, "local"),
    ("host only, 2 replicas", 2, None),
    ("host + shared disk, 2 replicas", 2, "shared"),
)


def engine_trace(seed: int = 7) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(PREFIX_TOKENS)]
                for _ in range(ENGINE_PREFIXES)]
    trace: list[list[int]] = []
    last = None
    for _ in range(ENGINE_ROUNDS):
        order = list(range(ENGINE_PREFIXES))
        rng.shuffle(order)
        if order[0] == last:
            order.append(order.pop(0))
        last = order[-1]
        trace += [prefixes[i] + [rng.randrange(3, 500) for _ in range(SUFFIX_TOKENS)]
                  for i in order]
    return trace


def run_setup(base: Path, model: Path, replicas: int, disk: str | None,
              trace: list[list[int]]) -> tuple[dict[str, float], list[list[int]], int]:
    from e2e.engine_process import (
        DISK_TIER_TUNING,
        Server,
        complete,
        free_port,
        kill_group,
        launch,
        metrics,
        output_ids,
        plan_for,
        wait_ready,
        write_plan,
    )
    from spillway_engine.launcher.serve import DISK_TIER_OPTIONS_ENV

    extra = {} if disk is None else {
        "disk_bytes": ENGINE_DISK_BYTES * (2 if disk == "shared" else 1),
        "disk_writers": 2 if disk == "shared" else 1}
    plan = plan_for(model, cpu_memory_bytes=ENGINE_HOST_BYTES, **extra)
    servers = []
    try:
        for r in range(replicas):
            root = base / f"replica-{r}"
            folder = base / ("shared" if disk == "shared" else f"disk-{r}")
            folder.mkdir(parents=True, exist_ok=True)
            port = free_port()
            proc = launch(write_plan(root, plan, model), root / "engine.log", port, GPU_KV_BYTES,
                          env={"SPILLWAY_SHARED_REGION": "1",
                               # the engine tests' water marks: a slow VM disk
                               # sheds no store, so the four runs see one trace
                               DISK_TIER_OPTIONS_ENV: DISK_TIER_TUNING},
                          serve_args=["--disk-dir", str(folder)])
            servers.append(Server(f"r{r}", proc, port, root / "engine.log", plan, 0.0))
        for server in servers:
            wait_ready(server)
        outputs = [output_ids(complete(servers[i % replicas], tokens, max_tokens=2))
                   for i, tokens in enumerate(trace)]
        time.sleep(1)  # the last stores land
        total: dict[str, float] = {}
        for server in servers:
            for key, value in metrics(server).items():
                total[key] = total.get(key, 0.0) + value
        held = plan.capacity_tokens + (plan.disk.capacity_tokens if plan.disk else 0)
        return total, outputs, held
    finally:
        for server in servers:
            kill_group(server.proc)


def engines_main() -> int:
    from spillway_engine.emulator.tiny import llama_config, write_model

    started = time.perf_counter()
    trace = engine_trace()
    prompt_tokens = sum(len(t) for t in trace)
    base = Path(tempfile.mkdtemp(prefix="spillway-disk-engines-"))
    rows, reference, ok = [], None, True
    try:
        model = write_model(base / "model", llama_config(num_layers=2))
        for i, (name, replicas, disk) in enumerate(SETUPS):
            m, outputs, held = run_setup(base / f"setup-{i}", model, replicas, disk, trace)
            reference = reference or outputs
            same = outputs == reference
            ok &= same and m.get("spillway_emulator_kv_mismatch_total", 0) == 0
            gpu = m.get("vllm:prefix_cache_hits_total", 0)
            ext = m.get("vllm:external_prefix_cache_hits_total", 0)
            rows.append(
                f"| {name} | {held:,} | {gpu:,.0f} | {ext:,.0f} "
                f"| {m.get('spillway_disk_tier_loads_total', 0):.0f} "
                f"({m.get('spillway_disk_tier_shared_hits_total', 0):.0f} shared) "
                f"| {(gpu + ext) / prompt_tokens:.1%} "
                f"| {m.get('spillway_emulator_kv_mismatch_total', 0):.0f} "
                f"| {'same' if same else 'DIFFERENT'} |")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"disk tier in the engine: {len(trace)} requests, {prompt_tokens:,} prompt tokens, "
          f"{ENGINE_PREFIXES} prefixes x {ENGINE_ROUNDS} rounds, {os.cpu_count()} CPUs")
    print()
    print("| setup | tokens held per replica | GPU hit tokens | host + disk hit tokens "
          "| chunks loaded from disk | hit rate | KV mismatches | greedy outputs |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    print()
    print(f"wall {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=48, help="chunks per file size")
    parser.add_argument("--dir", default=None, help="where to write (default: $TMPDIR)")
    parser.add_argument("--engines", action="store_true",
                        help="the hit table on real engines instead of the latency table")
    args = parser.parse_args()
    if args.engines:
        sys.exit(engines_main())
    base = tempfile.mkdtemp(prefix="spillway-disk-bench-", dir=args.dir)
    started = time.perf_counter()
    rows: list[Row] = []
    measured: dict[int, tuple[list[float], list[float], list[float], list[float]]] = {}
    try:
        for name in CASES:
            files = plan_files(name)
            for size in sorted(set(files)):
                if size not in measured:  # one measurement per size
                    host = time_host(size, args.chunks)
                    measured[size] = (host, *time_disk(base, size, args.chunks))
                    shutil.rmtree(base, ignore_errors=True)
                    os.makedirs(base, exist_ok=True)
                host, store, cold, warm = measured[size]
                rows.append(Row(name, size, files.count(size), host, cold, warm, store))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    try:
        from vllm.v1.kv_offload.tiering.fs import io as fs_io

        reader = "vLLM fs_io_C" if fs_io._HAS_FSIO_C else "vLLM Python reader"
    except ImportError:
        reader = "?"
    print(
        f"disk tier bench: {args.chunks} chunks per size, dir {base} "
        f"({fs_type(os.path.realpath(base))}), {os.cpu_count()} CPUs, "
        f"{platform.machine()}, reader {reader}, python {sys.version.split()[0]}"
    )
    print()
    print_table(rows)
    print()
    print(f"wall {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
