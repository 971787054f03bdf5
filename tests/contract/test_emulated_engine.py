"""The whole engine a Spillway pod runs, on an emulated GPU (spillway_engine.emulator).

``spillway-engine serve`` -> vLLM 0.33.0's real OpenAI server -> engine core ->
scheduler, KV-cache manager, prefix cache, Spillway's plugin (plan check, metrics) and
``SpillwayOffloadingConnector`` (both sides, real bytes). Only the GPU is emulated: the
worker builds the model on the meta device, keeps KV caches in CPU tensors and answers
each step with tokens derived from the KV bytes it reads. One server per model,
shared by the assertions (start-up is about a minute of imports here).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from e2e.engine_process import (
    EXIT_TIMEOUT_S,
    POOL_BYTES,
    Server,
    complete,
    launch,
    metrics,
    output_ids,
    prompt,
)

# The launch helpers under the names the other emulated-engine tests import from here.
from e2e.engine_process import free_port as _free_port
from e2e.engine_process import kill_group as _kill_group
from e2e.engine_process import plan_for as _plan
from e2e.engine_process import rss_mib as _rss_mib
from e2e.engine_process import wait_ready as _wait_ready
from e2e.engine_process import write_plan as _write_plan
from spillway_engine.emulator.tiny import (
    deepseek_v2_config,
    gemma3_config,
    llama_config,
    write_model,
)

#: model -> (config.json, emulated GPU KV bytes). The budgets hold max_model_len and
#: little more (80 blocks of 4096 or 36,864 bytes; 160 of 2048), so a few prompts
#: evict others.
MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "llama": (llama_config(num_layers=2), 80 * 4096),
    # sliding-window (64 tokens) + full attention, two KV-cache groups
    "gemma3": (gemma3_config(num_layers=4, sliding_window=64), 160 * 2048),
    # MLA: one latent cache per layer (576 bf16 values a token), vLLM's MLA decode
    # backend's block rule and its own CPU prefill class
    "deepseek": (deepseek_v2_config(num_layers=2), 80 * 36864),
}


def _launch(plan_path: Path, log: Path, port: int, kv_bytes: int) -> subprocess.Popen[bytes]:
    """``engine_process.launch`` with the host pool in vLLM's /dev/shm region, as on a
    GPU pod (the corruption test reaches it through the engine core's mapping)."""
    return launch(plan_path, log, port, kv_bytes, env={"SPILLWAY_SHARED_REGION": "1"})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("emulated")
    return {name: write_model(root / name, config) for name, (config, _) in MODELS.items()}


@pytest.fixture(scope="module", params=list(MODELS))
def server(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[Server]:
    name = request.param
    model_dir = models[name]
    plan = _plan(model_dir)
    root = model_dir.parent / f"{name}-good"
    plan_path = _write_plan(root, plan, model_dir)
    port = _free_port()
    t0 = time.monotonic()
    proc = _launch(plan_path, root / "engine.log", port, MODELS[name][1])
    srv = Server(name, proc, port, root / "engine.log", plan, 0.0)
    try:
        _wait_ready(srv)
        srv.startup_s = time.monotonic() - t0
        print(
            f"\n[emulated {name}] ready in {srv.startup_s:.1f} s; RSS MiB {_rss_mib(proc.pid)}",
            file=sys.stderr,
        )
        yield srv
    finally:
        _kill_group(proc)


# ------------------------------------------------------------------ the helpers


# -------------------------------------------------------------------- the tests


def test_plan_check_ran_and_passed(server: Server):
    log = server.log_text()
    groups = len(server.plan.kv_groups)
    assert f"Spillway plan check passed: {groups} KV-cache group(s), 16 tokens per hash" in log
    assert "FAILED" not in log
    assert f"Emulated GPU h100: {server.plan.model.architecture} built on the meta device" in log
    if server.name == "llama":
        # the emulated budget (SPILLWAY_EMULATE_KV_BYTES) is what vLLM sized the cache by
        assert re.search(r"KV cache size: 1,?280 tokens", log)


def test_completion_returns_tokens_from_the_kv_bytes(server: Server):
    tokens = prompt(1, 40)
    first = complete(server, tokens)
    assert first["usage"]["completion_tokens"] == 8
    assert first["usage"]["prompt_tokens"] == 40
    # deterministic: the same prefix writes the same signatures (now a prefix hit)
    assert output_ids(complete(server, tokens)) == output_ids(first)
    # and another prompt reads other signatures
    assert output_ids(complete(server, prompt(2, 40))) != output_ids(first)


def test_repeated_long_prompt_hits_the_prefix_cache(server: Server):
    tokens = prompt(3, 300)
    before = metrics(server)
    complete(server, tokens, max_tokens=2)
    complete(server, tokens, max_tokens=2)
    after = metrics(server)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits >= 288  # 18 full 16-token blocks of the repeat (the last token recomputes)


def test_prompt_evicted_from_the_gpu_comes_back_from_the_host_pool(server: Server):
    """A prompt pushed out of the 80-block GPU cache is loaded from Spillway's host
    pool, and the tokens derived from the loaded bytes equal the recomputed ones."""
    a = prompt(10, 600)
    first = complete(server, a)
    for seed in range(11, 16):  # 5 x 600 tokens push a's blocks out of the GPU cache
        complete(server, prompt(seed, 600), max_tokens=2)
    before = metrics(server)
    again = complete(server, a)
    after = metrics(server)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vllm:external_prefix_cache_hits_total") >= 512  # two 256-token chunks
    assert delta("spillway_host_hit_tokens_total") >= 512
    full = sum(
        g.bytes_per_block // g.tokens_per_block
        for g in server.plan.kv_groups
        if g.kind in ("full_attention", "mla")
    )
    assert delta("vllm:kv_offload_load_bytes_total") >= 512 * full  # real bytes moved
    assert output_ids(again) == output_ids(first)
    # every page read so far held what recomputation writes
    assert after["spillway_emulator_kv_mismatch_total"] == 0


def test_spillway_series_are_exported(server: Server):
    m = metrics(server)
    for name in (
        "spillway_plan_info",
        "spillway_host_pool_capacity_chunks",
        "spillway_host_pool_capacity_tokens",
        "spillway_host_pool_used_chunks",
        "spillway_host_pool_tokens",
        "spillway_host_lookup_tokens_total",
        "spillway_host_hit_tokens_total",
    ):
        assert name in m, name
    assert m["spillway_host_pool_capacity_chunks"] == server.plan.spillway.num_chunks
    assert m["spillway_host_pool_used_chunks"] > 0  # the earlier prompts were stored
    assert m["vllm:kv_offload_store_bytes_total"] > 0


def test_wrong_plan_stops_the_engine(models: dict[str, Path]):
    """A plan sized for another pool than the engine runs: the plan check refuses,
    the whole server exits non-zero (no API server left behind), and the side-by-side
    table is the container's termination message (what the operator shows)."""
    model_dir = models["llama"]
    good = _plan(model_dir)
    stale = json.loads(_plan(model_dir, cpu_memory_bytes=2 * POOL_BYTES).model_dump_json())
    stale["kv_transfer_config"] = good.kv_transfer_config  # the engine runs the 16 MiB pool
    root = model_dir.parent / "stale"
    plan_path = _write_plan(root, stale, model_dir)
    proc = _launch(plan_path, root / "engine.log", _free_port(), MODELS["llama"][1])
    try:
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the engine kept running after a failed plan check:\n{root / 'engine.log'}")
    finally:
        _kill_group(proc)
    log = (root / "engine.log").read_text(errors="replace")
    assert rc != 0
    assert "Spillway plan check FAILED" in log
    assert re.search(rf"cpu_bytes_to_use\s+\|\s+{2 * POOL_BYTES}\s+\|\s+{POOL_BYTES}", log)
    assert re.search(r"spillway\.num_units\s+\|\s+\d+\s+\|\s+\d+", log)
    message = (root / "termination-log").read_text()  # launch's private termination log
    assert message.startswith("Spillway plan check FAILED")
    assert re.search(rf"cpu_bytes_to_use\s+\|\s+{2 * POOL_BYTES}\s+\|\s+{POOL_BYTES}", message)


def _bare_worker(layers: int = 2, window: int | None = None) -> Any:
    """The emulated worker's step logic without a vLLM process: ``layers`` layers of
    one KV-cache group, 16 tokens per block, 64-byte slots, 8 blocks."""
    from spillway_engine.emulator.worker import EmulatedGpuWorker, _Pages

    worker = object.__new__(EmulatedGpuWorker)
    worker._pages = [
        _Pages(0, 7 + i, 16, 64, np.zeros((8, 16 * 64), np.uint8), window) for i in range(layers)
    ]
    worker._vocab, worker._avoid, worker._requests, worker._mismatches = 512, {2}, {}, 0
    return worker


def _step(worker: Any, tokens: list[int], blocks: list[int], computed: int) -> list[int]:
    from spillway_engine.emulator.worker import _Request

    rid = f"r{len(worker._requests)}"
    worker._requests[rid] = _Request(list(tokens), [blocks], computed)
    return worker._run(rid, len(tokens) - computed)


def test_a_page_that_differs_from_recomputation_changes_the_token():
    """The emulated forward pass reads every signature of the context from every
    layer's page: the same prefix gives the same token whether computed or reused,
    and one flipped byte anywhere in a reused page gives another and is counted."""
    worker = _bare_worker()
    tokens = prompt(5, 40)
    computed = _step(worker, tokens, [1, 2, 3], 0)
    assert computed == _step(worker, tokens, [4, 5, 6], 0)  # recomputed elsewhere
    assert computed == _step(worker, tokens, [1, 2, 7], 32)  # positions 0-31 reused
    assert worker._mismatches == 0
    worker._pages[1].pages[2, 15 * 64] ^= 1  # position 31 (the last reused), layer 1
    assert computed != _step(worker, tokens, [1, 2, 7], 32)
    assert worker._mismatches == 1
    worker._pages[1].pages[2, 15 * 64] ^= 1
    worker._pages[0].pages[1, 3 * 64 + 5] ^= 0x40  # position 3, deep in the prefix
    assert computed != _step(worker, tokens, [1, 2, 7], 32)
    assert worker._mismatches == 2


def test_a_sliding_window_reads_only_its_window():
    """Blocks before a sliding window are freed by vLLM and may hold anything: they
    neither change the token nor count as mismatches."""
    worker = _bare_worker(window=16)
    tokens = prompt(6, 40)
    computed = _step(worker, tokens, [1, 2, 3], 0)
    worker._pages[0].pages[1, :] = 0xFF  # positions 0-15, outside the window of 40
    assert computed == _step(worker, tokens, [1, 2, 7], 32)
    assert worker._mismatches == 0
    worker._pages[0].pages[2, 15 * 64] ^= 1  # position 31: inside the window
    assert computed != _step(worker, tokens, [1, 2, 7], 32)
    assert worker._mismatches == 1


def test_a_step_lasts_the_modelled_gpu_time(monkeypatch):
    """At a speed factor above 0 a step sleeps out the latency model's time for the
    scheduled tokens and the KV they read (null blocks outside a window not counted),
    less the time its own work took; at 0 it never sleeps."""
    from types import SimpleNamespace

    from spillway_engine.emulator import latency
    from spillway_engine.emulator import worker as worker_mod
    from spillway_engine.emulator.worker import EmulatedGpuWorker, _Request

    worker = object.__new__(EmulatedGpuWorker)
    worker._gpu, worker._cost = latency.gpu_profile("h200"), latency.ModelCost.of(8e9)
    worker._group_kv = {0: (16, 1000), 1: (16, 10)}  # group 1: a window (null blocks)
    worker._requests = {
        "a": _Request([0] * 40, [[1, 2, 3], [0, 2, 3]], computed=39),  # decode, 40 tokens
        "b": _Request([0] * 20, [[4, 5], [4, 5]], computed=0),  # 20-token prefill
    }
    assert worker._kv_bytes_read("a", 1) == 40 * 1000 + 24 * 10
    assert worker._kv_bytes_read("b", 20) == 20 * 1000 + 20 * 10
    slept: list[float] = []
    monkeypatch.setattr(worker_mod.time, "sleep", slept.append)
    # A still clock: the step's own work takes no time, so a busy machine cannot eat
    # into the pause (sleep_for subtracts the work done since t0).
    monkeypatch.setattr(worker_mod.time, "perf_counter", lambda: 100.0)
    out = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 20}, total_num_scheduled_tokens=21)
    worker._speed = 2.0
    worker._sleep_out_step(out, 100.0)
    kv = 40 * 1000 + 24 * 10 + 20 * 1000 + 20 * 10
    [pause] = slept
    assert pause == pytest.approx(2 * latency.step_s(21, worker._gpu, worker._cost, kv), rel=0.05)
    assert 0.005 < pause < 0.01  # two passes over 16 GB of weights at 3.84 TB/s
    monkeypatch.setattr(worker_mod.time, "perf_counter", lambda: 100.002)  # 2 ms of work
    worker._sleep_out_step(out, 100.0)
    assert slept[1] == pytest.approx(pause - 0.002)
    worker._speed = 0.0
    worker._sleep_out_step(out, 100.0)
    assert len(slept) == 2


def test_an_idle_data_parallel_rank_steps_without_touching_the_cache(monkeypatch):
    """vLLM runs a dummy step on an idle data-parallel rank while another is busy (the
    DP 2 engine died on it before): it lasts a one-token step, at least 1 ms, and
    reads or writes no request or page."""
    from spillway_engine.emulator import latency
    from spillway_engine.emulator import worker as worker_mod

    worker = _bare_worker()
    worker._gpu, worker._cost = latency.gpu_profile("h200"), latency.ModelCost.of(8e9)
    before = [p.pages.copy() for p in worker._pages]
    slept: list[float] = []
    monkeypatch.setattr(worker_mod.time, "sleep", slept.append)
    for speed in (0.0, 1.0):
        worker._speed = speed
        worker.execute_dummy_batch()
    assert slept[0] == pytest.approx(0.001)
    assert slept[1] == pytest.approx(latency.step_s(1, worker._gpu, worker._cost))
    assert worker._requests == {} and worker._mismatches == 0
    assert all((p.pages == b).all() for p, b in zip(worker._pages, before, strict=True))


def _region_mapping(server: Server) -> Path:
    """The engine core's mapping of the host pool's shm region (its file is unlinked
    once every worker has mapped it; /proc/PID/map_files still reaches it)."""
    pids = [server.proc.pid]
    for pid in pids:
        with contextlib.suppress(OSError):
            pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and "vllm_offload_" in fields[5] and "w" in fields[1]:
                    return Path(f"/proc/{pid}/map_files/{fields[0]}")
    pytest.fail(f"no process of the engine maps the host pool region: {pids}")


def test_a_corrupted_host_page_is_caught(server: Server):
    """Flip the bytes of the whole host pool (as a bad DIMM would), then ask again for a
    prompt that lives only there: the loaded pages differ from recomputation, the
    output changes and the mismatch is counted. Last: it leaves the pool corrupted."""
    a = prompt(20, 600)
    first = complete(server, a)
    for seed in range(21, 26):  # push a's blocks out of the GPU cache (it stays in the pool)
        complete(server, prompt(seed, 600), max_tokens=2)
    mapping = _region_mapping(server)
    with open(mapping, "r+b") as f:
        data = bytearray(f.read())
        f.seek(0)
        f.write(bytes(b ^ 0x5A for b in data))
    before = metrics(server)
    again = complete(server, a)
    after = metrics(server)
    loaded = after["spillway_host_hit_tokens_total"] - before["spillway_host_hit_tokens_total"]
    assert loaded >= 512
    mismatches = "spillway_emulator_kv_mismatch_total"
    assert after[mismatches] > before[mismatches]
    assert output_ids(again) != output_ids(first)
    assert "Emulated KV mismatch" in server.log_text()
