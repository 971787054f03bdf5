"""spillway_router's backends: the --backend flag, plan profiles and pods (pure)."""

from __future__ import annotations

import json

import pytest

from spillway_engine.planner.plan import read_plan
from spillway_router.backends import (
    EVENTS_FROM_POD,
    BackendSpecError,
    Profile,
    backend_from_spec,
    parse_backend_spec,
    profile_from_plan,
)
from spillway_router.kube import backend_from_pod, deployment_from_configmap, pod_ready
from spillway_router.main import build, parser
from tests.unit.simulator_support import GEMMA, LLAMA, PLANS


def plan(name: str):
    return read_plan((PLANS / name).read_bytes(), name)


def test_profile_comes_from_the_plan() -> None:
    p = plan(LLAMA)
    prof = profile_from_plan(p)
    assert prof.tokens_per_hash == p.tokens_per_hash
    assert prof.max_model_len == p.max_model_len
    assert prof.host_capacity_tokens == p.capacity_tokens
    # bytes per token x tokens per chunk = the bytes of one host row
    per_chunk = p.capacity_tokens // p.num_chunks
    assert prof.host_bytes_per_token * per_chunk == pytest.approx(p.row_bytes)
    assert prof.gap == 1
    assert prof.host_gap * p.tokens_per_hash == per_chunk


def test_windowed_groups_do_not_set_the_stride() -> None:
    p = plan(GEMMA)
    assert any(g.sliding_window for g in p.kv_groups)
    full = min(g.tokens_per_block for g in p.kv_groups if g.sliding_window is None)
    assert profile_from_plan(p).gap == max(1, full // p.tokens_per_hash)


def test_backend_spec() -> None:
    f = parse_backend_spec("model=m,url=http://10.0.0.1:8000/,events=tcp://10.0.0.1:5557")
    b = backend_from_spec(f, Profile())
    assert (b.name, b.url, b.events) == ("10.0.0.1:8000", "http://10.0.0.1:8000", f["events"])
    bad_specs = [
        "model=m",
        "url=http://x",
        "model=m,url=ftp://x",
        "model=m,url=http://x,k=v",
        "model=m,url=http://x,events=http://y",
        "model=m,model=n,url=http://x",
        "junk",
    ]
    for bad in bad_specs:
        with pytest.raises(BackendSpecError):
            parse_backend_spec(bad)


def test_command_line_refuses_what_cannot_work() -> None:
    with pytest.raises(SystemExit, match="--backend"):
        build(parser().parse_args([]))
    with pytest.raises(SystemExit, match="PYTHONHASHSEED"):
        build(parser().parse_args(["--hash-algo", "xxhash", "--backend", "model=m,url=http://x"]))
    with pytest.raises(SystemExit, match="nonexistent"):
        build(parser().parse_args(["--backend", "model=m,url=http://x,plan=/nonexistent"]))
    router = build(
        parser().parse_args(["--backend", f"model=m,url=http://x:1,plan={PLANS / LLAMA}"])
    )
    assert router.state.backends["x:1"].profile == profile_from_plan(plan(LLAMA))


def _pod(ready: bool = True, **meta) -> dict:
    return {
        "metadata": {"name": "chat-0", "labels": {}, **meta},
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_pods_become_backends_only_when_ready() -> None:
    data = {
        "plan.json": (PLANS / LLAMA).read_text(),
        "engine.json": json.dumps({"model": "org/llama", "served_model_name": "chat"}),
    }
    info = deployment_from_configmap({"data": data})
    assert info.model == "chat"
    b = backend_from_pod(_pod(), info, 5557)
    assert b is not None
    assert (b.url, b.events, b.model, b.draining) == (
        "http://10.1.2.3:8000", "tcp://10.1.2.3:5557", "chat", False)  # fmt: skip
    assert backend_from_pod(_pod(False), info, 5557) is None
    assert not pod_ready(_pod(deletionTimestamp="2026-01-01T00:00:00Z"))
    assert backend_from_pod(_pod(), None, 5557) is None
    draining = backend_from_pod(_pod(annotations={"spillway.dev/draining": "true"}), info, None)
    assert draining is not None and draining.draining and draining.events is None
    with pytest.raises(ValueError):
        deployment_from_configmap({"data": {"plan.json": "{}", "engine.json": "{}"}})


def test_annotated_pods_list_their_own_event_endpoints() -> None:
    data = {
        "plan.json": (PLANS / LLAMA).read_text(),
        "engine.json": json.dumps({"model": "org/llama"}),
    }
    info = deployment_from_configmap({"data": data})
    on = backend_from_pod(_pod(annotations={"spillway.dev/kv-events": "on"}), info, 5557)
    off = backend_from_pod(_pod(annotations={"spillway.dev/kv-events": "off"}), info, 5557)
    assert on is not None and on.events == EVENTS_FROM_POD == "pod"
    assert off is not None and off.events is None
    f = parse_backend_spec("model=m,url=http://10.0.0.1:8000,events=pod")
    assert backend_from_spec(f, Profile()).events == EVENTS_FROM_POD


def _with_ports(pod: dict, ports: list[tuple[str, int]]) -> dict:
    pod["spec"] = {"containers": [{"name": "engine", "ports": [
        {"name": name, "containerPort": number, "protocol": "TCP"} for name, number in ports]}]}
    return pod


def test_a_pod_with_events_on_is_followed_on_its_declared_ports() -> None:
    """Each data-parallel rank's declared port on the pod's IP, in rank order; a
    multi-node replica's leader (LWS labels) and a pod without declared ports fall back
    to asking the pod (/kv_event_sources lists the worker pods' ranks too)."""
    data = {"plan.json": (PLANS / LLAMA).read_text(),
            "engine.json": json.dumps({"model": "org/llama"})}
    info = deployment_from_configmap({"data": data})
    on = {"spillway.dev/kv-events": "on"}
    ports = [("http", 8000), ("kv-events-1", 6001), ("kv-events", 6000), ("kv-events-x", 1)]
    b = backend_from_pod(_with_ports(_pod(annotations=on), ports), info, 5557)
    assert b is not None and b.events == "tcp://10.1.2.3:6000 tcp://10.1.2.3:6001"
    lws = _pod(annotations=on, labels={"leaderworkerset.sigs.k8s.io/worker-index": "0"})
    b = backend_from_pod(_with_ports(lws, ports), info, 5557)
    assert b is not None and b.events == EVENTS_FROM_POD
    off = {"spillway.dev/kv-events": "off"}
    b = backend_from_pod(_with_ports(_pod(annotations=off), ports), info, 5557)
    assert b is not None and b.events is None
