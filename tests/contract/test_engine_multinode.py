"""An emulated two-node replica: one vLLM 0.33.0 instance over two ``spillway-engine
serve --nnodes 2`` processes, as a LeaderWorkerSet group of two pods runs it.

Node rank 0 (the leader: API server, engine core, the stage-0 worker) and node rank 1
(``--headless``: the stage-1 worker, its probes answered by the launcher) meet through
torch.distributed on gloo at 127.0.0.1 and vLLM's cross-node message queues. Each has
one emulated GPU holding its pipeline stage's layers (pipeline parallel 2, vLLM's even
split), Spillway's offloader on each stage, and the plan check on every rank against
that rank's stage. A prompt pushed out of both stages' GPU caches comes back from the
host pools with the tokens of recomputation and no KV mismatch on either stage.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from e2e.engine_process import (
    ENGINE,
    Server,
    free_port,
    get,
    kill_group,
    launch,
    plan_for,
    rss_mib,
    wait_ready,
    write_plan,
)
from spillway_engine.emulator.tiny import llama_config, write_model
from tests.contract.test_emulated_engine import complete, metrics, output_ids, prompt

#: Each stage holds 2 of the 4 layers: 4096 bytes a block, 80 blocks per emulated GPU.
KV_BYTES = 80 * 4096


@dataclass
class Replica:
    leader: Server
    worker: Server


def _rank_args(rank: int, master_port: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
            "--master-port", str(master_port)]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    root = tmp_path_factory.mktemp("multinode")
    model = write_model(root / "llama", llama_config(num_layers=4))
    plan = plan_for(model, pipeline_parallel_size=2)
    assert len(plan.stages) == 2
    master = free_port()
    servers: list[Server] = []
    t0 = time.monotonic()
    try:
        for rank in (0, 1):
            node = root / f"node{rank}"  # a pod of its own: shm folder, termination log
            plan_path = write_plan(node, plan, model)
            port = free_port()
            proc = launch(plan_path, node / "engine.log", port, KV_BYTES,
                          serve_args=_rank_args(rank, master))
            servers.append(Server(f"node{rank}", proc, port, node / "engine.log", plan, 0.0))
        leader, worker = servers
        wait_ready(leader)
        leader.startup_s = time.monotonic() - t0
        wait_ready(worker)
        worker.startup_s = time.monotonic() - t0
        print(f"\n[emulated two-node replica, PP 2] leader /health 200 after "
              f"{leader.startup_s:.1f} s from launch (worker probes {worker.startup_s:.1f} s); "
              f"RSS MiB leader {rss_mib(leader.proc.pid)}, worker {rss_mib(worker.proc.pid)}",
              file=sys.stderr)
        yield Replica(leader, worker)
    finally:
        for server in reversed(servers):
            kill_group(server.proc)


def test_every_rank_checked_its_own_stage(replica: Replica):
    leader, worker = replica.leader.log_text(), replica.worker.log_text()
    # the engine core checks the first worker of each stage before memory is committed
    for stage in (0, 1):
        assert (f"Spillway plan check passed (pipeline stage {stage}): 1 KV-cache group(s), "
                "16 tokens per hash, 4096 bytes per block") in leader
    # and each worker its own config, in its own process, on its own node
    assert "plan check passed on worker rank 0 (pipeline stage 0)" in leader
    assert "plan check passed on worker rank 1 (pipeline stage 1)" in worker
    assert "FAILED" not in leader + worker
    # each node's emulated GPU built its stage's layers only
    assert "LlamaForCausalLM built on the meta device, 2 cache layers" in leader
    assert "LlamaForCausalLM built on the meta device, 2 cache layers" in worker
    assert "headless multiproc executor" in worker
    exec_line = re.search(r"spillway-engine: exec vllm serve .*", leader)
    start_line = re.search(r"spillway-engine: start vllm serve .*", worker)
    assert exec_line and "--node-rank 0" in exec_line[0] and "--headless" not in exec_line[0]
    assert start_line and "--node-rank 1" in start_line[0] and "--headless" in start_line[0]


def test_the_worker_pod_is_ready_without_an_api_server(replica: Replica):
    worker = replica.worker
    assert get(worker.url("/health"))[0] == 200
    status, body = get(worker.url("/spillway/ready"))
    assert status == 200 and '"headless": true' in body
    assert get(worker.url("/v1/models"))[0] == 404  # the leader serves the API


def test_completions_across_the_two_nodes(replica: Replica):
    tokens = prompt(1, 40)
    first = complete(replica.leader, tokens)
    assert first["usage"]["completion_tokens"] == 8
    assert output_ids(complete(replica.leader, tokens)) == output_ids(first)
    assert output_ids(complete(replica.leader, prompt(2, 40))) != output_ids(first)


def test_prompt_evicted_from_both_stages_comes_back_from_the_host_pools(replica: Replica):
    server = replica.leader
    a = prompt(10, 600)
    first = complete(server, a)
    for seed in range(11, 16):  # 5 x 600 tokens push a's blocks out of both GPU caches
        complete(server, prompt(seed, 600), max_tokens=2)
    before = metrics(server)
    again = complete(server, a)
    after = metrics(server)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("spillway_host_hit_tokens_total") >= 512  # two 256-token chunks
    assert delta("vllm:external_prefix_cache_hits_total") >= 512
    # both stages loaded their own layers' bytes: the whole model's per token
    per_token = sum(g.bytes_per_block // g.tokens_per_block for g in server.plan.kv_groups)
    assert delta("vllm:kv_offload_load_bytes_total") >= 512 * per_token
    assert output_ids(again) == output_ids(first)
    assert after["spillway_emulator_kv_mismatch_total"] == 0
    assert "Emulated KV mismatch" not in server.log_text() + replica.worker.log_text()


def test_drain_on_the_worker_returns_at_once(replica: Replica):
    """Last: it takes the worker pod out of its endpoints (not out of the replica)."""
    t0 = time.monotonic()
    done = subprocess.run(
        [*ENGINE, "drain", "--port", str(replica.worker.port), "--timeout", "30"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"drained": true' in done.stderr
    assert time.monotonic() - t0 < 20
    assert get(replica.worker.url("/spillway/ready"))[0] == 503
    assert get(replica.worker.url("/health"))[0] == 200
