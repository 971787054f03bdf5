"""An emulated two-node replica with an uneven pipeline split (issue 45): stage 0 holds
1 of the tiny Llama's 4 layers, stage 1 the other 3, so a stage-1 block is three times
stage 0's and its host pool holds a third of the rows.

vLLM's scheduler, and so the offloading manager, sees stage 0's KV-cache config only:
alone it would hand out 32 chunks of a 2 MiB pool, and stage 1 holds 10. The plan gives
every stage's connector the pool every stage holds (10 units), so prompts stored past
those 10 chunks evict instead of writing past stage 1's region; a prompt evicted from
both GPU caches comes back from both host pools with no KV mismatch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.engine_process import (
    Server,
    complete,
    free_port,
    kill_group,
    launch,
    metrics,
    output_ids,
    plan_for,
    prompt,
    wait_ready,
    write_plan,
)
from spillway_engine.emulator.tiny import llama_config, write_model
from spillway_engine.planner.plan import Plan
from tests.contract.test_engine_multinode import Replica, _rank_args

MIB = 2**20
#: 80 blocks of stage 1's 6144 bytes (stage 0's 2048-byte blocks: 240; vLLM takes the
#: fewer): 1280 tokens a stage, above the 1024-token max model length.
KV_BYTES = 80 * 6144


def uneven_plan(model: Path) -> Plan:
    return plan_for(model, pipeline_parallel_size=2, pipeline_layer_partition=[1, 3],
                    cpu_memory_bytes=2 * MIB)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    root = tmp_path_factory.mktemp("uneven")
    model = write_model(root / "llama", llama_config(num_layers=4))
    plan = uneven_plan(model)
    master = free_port()
    servers: list[Server] = []
    try:
        for rank in (0, 1):
            node = root / f"node{rank}"
            plan_path = write_plan(node, plan, model)
            port = free_port()
            proc = launch(plan_path, node / "engine.log", port, KV_BYTES,
                          serve_args=_rank_args(rank, master))
            servers.append(Server(f"node{rank}", proc, port, node / "engine.log", plan, 0.0))
        t0 = time.monotonic()
        for server in servers:
            wait_ready(server)
            server.startup_s = time.monotonic() - t0
        yield Replica(*servers)
    finally:
        for server in reversed(servers):
            kill_group(server.proc)


def test_the_plan_hands_out_what_stage_1_holds(tmp_path):
    plan = uneven_plan(write_model(tmp_path / "llama", llama_config(num_layers=4)))
    assert [s.worker_bytes_per_block for s in plan.stages] == [2048, 6144]
    assert [s.upstream.num_chunks for s in plan.stages if s.upstream] == [32, 10]
    assert plan.pool_bounding_stage == 1
    assert plan.num_chunks == 10
    assert [s.spillway.num_units for s in plan.stages if s.spillway] == [10, 10]


def test_each_stage_checked_the_shared_pool(replica: Replica):
    leader, worker = replica.leader.log_text(), replica.worker.log_text()
    assert "plan check passed on worker rank 0 (pipeline stage 0)" in leader
    assert "plan check passed on worker rank 1 (pipeline stage 1)" in worker
    assert "LlamaForCausalLM built on the meta device, 1 cache layers" in leader
    assert "LlamaForCausalLM built on the meta device, 3 cache layers" in worker
    assert "FAILED" not in leader + worker


def test_prompts_past_stage_1s_rows_evict_and_come_back_without_a_mismatch(
    replica: Replica,
):
    server = replica.leader
    capacity = server.plan.num_chunks
    first = {seed: complete(server, prompt(seed, 600)) for seed in range(20, 26)}
    # 6 prompts x 2 full 256-token chunks: 12 stored, past stage 1's 10 rows
    before = metrics(server)
    assert before["spillway_host_pool_evictions_total"] > 0
    assert before["spillway_host_pool_used_chunks"] <= capacity
    assert before["spillway_host_pool_capacity_chunks"] == capacity
    # seed 22's blocks left both GPU caches (80 blocks hold two prompts) but not the pool
    again = complete(server, prompt(22, 600))
    after = metrics(server)
    assert after["spillway_host_hit_tokens_total"] - before["spillway_host_hit_tokens_total"] >= 512
    assert output_ids(again) == output_ids(first[22])
    assert after["spillway_emulator_kv_mismatch_total"] == 0
    logs = server.log_text() + replica.worker.log_text()
    assert "out of range" not in logs
    assert "Emulated KV mismatch" not in logs
    assert "Traceback" not in logs
