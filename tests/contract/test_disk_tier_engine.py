"""The disk tier under Spillway's host pool, in the whole engine on an emulated GPU.

``spillway-engine serve`` with a plan that has ``disk``: the launcher adds the
``SpillwayDiskTier`` to the connector's config, Spillway's connector runs vLLM 0.33's
``TieringOffloadingManager`` with the unit pool as its primary tier, and chunks the
small host pool evicts come back from disk. The emulated worker checks every page it
reads against what recomputation writes (``spillway_emulator_kv_mismatch_total``), so
0 mismatches and equal greedy outputs mean the bytes made the round trip exactly, for
one group (Llama), sliding window + full (Gemma 3), Gated DeltaNet + full (Qwen3-Next)
and MLA (DeepSeek).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.engine_process import (
    DISK_TIER_TUNING,
    MIB,
    Server,
    free_port,
    kill_group,
    launch,
    plan_for,
    wait_ready,
    write_plan,
)
from spillway_engine.emulator.tiny import write_model
from spillway_engine.launcher.serve import DISK_TIER_OPTIONS_ENV
from spillway_engine.offloader.disk_tier import CHUNK_SUFFIX
from tests.contract.test_emulated_engine import complete, metrics, output_ids, prompt
from tests.contract.test_simulator_vs_engine import POOL_BYTES, SIM_MODELS

MODELS = ["llama", "gemma3", "qwen3_next", "deepseek"]
#: the disk holds every prompt of the test many times over
DISK_BYTES = 128 * MIB


def start(root: Path, name: str, disk_dir: Path, disk_bytes: int = DISK_BYTES,
          model_dir: Path | None = None) -> Server:
    config, kv_bytes = SIM_MODELS[name]
    model_dir = model_dir or write_model(root / "model", config)
    plan = plan_for(model_dir, cpu_memory_bytes=POOL_BYTES[name], disk_bytes=disk_bytes)
    plan_path = write_plan(root, plan, model_dir)
    port = free_port()
    disk_dir.mkdir(parents=True, exist_ok=True)
    proc = launch(plan_path, root / "engine.log", port, kv_bytes,
                  env={"SPILLWAY_SHARED_REGION": "1", DISK_TIER_OPTIONS_ENV: DISK_TIER_TUNING},
                  serve_args=["--disk-dir", str(disk_dir)])
    server = Server(name, proc, port, root / "engine.log", plan, 0.0)
    try:
        wait_ready(server)
    except BaseException:
        kill_group(proc)
        raise
    return server


@pytest.fixture(scope="module", params=MODELS)
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp(f"disk-{request.param}")
    srv = start(root, request.param, root / "disk")
    try:
        yield srv
    finally:
        kill_group(srv.proc)


def settle(server: Server) -> dict[str, float]:
    """Metrics once the disk tier's writes in flight have landed."""
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server)
        if m.get("vllm:kv_offload_tiering_active_cascade_jobs", 0) == 0 or \
                time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_a_prompt_the_host_pool_evicted_comes_back_from_disk_byte_exact(server: Server):
    log = server.log_text()
    assert "disk tier:" in log and "SpillwayDiskTier" in log
    a = prompt(100, 600)
    first = complete(server, a)
    # 12 more 600-token prompts: more than the GPU cache and the host pool hold
    for seed in range(101, 113):
        complete(server, prompt(seed, 600), max_tokens=2)
    before = settle(server)
    assert before["spillway_host_pool_evictions_total"] > 0, "the host pool should evict"
    again = complete(server, a)
    after = settle(server)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("spillway_disk_tier_loads_total") > 0, "chunks should load from disk"
    assert delta("vllm:kv_offload_tiering_read_bytes_total") > 0
    assert delta("vllm:external_prefix_cache_hits_total") >= server.plan.spillway.chunk_tokens
    assert output_ids(again) == output_ids(first)
    assert after["spillway_emulator_kv_mismatch_total"] == 0
    assert after["spillway_disk_tier_write_failures_total"] == 0
    assert 0 < after["spillway_disk_tier_used_bytes"] <= after["spillway_disk_tier_budget_bytes"]
    assert after["spillway_disk_tier_budget_bytes"] == server.plan.disk.budget_bytes_per_engine


def test_the_disk_budget_holds_in_the_engine(tmp_path: Path):
    """A disk tier of five chunk sets' budget under a trace that stores many more: the tier
    evicts and its files never take more than the budget."""
    name = "llama"
    probe = plan_for(write_model(tmp_path / "probe", SIM_MODELS[name][0]),
                     cpu_memory_bytes=POOL_BYTES[name], disk_bytes=DISK_BYTES)
    chunk_set = probe.disk.chunk_set_bytes
    disk = tmp_path / "disk"
    server = start(tmp_path / "engine", name, disk, disk_bytes=6 * chunk_set)
    try:
        budget = server.plan.disk.budget_bytes_per_engine
        assert budget == 5 * chunk_set  # a sixth kept free for writes in flight
        peak = 0
        for seed in range(200, 224):  # 24 prompts x 2 chunks: about 10x the budget
            complete(server, prompt(seed, 600), max_tokens=2)
            peak = max(peak, on_disk(disk))
        m = settle(server)
        assert m["spillway_disk_tier_evictions_total"] > 0
        assert m["spillway_disk_tier_stores_total"] * chunk_set >= 5 * budget
        assert peak <= budget and on_disk(disk) <= budget
        assert m["spillway_emulator_kv_mismatch_total"] == 0
    finally:
        kill_group(server.proc)


def on_disk(root: Path) -> int:
    """Bytes the filesystem holds for the tier's complete chunk files (one the tier
    evicts while they are listed counts as gone)."""
    total = 0
    for path in root.rglob(f"*{CHUNK_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_blocks * 512
    return total


def test_two_replicas_on_one_shared_folder_serve_each_others_prefixes(tmp_path: Path):
    """Two engines of one plan on a shared folder (a ReadWriteMany claim's mount, each
    keeping half of it): a prefix the first computed after both started is loaded
    from disk by the second, with no prefill of it there."""
    name = "llama"
    shared = tmp_path / "shared"
    model = write_model(tmp_path / "model", SIM_MODELS[name][0])
    a = start(tmp_path / "a", name, shared, model_dir=model)
    try:
        b = start(tmp_path / "b", name, shared, model_dir=model)
        try:
            assert a.plan.disk.cache_key == b.plan.disk.cache_key
            p = prompt(300, 600)
            first = complete(a, p)
            deadline = time.monotonic() + 30
            while settle(a)["spillway_disk_tier_chunks"] < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            before = metrics(b)
            again = complete(b, p)
            after = settle(b)

            def delta(key: str) -> float:
                return after.get(key, 0.0) - before.get(key, 0.0)

            assert delta("spillway_disk_tier_shared_hits_total") >= 2
            assert delta("vllm:external_prefix_cache_hits_total") >= 512
            assert delta("vllm:prefix_cache_hits_total") == 0  # nothing on B's GPU
            assert output_ids(again) == output_ids(first)
            assert after["spillway_emulator_kv_mismatch_total"] == 0
            # B counts none of A's files against its own budget
            assert after["spillway_disk_tier_used_bytes"] == 0
        finally:
            kill_group(b.proc)
    finally:
        kill_group(a.proc)
