"""``spillway-engine serve --nnodes N``: one vLLM instance over a LeaderWorkerSet group.

The pure half: this pod's rank from the flags or LWS's environment, vLLM 0.33's
multi-node flags for tensor / pipeline and data parallelism, the refusals (one line,
exit 2, the termination message), ``VLLM_PP_LAYER_PARTITION``, the per-stage plan
check and a headless rank's probes. The emulated two-node replica is in
tests/contract/test_engine_multinode.py.
"""

from __future__ import annotations

import json
import shlex
import socket
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from spillway_engine import seam
from spillway_engine.cli import main
from spillway_engine.launcher import headless, multinode
from spillway_engine.launcher.multinode import (
    DIST_PORT,
    MultiNodeError,
    Node,
    gpus_per_node,
    node_from,
    parallel_launch,
)
from spillway_engine.launcher.plan_check import (
    ObservedGeometry,
    ObservedGroup,
    compare,
    stage_of_rank,
    stage_plan,
)
from spillway_engine.planner.plan import Plan, PlanRequest, make_plan
from spillway_engine.seam import DRAIN_PATH, READY_PATH
from tests.unit.planner_fixtures import load_model

GIB = 2**30
LLAMA = "llama-3.2-1b"  # 16 layers, one full-attention group

LWS = {
    "LWS_LEADER_ADDRESS": "replica-0.replica.ns",
    "LWS_GROUP_SIZE": "2",
    "LWS_WORKER_INDEX": "1",
}


@pytest.fixture(autouse=True)
def pod_host(tmp_path, monkeypatch) -> Path:
    host = tmp_path / "host"
    (host / "shm").mkdir(parents=True)
    (host / "cgroup").mkdir()
    monkeypatch.setenv("SPILLWAY_SHM_DIR", str(host / "shm"))
    monkeypatch.setenv("SPILLWAY_CGROUP_ROOT", str(host / "cgroup"))
    monkeypatch.setenv("SPILLWAY_TERMINATION_LOG", str(host / "termination-log"))
    for name in LWS:
        monkeypatch.delenv(name, raising=False)
    return host


def plan_for(**kw: Any) -> Plan:
    kw.setdefault("cpu_memory_bytes", 8 * GIB)
    kw.setdefault("max_model_len", 8192)
    return make_plan(load_model(LLAMA), PlanRequest(model_name=LLAMA, **kw))


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


# ------------------------------------------------------------------ rank information


def test_one_node_is_todays_launch():
    assert node_from(1, LWS) == Node()
    assert parallel_launch(plan_for(tensor_parallel_size=8), Node()) == ([], {})
    # the operator reads it from the seam (its only way into the engine)
    assert multinode.DIST_PORT == DIST_PORT == seam.DIST_PORT == 29500


def test_rank_and_leader_come_from_leaderworkerset():
    node = node_from(2, LWS)
    assert node == Node(nnodes=2, rank=1, master_addr="replica-0.replica.ns", master_port=29500)
    assert node.headless
    leader = node_from(2, {**LWS, "LWS_WORKER_INDEX": "0"})
    assert leader.rank == 0 and not leader.headless


def test_flags_override_leaderworkerset():
    node = node_from(2, LWS, node_rank=0, master_addr="127.0.0.1", master_port=29517)
    assert node == Node(nnodes=2, rank=0, master_addr="127.0.0.1", master_port=29517)


@pytest.mark.parametrize(
    ("nnodes", "env", "rank", "says"),
    [
        (2, {}, None, "LWS_WORKER_INDEX"),
        (2, {"LWS_WORKER_INDEX": "1"}, None, "LWS_LEADER_ADDRESS"),
        (2, {**LWS, "LWS_GROUP_SIZE": "4"}, None, "LWS_GROUP_SIZE=4"),
        (2, {**LWS, "LWS_WORKER_INDEX": "x"}, None, "not a whole number"),
        (2, LWS, 2, "outside 0..1"),
        (0, LWS, None, "at least 1"),
    ],
)
def test_rank_information_refusals(nnodes, env, rank, says):
    with pytest.raises(MultiNodeError, match=says):
        node_from(nnodes, env, node_rank=rank)


# ------------------------------------------------------- tensor / pipeline over nodes


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_pipeline_over_nodes_uses_vllms_multinode_flags(rank):
    plan = plan_for(tensor_parallel_size=8, pipeline_parallel_size=4)
    node = Node(nnodes=4, rank=rank, master_addr="leader", master_port=29500)
    args, env = parallel_launch(plan, node)
    assert flag(args, "--nnodes") == "4"
    assert flag(args, "--node-rank") == str(rank)
    assert flag(args, "--master-addr") == "leader"
    assert flag(args, "--master-port") == "29500"
    assert ("--headless" in args) == (rank > 0)
    assert not any(a.startswith("--data-parallel") for a in args)
    assert gpus_per_node(plan, 4) == 8
    assert env == {}  # vLLM's own even split


def test_tensor_parallel_over_two_nodes():
    plan = plan_for(tensor_parallel_size=16)
    args, _ = parallel_launch(plan, Node(nnodes=2, rank=1, master_addr="l"))
    assert args == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "l",
                    "--master-port", "29500", "--headless"]
    assert gpus_per_node(plan, 2) == 8


def test_uneven_split_is_refused():
    plan = plan_for(tensor_parallel_size=2, pipeline_parallel_size=3)
    with pytest.raises(MultiNodeError, match=r"TP 2 x PP 3 = 6 GPUs do not split evenly "
                       r"over 4 nodes"):
        parallel_launch(plan, Node(nnodes=4, rank=0, master_addr="l"))


def test_layer_partition_is_exported_on_one_node_and_many():
    plan = plan_for(pipeline_parallel_size=2, pipeline_layer_partition=[9, 7])
    assert parallel_launch(plan, Node()) == ([], {"VLLM_PP_LAYER_PARTITION": "9,7"})
    args, env = parallel_launch(plan, Node(nnodes=2, rank=1, master_addr="l"))
    assert env == {"VLLM_PP_LAYER_PARTITION": "9,7"} and "--headless" in args


# ---------------------------------------------------------------- data parallel


def dp_plan(dp: int, tp: int = 1) -> Plan:
    """A data-parallel plan (the planner may refuse DP across nodes itself; the
    launcher's flags are tested on the parallelism alone)."""
    plan = plan_for(tensor_parallel_size=tp)
    par = plan.parallelism.model_copy(update={"data_parallel_size": dp})
    return plan.model_copy(update={"parallelism": par})


@pytest.mark.parametrize(("rank", "start"), [(0, None), (1, "4"), (3, "12")])
def test_data_parallel_over_nodes(rank, start):
    plan = dp_plan(16, tp=2)
    args, _ = parallel_launch(plan, Node(nnodes=4, rank=rank, master_addr="leader",
                                         master_port=29500))
    assert flag(args, "--data-parallel-size-local") == "4"
    assert flag(args, "--data-parallel-address") == "leader"
    assert flag(args, "--data-parallel-rpc-port") == "29500"
    assert ("--headless" in args) == (rank > 0)
    if start is None:  # a start rank on the leader would mean hybrid load balancing
        assert "--data-parallel-start-rank" not in args
    else:
        assert flag(args, "--data-parallel-start-rank") == start
    assert "--nnodes" not in args and "--node-rank" not in args
    assert gpus_per_node(plan, 4) == 8


def test_data_parallel_engines_must_not_straddle_nodes():
    with pytest.raises(MultiNodeError, match="whole data-parallel engines"):
        parallel_launch(dp_plan(2, tp=4), Node(nnodes=4, rank=0, master_addr="l"))


# ------------------------------------------------------------------ the command


def write(tmp_path: Path, plan: Plan) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    (tmp_path / "engine.json").write_text(json.dumps({"model": "org/m"}))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_on_a_worker_pod(tmp_path, capsys, monkeypatch):
    for name, value in LWS.items():
        monkeypatch.setenv(name, value)
    path = write(tmp_path, plan_for(pipeline_parallel_size=2))
    code, out, err = run(capsys, "serve", "--plan", str(path), "--nnodes", "2", "--dry-run")
    assert code == 0, err
    cmd = shlex.split(out)
    assert cmd[:2] == ["vllm", "serve"]
    assert flag(cmd, "--node-rank") == "1"
    assert flag(cmd, "--master-addr") == "replica-0.replica.ns"
    assert flag(cmd, "--master-port") == "29500"
    assert "--headless" in cmd
    assert "node 1 of 2 (headless" in err


def test_dry_run_flags_beat_the_environment(tmp_path, capsys, monkeypatch):
    for name, value in LWS.items():
        monkeypatch.setenv(name, value)
    path = write(tmp_path, plan_for(pipeline_parallel_size=2))
    code, out, _ = run(capsys, "serve", "--plan", str(path), "--nnodes", "2", "--node-rank",
                       "0", "--master-addr", "127.0.0.1", "--master-port", "29517", "--dry-run")
    assert code == 0
    cmd = shlex.split(out)
    assert "--headless" not in cmd
    assert flag(cmd, "--master-addr") == "127.0.0.1" and flag(cmd, "--master-port") == "29517"


def test_one_node_command_is_unchanged(tmp_path, capsys):
    path = write(tmp_path, plan_for(tensor_parallel_size=2))
    code, out, _ = run(capsys, "serve", "--plan", str(path), "--dry-run")
    assert code == 0
    cmd = shlex.split(out)
    assert not {"--nnodes", "--node-rank", "--master-addr", "--headless"} & set(cmd)


def test_uneven_split_stops_the_pod_with_a_termination_message(tmp_path, capsys, pod_host):
    path = write(tmp_path, plan_for(tensor_parallel_size=2, pipeline_parallel_size=3))
    code, _, err = run(capsys, "serve", "--plan", str(path), "--nnodes", "4", "--node-rank",
                       "0", "--master-addr", "l")
    assert code == 2
    line = err.strip()
    assert line.startswith("spillway-engine: error: TP 2 x PP 3 = 6 GPUs do not split")
    assert "\n" not in line
    assert (pod_host / "termination-log").read_text() == line


def test_missing_leader_address_stops_the_pod(tmp_path, capsys, pod_host):
    path = write(tmp_path, plan_for(pipeline_parallel_size=2))
    code, _, err = run(capsys, "serve", "--plan", str(path), "--nnodes", "2", "--node-rank", "1")
    assert code == 2
    assert "LWS_LEADER_ADDRESS" in err
    assert "LWS_LEADER_ADDRESS" in (pod_host / "termination-log").read_text()


# ------------------------------------------------------------- per-stage plan check


def observed_for(plan: Plan) -> ObservedGeometry:
    """What vLLM reports when it built ``plan`` exactly (Spillway's connector)."""
    sp = plan.spillway
    return ObservedGeometry(
        tensor_parallel_size=plan.parallelism.tensor_parallel_size,
        pipeline_parallel_size=plan.parallelism.pipeline_parallel_size,
        max_model_len=plan.max_model_len,
        groups=tuple(
            ObservedGroup(g.kind, g.num_layers, g.tokens_per_block, g.page_bytes,
                          g.sliding_window)
            for g in plan.kv_groups
        ),
        tokens_per_hash=plan.tokens_per_hash,
        worker_bytes_per_block=plan.worker_bytes_per_block,
        kv_connector="SpillwayOffloadingConnector",
        cpu_bytes_to_use=plan.cpu_memory_bytes,
        chunk_tokens=sp.chunk_tokens,
        group_blocks_per_chunk=tuple(g.blocks_per_chunk for g in sp.groups),
        group_units=tuple(g.units for g in sp.groups),
        unit_bytes=sp.unit_bytes,
        num_units=sp.num_units,
    )


def test_each_stage_is_checked_against_its_own_layers():
    plan = plan_for(tensor_parallel_size=2, pipeline_parallel_size=2,
                    pipeline_layer_partition=[9, 7])
    assert [stage_of_rank(plan, r) for r in range(4)] == [0, 0, 1, 1]
    first, second = stage_plan(plan, 0), stage_plan(plan, 1)
    assert first.kv_groups[0].num_layers == 9 and second.kv_groups[0].num_layers == 7
    assert compare(first, observed_for(first)) == []
    assert compare(second, observed_for(second)) == []
    # stage 1's workers built stage 0's layers (a wrong VLLM_PP_LAYER_PARTITION)
    wrong = compare(second, observed_for(first))
    assert any(m.field == "kv_groups[0].num_layers" and (m.plan, m.vllm) == (7, 9)
               for m in wrong)
    # the whole model's plan is what a stage's worker does not hold
    assert compare(plan, observed_for(second)) != []
    assert stage_plan(plan, None) is plan
    no_pp = plan_for()
    assert stage_plan(no_pp, 0) is no_pp


# --------------------------------------------------------------- a headless rank's probes


def _call(url: str, method: str = "GET") -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_headless_probes_follow_the_vllm_process():
    alive = [True]
    state = headless.RankState(lambda: alive[0])
    server = headless.probe_server("127.0.0.1", 0, state)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert _call(base + "/health")[0] == 200
        assert _call(base + READY_PATH)[0] == 200
        assert _call(base + "/v1/completions")[0] == 404
        # the preStop's drain: nothing in flight on a worker, answered at once
        status, body = _call(base + DRAIN_PATH, "POST")
        assert status == 200 and body["drained"] is True and body["headless"] is True
        assert _call(base + READY_PATH)[0] == 503  # draining: out of the endpoints
        assert _call(base + "/health")[0] == 200  # but alive
        alive[0] = False
        assert _call(base + "/health")[0] == 503
    finally:
        server.shutdown()
        server.server_close()


def test_drain_command_on_a_worker_does_not_hang(capsys):
    state = headless.RankState(lambda: True)
    server = headless.probe_server("127.0.0.1", 0, state)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = main(["drain", "--port", str(server.server_address[1]), "--timeout", "5"])
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0
    assert '"drained": true' in capsys.readouterr().err


def test_headless_run_answers_while_the_child_lives(tmp_path):
    """run_headless: the child's exit status is the launcher's."""
    code = headless.run_headless([sys.executable, "-c", "import sys; sys.exit(3)"], {},
                                 "127.0.0.1", 0)
    assert code == 3


# ------------------------------------------------------------------ reaching the leader


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_worker_waits_for_its_leaders_port():
    clock, tries = FakeClock(), []

    def connect(host: str, port: int, timeout: float) -> None:
        tries.append((host, port))
        if len(tries) < 4:  # refused while the leader's engine starts
            raise ConnectionRefusedError(111, "Connection refused")

    worker = multinode.Node(nnodes=2, rank=1, master_addr="big-0.big.ns", master_port=29500)
    waited = multinode.wait_for_leader(worker, 60, connect=connect, sleep=clock.sleep,
                                       clock=clock)
    assert waited == 6.0 and tries == [("big-0.big.ns", 29500)] * 4


def test_a_worker_that_cannot_reach_its_leader_says_where_and_what_to_check():
    clock = FakeClock()

    def connect(host: str, port: int, timeout: float) -> None:
        raise socket.gaierror(-2, "Name or service not known")

    worker = multinode.Node(nnodes=2, rank=1, master_addr="big-0.big.ns", master_port=29500)
    with pytest.raises(multinode.MultiNodeError) as info:
        multinode.wait_for_leader(worker, 30, connect=connect, sleep=clock.sleep, clock=clock)
    message = str(info.value)
    assert "node rank 1 cannot reach its leader at big-0.big.ns:29500 after 30 s" in message
    assert "Name or service not known" in message and "LWS_LEADER_ADDRESS" in message
    assert "port 29500" in message and "NetworkPolicy" in message
