"""An emulated two-node replica with data parallel x expert parallel: vLLM 0.33.0's DP
attention over two ``spillway-engine serve --nnodes 2`` processes, as a LeaderWorkerSet
group of two pods runs a DeepSeek-style MoE model (README: "Data parallel x expert
parallel across nodes").

The plan is DP 2 over 2 nodes: each node holds one whole engine (``--data-parallel-size
2 --data-parallel-size-local 1``; the worker ``--headless --data-parallel-start-rank
1``), the experts spread over both (``--enable-expert-parallel``: vLLM names the
workers ``DP0_EP0`` and ``DP1_EP1``). Each engine has its own emulated GPU, Spillway's
offloader with its own host pool and the plan check; the leader's front end serves
both and lists both ranks' KV event publishers at ``/kv_event_sources``, each bound on
its own node at the group's declared port plus its rank. spillway-router, given only
the leader, follows both ranks' events into its index under the leader's name.
Requests are pinned to a rank with vLLM's ``X-data-parallel-rank`` header.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.engine_process import (
    Server,
    free_port,
    get,
    kill_group,
    launch,
    plan_for,
    prompt,
    wait_ready,
    write_plan,
)
from spillway_engine.emulator.tiny import deepseek_v2_config, write_model
from tests.contract.test_engine_multinode import _rank_args
from tests.helpers import wait_for

#: Each engine's emulated GPU: 80 blocks of the tiny MLA model (3 layers, the third a
#: MoE layer of 4 routed experts, 2 a rank under expert parallel; 55,296 bytes a block)
GPU_BLOCKS = 80


@dataclass
class Replica:
    leader: Server
    worker: Server
    events_port: int  # the group's declared base: rank r publishes on base + r
    router: subprocess.Popen[bytes]
    router_url: str
    router_log: Path


def _dp_rank_args(rank: int, master_port: int, events_port: int) -> list[str]:
    """A rank's launcher flags, the group's event port base, and vLLM's EP flag."""
    return [*_rank_args(rank, master_port), "--kv-events-port", str(events_port),
            "--", "--enable-expert-parallel"]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    root = tmp_path_factory.mktemp("multinode-dp")
    model = write_model(root / "deepseek", deepseek_v2_config(num_layers=3))
    plan = plan_for(model, data_parallel_size=2, nodes=2)
    block = plan.kv_groups[0].bytes_per_block
    master, events = free_port(), free_port()
    servers: list[Server] = []
    router = None
    t0 = time.monotonic()
    try:
        for rank in (0, 1):
            node = root / f"node{rank}"  # a pod of its own: shm folder, termination log
            plan_path = write_plan(node, plan, model)
            port = free_port()
            proc = launch(plan_path, node / "engine.log", port, GPU_BLOCKS * block,
                          serve_args=_dp_rank_args(rank, master, events))
            servers.append(Server(f"node{rank}", proc, port, node / "engine.log", plan, 0.0))
        leader, worker = servers
        wait_ready(leader)
        leader.startup_s = time.monotonic() - t0
        wait_ready(worker)
        print(f"\n[emulated two-node replica, DP 2 x EP] leader /health 200 after "
              f"{leader.startup_s:.1f} s from launch", file=sys.stderr)
        rport = free_port()
        router_log = root / "router.log"
        backend = (f"model=tiny,url=http://127.0.0.1:{leader.port},name=leader,events=pod,"
                   f"plan={root / 'node0' / 'plan.json'}")
        with open(router_log, "wb") as out:
            router = subprocess.Popen(
                [str(Path(sys.executable).with_name("spillway-router")), "--host", "127.0.0.1",
                 "--port", str(rport), "--probe-interval", "0.5", "--backend", backend],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: "KV events from" in router_log.read_text(), 60,
                 "the router to follow the leader's KV event sources", interval=0.2,
                 on_timeout=lambda: router_log.read_text()[-2000:])
        yield Replica(leader, worker, events, router, f"http://127.0.0.1:{rport}", router_log)
    finally:
        if router is not None:
            kill_group(router)
        for server in reversed(servers):
            kill_group(server.proc)


def _complete(url: str, tokens: list[int], rank: int | None = None,
              max_tokens: int = 8) -> dict:
    headers = {"Content-Type": "application/json"}
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)  # vLLM's own pin to a DP rank
    body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def _per_engine(url: str) -> dict[tuple[str, str], float]:
    """(series, engine label) -> value, from the leader's /metrics (it reports both)."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(get(f"{url}/metrics")[1]):
        for s in family.samples:
            if "engine" in s.labels and not s.name.endswith("_created"):
                out[(s.name, s.labels["engine"])] = s.value
    return out


def _within(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.3)
    return False


def _router_metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(get(f"{url}/metrics")[1]):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_each_node_runs_one_whole_engine_with_the_experts_spread_over_both(replica: Replica):
    leader, worker = replica.leader.log_text(), replica.worker.log_text()
    exec_line = re.search(r"spillway-engine: exec vllm serve .*", leader)
    start_line = re.search(r"spillway-engine: start vllm serve .*", worker)
    assert exec_line and start_line
    for line in (exec_line[0], start_line[0]):
        assert "--data-parallel-size 2" in line and "--data-parallel-size-local 1" in line
        assert "--enable-expert-parallel" in line
    assert "--headless" not in exec_line[0]
    assert "--headless" in start_line[0] and "--data-parallel-start-rank 1" in start_line[0]
    # each engine core and its worker checked the plan, each on its own node
    assert "(EngineCore_DP0" in leader and "(EngineCore_DP1" in worker
    for log, rank in ((leader, 0), (worker, 1)):
        assert re.search(rf"\(EngineCore_DP{rank} .*Spillway plan check passed: 1 KV-cache "
                         r"group\(s\), 16 tokens per hash, 55296 bytes per block", log)
        assert re.search(rf"\(Worker_DP{rank}_EP{rank} .*Spillway plan check passed on "
                         "worker rank 0", log)
    assert "FAILED" not in leader + worker


def test_the_leader_lists_both_ranks_publishers_each_on_its_own_port(replica: Replica):
    status, body = get(replica.leader.url("/kv_event_sources"))
    assert status == 200
    sources = json.loads(body)
    assert sorted(sources) == ["0", "1"]
    for rank, config in sources.items():
        assert config["endpoint"].endswith(f":{replica.events_port + int(rank)}")


def test_both_ranks_serve_and_agree(replica: Replica):
    url = f"http://127.0.0.1:{replica.leader.port}"
    before = _per_engine(url)
    tokens = prompt(3, 48)
    on_0, on_1 = _complete(url, tokens, rank=0), _complete(url, tokens, rank=1)
    after = _per_engine(url)
    for rank in ("0", "1"):
        key = ("vllm:prompt_tokens_total", rank)
        assert after[key] - before.get(key, 0.0) == 48, (rank, after)
    assert on_0["choices"][0]["text"] == on_1["choices"][0]["text"]  # the same weights


def test_the_router_indexes_what_the_worker_nodes_rank_caches(replica: Replica):
    """A prompt only rank 1 (on the worker's node) has seen is in the router's index
    for the leader: it followed the worker rank's publisher too."""
    log = replica.router_log.read_text()
    base = replica.events_port
    assert f"tcp://127.0.0.1:{base}, tcp://127.0.0.1:{base + 1}" in log, log[-2000:]
    url = f"http://127.0.0.1:{replica.leader.port}"

    def indexed() -> float:  # the index's tier labels are vLLM's media
        return _router_metric(replica.router_url, "spillway_router_index_blocks",
                              pod="leader", source="events", tier="GPU")

    # A fresh prompt of 20 blocks of 16 tokens, seen by rank 1 only, until the router
    # indexes it (a ZMQ subscriber misses what is published while it still connects:
    # the first prompt may be sent just after the router asked for the sources).
    for seed in (40, 41, 42):
        held = indexed()
        tokens = prompt(seed, 320)
        _complete(url, tokens, rank=1)
        if _within(lambda: indexed() >= held + 19, 10):  # noqa: B023
            break
    else:
        raise AssertionError(f"the router never indexed rank 1's blocks: "
                             f"{replica.router_log.read_text()[-2000:]}")
    # and routes on them: one request through the router, expected cached before it runs
    expected = "spillway_router_expected_cached_tokens_total"
    before = _router_metric(replica.router_url, expected, tier="gpu")
    _complete(replica.router_url, tokens, max_tokens=1)
    assert _router_metric(replica.router_url, expected, tier="gpu") - before >= 256


def test_a_prompt_evicted_from_the_worker_ranks_gpu_comes_back_from_its_host_pool(
        replica: Replica):
    url = f"http://127.0.0.1:{replica.leader.port}"
    a = prompt(10, 600)
    first = _complete(url, a, rank=1)
    for seed in range(11, 16):  # 5 x 600 tokens push a's blocks out of rank 1's 80 blocks
        _complete(url, prompt(seed, 600), rank=1, max_tokens=2)
    before = _per_engine(url)
    again = _complete(url, a, rank=1)
    after = _per_engine(url)

    def delta(name: str, rank: str = "1") -> float:
        return after.get((name, rank), 0.0) - before.get((name, rank), 0.0)

    assert delta("spillway_host_hit_tokens_total") >= 512  # two 256-token chunks
    assert delta("vllm:external_prefix_cache_hits_total") >= 512
    assert delta("vllm:external_prefix_cache_hits_total", "0") == 0  # rank 0 untouched
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert after[("spillway_emulator_kv_mismatch_total", "1")] == 0

