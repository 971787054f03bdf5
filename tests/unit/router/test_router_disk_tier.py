"""spillway-router and Spillway's disk tier (issue 31): STORAGE events as a third tier,
disk hits weighed between a host hit and none, and a deployment's shared disk folder
credited to every one of its pods (pure; the tier's own events are in
tests/unit/engine/offloader/test_disk_tier.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import msgspec
import pytest

from spillway_engine.planner.plan import PlanRequest, make_plan
from spillway_router.app import RouterConfig, RouterState
from spillway_router.backends import Backend, Profile, profile_from_plan
from spillway_router.events import EventFeed
from spillway_router.index import DISK, GPU, HOST, Match, PrefixIndex
from spillway_router.kube import backend_from_pod, deployment_from_configmap
from spillway_router.main import build, parser
from spillway_router.scoring import DISK_LOAD_FACTOR, CostModel, PodState, Ring, choose
from spillway_router.tokens import Prompt
from tests.unit.planner_fixtures import load_model

GiB = 2**30
COST = CostModel(
    tokens_per_hash=16,
    host_bytes_per_token=32768,  # llama-3.2-1b's plan
    host_bandwidth=25e9,
    prefill_s_per_token=1e-4,
    wait_s_per_request=0.05,
)


def frames(seq: int, events: list[dict]) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, events, None])]


def ev(kind: str, keys: list[int], medium: str = DISK) -> dict:
    return {"type": kind, "block_hashes": list(keys), "medium": medium}


def disk_plan(writers: int):
    return make_plan(
        load_model("llama-3.2-1b"),
        PlanRequest(
            model_name="llama-3.2-1b",
            cpu_memory_bytes=8 * GiB,
            disk_bytes=200 * GiB,
            disk_writers=writers,
        ),
    )


# ---- events into the index -----------------------------------------------------


def test_storage_events_flow_into_the_index_as_a_third_tier() -> None:
    index = PrefixIndex()
    feed = EventFeed("a", index, lambda _p: None)
    feed.handle(frames(0, [ev("BlockStored", [1, 2]), ev("BlockStored", [1], HOST)]))
    assert index.holders(1) == {("a", DISK): 1, ("a", HOST): 1}
    assert index.tier_size("a", DISK) == 2 and feed.errors == 0
    # a prefix-cache reset empties the GPU and host pool; the files stay
    feed.handle(frames(1, [{"type": "AllBlocksCleared"}]))
    assert index.holders(1) == {("a", DISK): 1} and index.tier_size("a", HOST) == 0
    # an eviction removes (counted: announced once per chunk holding the hash)
    feed.handle(frames(2, [ev("BlockStored", [2]), ev("BlockRemoved", [1, 2])]))
    assert index.holders(1) == {} and index.holders(2) == {("a", DISK): 1}
    feed.handle(frames(3, [ev("BlockRemoved", [2])]))
    assert index.size() == 0


def test_match_splits_gpu_host_and_disk() -> None:
    idx = PrefixIndex()
    idx.store("a", GPU, [1, 2])
    idx.store("a", HOST, [3])
    idx.store("a", DISK, [3, 4, 5])  # 3 is also in the pool: a host hit
    idx.store("a", HOST, [6])
    idx.store("b", DISK, [1, 2, 3])
    m = idx.match([1, 2, 3, 4, 5, 6, 7], ["a", "b", "c"])
    assert m["a"] == Match(2, 2, 2) and m["a"].units == 6
    assert m["b"] == Match(0, 0, 3)
    assert m["c"] == Match()


def test_disk_chunks_keyed_once_per_chunk_take_the_gaps_before_them() -> None:
    idx = PrefixIndex()
    idx.store("a", GPU, [1, 2])
    idx.store("a", HOST, [4])  # chunk-end keys of 4-block chunks
    idx.store("a", DISK, [8, 12])
    keys = list(range(1, 14))
    assert idx.match(keys, ["a"], host_gap=4)["a"] == Match(2, 2, 8)
    assert idx.match(keys, ["a"], host_gap=1)["a"] == Match(2, 0, 0)


# ---- scoring --------------------------------------------------------------------


def test_the_disk_factor_is_the_measured_cold_load() -> None:
    assert DISK_LOAD_FACTOR == 11.0
    tokens = 1024
    assert COST.disk_transfer_s(tokens) == pytest.approx(11 * COST.transfer_s(tokens))
    # a disk chunk file may be padded: its own bytes per token
    padded = replace(COST, disk_bytes_per_token=2 * 32768)
    assert padded.disk_transfer_s(tokens) == pytest.approx(22 * COST.transfer_s(tokens))


def test_a_disk_hit_ranks_between_a_host_hit_and_none() -> None:
    prompt = 4096
    host, disk, none = (COST.ttft_s(prompt, m, 0) for m in (Match(0, 200), Match(0, 0, 200),
                                                            Match()))  # fmt: skip
    assert host < disk < none
    # ... and after a GPU hit of the same length
    assert COST.ttft_s(prompt, Match(200), 0) < host
    ps = [PodState(p, COST) for p in ("h", "d", "n")]
    ring = Ring([p.name for p in ps])
    matches = {"h": Match(0, 200), "d": Match(0, 0, 200)}
    d = choose(ps, prompt, matches, ring, key=1)
    assert (d.pod, d.reason, d.host_tokens, d.disk_tokens) == ("h", "prefix", 3200, 0)
    d = choose(ps[1:], prompt, matches, ring, key=1)
    assert (d.pod, d.reason, d.cached_tokens, d.disk_tokens) == ("d", "prefix", 3200, 3200)


def test_a_longer_disk_hit_beats_a_shorter_host_hit_and_mixed_hits_count_both() -> None:
    prompt = 4096
    assert COST.ttft_s(prompt, Match(0, 0, 200), 0) < COST.ttft_s(prompt, Match(0, 100), 0)
    ps = [PodState(p, COST) for p in ("a", "b")]
    d = choose(ps, prompt, {"a": Match(10, 20, 30), "b": Match(10, 20)}, Ring(["a", "b"]), 1)
    assert (d.pod, d.cached_tokens, d.host_tokens, d.disk_tokens) == ("a", 960, 320, 480)


def test_a_disk_load_slower_than_recomputing_scores_as_nothing() -> None:
    slow = replace(COST, host_bandwidth=1e8)  # 11 x 328 us per token > 100 us prefill
    assert slow.ttft_s(4096, Match(0, 0, 200), 0) == pytest.approx(slow.ttft_s(4096, Match(), 0))
    # never worse than no hit, however slow the disk
    assert replace(slow, disk_load_factor=1e6).ttft_s(4096, Match(0, 0, 200), 0) <= slow.ttft_s(
        4096, Match(), 0
    )


# ---- the plan tells the router about a shared folder -------------------------------


def test_profile_reads_the_disk_tier_and_its_sharing_from_the_plan() -> None:
    shared = profile_from_plan(disk_plan(writers=3))
    plan = disk_plan(writers=3)
    assert shared.disk_group == plan.disk.cache_key
    assert shared.disk_capacity_tokens == plan.disk.capacity_tokens
    assert shared.disk_bytes_per_token == pytest.approx(shared.host_bytes_per_token, rel=0.01)
    assert profile_from_plan(disk_plan(writers=1)).disk_group is None
    nodisk = make_plan(load_model("llama-3.2-1b"),
                       PlanRequest(model_name="llama-3.2-1b", cpu_memory_bytes=8 * GiB))
    assert profile_from_plan(nodisk).disk_group is None
    assert profile_from_plan(nodisk).disk_capacity_tokens == 0


def _pod(name: str, deployment: str, namespace: str = "team-a") -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"spillway.dev/inference-deployment": deployment},
            "annotations": {"spillway.dev/kv-events": "on"},
        },
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_a_deployments_pods_share_one_disk_group_from_its_plan_configmap() -> None:
    data = {
        "plan.json": disk_plan(writers=2).model_dump_json(),
        "engine.json": json.dumps({"model": "org/llama"}),
    }
    info = deployment_from_configmap({"data": data})
    a = backend_from_pod(_pod("chat-0", "chat"), info, None)
    b = backend_from_pod(_pod("chat-1", "chat"), info, None)
    other = backend_from_pod(_pod("chat-0", "chat", namespace="team-b"), info, None)
    assert a is not None and b is not None and other is not None
    key = disk_plan(writers=2).disk.cache_key
    assert a.profile.disk_group == b.profile.disk_group == f"team-a/chat/{key}"
    assert other.profile.disk_group != a.profile.disk_group
    data["plan.json"] = disk_plan(writers=1).model_dump_json()
    private = backend_from_pod(_pod("chat-0", "chat"), deployment_from_configmap({"data": data}),
                               None)  # fmt: skip
    assert private is not None and private.profile.disk_group is None


def test_the_command_line_sets_the_disk_factor(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(disk_plan(writers=2).model_dump_json())
    args = ["--backend", f"model=m,url=http://x:1,plan={plan}"]
    router = build(parser().parse_args(args))
    assert router.state.config.disk_load_factor == DISK_LOAD_FACTOR
    assert router.state.backends["x:1"].profile.disk_group is not None
    router = build(parser().parse_args([*args, "--disk-load-factor", "3"]))
    assert router.state.config.disk_load_factor == 3.0


# ---- a shared folder in the router's state ------------------------------------------


def state_with(*backends: Backend) -> RouterState:
    state = RouterState(RouterConfig(mode="events"))
    for b in backends:
        state.upsert(b)
        state.set_healthy(b.name, True)
        state.events_live.add(b.name)
    return state


def backend(name: str, group: str | None, model: str = "m") -> Backend:
    profile = Profile(tokens_per_hash=4, max_model_len=4096, host_bytes_per_token=32768.0,
                      disk_group=group)  # fmt: skip
    return Backend(name, model, f"http://{name}:8000", "pod", profile)


def test_a_chunk_one_pod_stored_on_a_shared_folder_is_on_disk_for_every_pod() -> None:
    state = state_with(backend("a", "ns/chat/k"), backend("b", "ns/chat/k"),
                       backend("c", "ns/other/k"), backend("d", None))  # fmt: skip
    prompt = Prompt(tokens=list(range(64)), text=None)
    keys = state.keys(prompt, 4)
    feeds = {n: EventFeed(n, state.index, state.on_event_batch) for n in "abcd"}
    feeds["a"].handle(frames(0, [ev("BlockStored", keys[:8])]))
    feeds["d"].handle(frames(0, [ev("BlockStored", keys[:4])]))
    m = state.index.match(keys, ["a", "b", "c", "d"])
    assert m["a"] == m["b"] == Match(0, 0, 8)
    assert m["c"] == Match()  # another deployment's folder
    assert m["d"] == Match(0, 0, 4)  # its own disk only
    assert state.index.tier_size("b", DISK) == 8
    # b holds part in memory too: the rest still comes from the shared folder
    feeds["b"].handle(frames(0, [ev("BlockStored", keys[:2], GPU)]))
    assert state.index.match(keys, ["b"])["b"] == Match(2, 0, 6)
    # routing picks a pod of the folder, and says the tokens come from disk
    candidates, _ = state.route("m", prompt)
    assert candidates[0].name == "b"
    # the writer's eviction takes the chunk away for every pod
    feeds["a"].handle(frames(1, [ev("BlockRemoved", keys[4:8])]))
    m = state.index.match(keys, ["a", "b"])
    assert m["a"] == Match(0, 0, 4) and m["b"] == Match(2, 0, 2)


def test_a_shared_folder_outlives_a_member_restart_but_not_its_last_member() -> None:
    state = state_with(backend("a", "g"), backend("b", "g"))
    feed = EventFeed("a", state.index, lambda _p: None)
    feed.handle(frames(5, [ev("BlockStored", [1, 2]), ev("BlockStored", [1, 2], HOST)]))
    # a's engine restarts (its sequence starts again): its memory is gone, the files stay
    feed.handle(frames(0, []))
    assert state.index.match([1, 2], ["a", "b"]) == {"a": Match(0, 0, 2), "b": Match(0, 0, 2)}
    state.set_healthy("a", False)  # unhealthy: its caches are forgotten, not the folder
    assert state.index.match([1, 2], ["b"])["b"] == Match(0, 0, 2)
    state.remove("a")
    assert state.index.match([1, 2], ["b"])["b"] == Match(0, 0, 2)
    state.remove("b")  # the last member: the group's entries go
    assert state.index.size() == 0 and state.index.pods() == set()


def test_a_pod_joining_a_group_drops_its_private_disk_entries() -> None:
    idx = PrefixIndex()
    idx.store("a", DISK, [1])
    idx.store("a", GPU, [2])
    idx.set_disk_group("a", "g")
    assert idx.holders(1) == {} and idx.holders(2) == {("a", GPU): 1}
    idx.store("b", DISK, [3])  # b not in the group: its own
    idx.set_disk_group("b", "g")
    idx.store("a", DISK, [4])
    assert idx.holders(4) == {("disk-group:g", DISK): 1}
    assert idx.match([4], ["b"])["b"] == Match(0, 0, 1)
    assert idx.pods() == {"a"}  # a group is not a pod
    idx.set_disk_group("a", None)
    idx.set_disk_group("b", None)
    assert idx.holders(4) == {}
