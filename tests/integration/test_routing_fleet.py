"""spillway-router in front of operator-managed pods on the local control plane.

``InferenceDeployment`` (two replicas of a tiny Llama on emulated GPUs) -> operator ->
Deployment -> KWOK pods with loopback IPs, each running its container's own
``spillway-engine serve --emulate-gpu`` on its IP (the fleet plays the kubelet,
downward-API ``SPILLWAY_POD_IP`` included). The engines publish KV events by
default, bound on their pod IPs at the declared port; ``spillway-router
--kube-namespace`` watches the pods, reads each one's plan ConfigMap and its declared
``kv-events`` port, and follows their events.

A prefix is put on one pod *behind the router's back*, chosen so that the router's
cold choice (its hash ring) would be the other pod: requests sharing it land on the
pod that holds it -- its prefix-cache hits rise, the other pod is not even asked --
which only the event-fed index can explain. Then that pod's engine is SIGKILLed in
the middle of a run of such requests: they fail over to the other pod, and the
router drops the dead pod and every index entry it had for it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from e2e.engine_process import free_port, kill_group
from e2e.gateway import Envoy, GatewayConfig
from e2e.simfleet import ENGINE_PORT, SimulatorFleet
from spillway_engine.emulator.tiny import llama_config, write_model
from spillway_router.hashing import BlockHasher, HashConfig
from spillway_router.scoring import Ring, cold_key
from tests.helpers import fresh_namespace, http_get, wait_for

pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.local_only]

MODEL = "tiny/llama"
START_S = 420  # two engines start side by side on a loaded 2-core machine
PREFIX_TOKENS = 320


@pytest.fixture
def gated_namespace(api):
    """Pods stay unready until their engine answers /health (the fleet says so)."""
    with fresh_namespace(api, f"gated-route-{uuid.uuid4().hex[:6]}") as name:
        yield name


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _post(url: str, tokens: list[int]) -> int:
    body = json.dumps({"model": MODEL, "prompt": tokens, "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _series(url: str) -> list[tuple[str, dict[str, str], float]]:
    status, text = http_get(f"{url}/metrics")
    assert status == 200, text
    out = []
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m and not m.group(1).endswith("_created"):
            out.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")),
                        float(m.group(3))))
    return out


def _metric(url: str, name: str, **labels: str) -> float:
    return sum(v for n, got, v in _series(url)
               if n == name and all(got.get(k) == w for k, w in labels.items()))


def test_prefixes_follow_the_pods_events_and_a_killed_pod_is_forgotten(
        api, cluster, gated_namespace, tmp_path):
    ns = gated_namespace
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    config = llama_config(num_layers=2)
    model_dir = write_model(tmp_path / "llama", config)
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="llama"), data={"config.json": json.dumps(config)}))
    custom.create_namespaced_custom_object("spillway.dev", "v1alpha1", ns,
                                           "inferencedeployments", {
        "apiVersion": "spillway.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "chat"},
        "spec": {"model": {"name": MODEL, "configMapRef": {"name": "llama"}}, "replicas": 2,
                 "engine": {"maxModelLen": 1024,
                            "emulateGPU": {"speed": 0, "kvBytes": 80 * 4096}},
                 "offload": {"hostMemory": "16Mi"}}})  # fmt: skip
    router = None
    gateways: list[Envoy] = []
    with SimulatorFleet(api, ns, "chat", engine="emulated",
                        model_dirs={MODEL: model_dir}) as fleet:
        try:
            wait_for(lambda: len(fleet.urls()) == 2, START_S, "two engines on their pod IPs",
                     interval=1, on_timeout=lambda: {p: fleet.log_text(p)[-1500:]
                                                     for p in fleet.sims})
            pods = {p.metadata.name: p for p in core.list_namespaced_pod(ns).items}
            assert len(pods) == 2
            for name, pod in pods.items():
                assert pod.metadata.annotations["spillway.dev/kv-events"] == "on"
                # each publisher is bound on its own pod IP at the declared port (no clash
                # on this one host)
                ip = fleet.sims[name].ip
                sources = json.loads(http_get(f"http://{ip}:{ENGINE_PORT}/kv_event_sources")[1])
                assert sources["0"]["endpoint"] == f"tcp://[::ffff:{ip}]:5557"
                assert sources["0"]["topic"] == f"kv@{ip}:{ENGINE_PORT}@{MODEL}"
                [engine] = pod.spec.containers
                assert {(p.name, p.container_port) for p in engine.ports} >= {("kv-events", 5557)}

            port, epp_port = free_port(), free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [str(Path(sys.executable).with_name("spillway-router")), "--host",
                   "127.0.0.1", "--port", str(port), "--kube-namespace", ns,
                   "--probe-interval", "0.5", "--log-level", "INFO",
                   "--epp-port", str(epp_port)]
            log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 (the process holds it)
            router = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "KUBECONFIG": str(cluster.config.kubeconfig)})

            def router_log() -> str:
                return (tmp_path / "router.log").read_text(errors="replace")[-3000:]

            def ready() -> bool:
                try:
                    return json.loads(http_get(f"{url}/healthz")[1])["ready_pods"] == {MODEL: 2}
                except (OSError, ValueError, KeyError):
                    return False

            wait_for(ready, 60, "the router to see both pods", interval=0.5,
                     on_timeout=router_log)
            # the router follows each pod's events once it has found them: a fresh
            # prompt on each pod, until a batch of its events reached the router
            direct = {name: f"http://{fleet.sims[name].ip}:{ENGINE_PORT}" for name in pods}
            seeds = iter(range(10_000, 20_000))
            for name in pods:
                def followed(name: str = name) -> bool:
                    if _metric(url, "spillway_router_event_batches_total", pod=name) > 0:
                        return True
                    assert _post(direct[name], _tokens(next(seeds), 32)) == 200
                    return False

                wait_for(followed, 60, f"{name}'s KV events at the router", interval=0.5,
                         on_timeout=router_log)

            # a prefix the router's ring would send to one pod, put on the other
            unit = json.loads(core.read_namespaced_config_map(
                "chat-plan", ns).data["plan.json"])["tokens_per_hash"]
            hasher, ring = BlockHasher(HashConfig(unit)), Ring(sorted(pods))
            other, holder = sorted(pods)

            def cold(seed: int) -> str:
                return next(ring.walk(cold_key(hasher.keys(_tokens(seed, PREFIX_TOKENS)), [])))

            seed = next(s for s in range(100, 400) if cold(s) == other)
            shared = _tokens(seed, PREFIX_TOKENS)
            assert _post(direct[holder], shared) == 200
            wait_for(lambda: _metric(url, "spillway_router_index_blocks", pod=holder,
                                     source="events") >= PREFIX_TOKENS // unit,
                     30, "the holder's events in the router's index", interval=0.5)

            hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
            before = {n: (_metric(u, hits), _metric(u, queries)) for n, u in direct.items()}
            for i in range(4):
                assert _post(url, shared + _tokens(900 + i, 24)) == 200
            after = {n: (_metric(u, hits), _metric(u, queries)) for n, u in direct.items()}
            # each request found the shared prefix on the holder; the other was not asked
            assert after[holder][0] - before[holder][0] >= 4 * (PREFIX_TOKENS - unit)
            assert after[other] == before[other]
            assert _metric(url, "spillway_router_requests_total", pod=holder,
                           reason="prefix") == 4

            # the same through Envoy, the router process as its endpoint picker
            for mode in ("FailOpen", "FailClose"):
                gateways.append(Envoy(GatewayConfig(
                    picker=f"127.0.0.1:{epp_port}", port=free_port(), admin_port=free_port(),
                    endpoints=[f"{fleet.sims[n].ip}:{ENGINE_PORT}" for n in sorted(pods)],
                    failure_mode=mode), tmp_path / f"envoy-{mode}").start())
            fail_open, fail_closed = gateways
            for i, gateway in enumerate(gateways * 2):
                assert _post(gateway.url, shared + _tokens(920 + i, 24)) == 200
            gateway_after = {n: (_metric(u, hits), _metric(u, queries))
                             for n, u in direct.items()}
            assert gateway_after[holder][0] - after[holder][0] >= 4 * (PREFIX_TOKENS - unit)
            assert gateway_after[other] == after[other]
            assert _metric(url, "spillway_router_requests_total", pod=holder,
                           reason="prefix") == 8
            stream = urllib.request.Request(
                f"{fail_open.url}/v1/completions", json.dumps(
                    {"model": MODEL, "prompt": shared, "max_tokens": 8, "stream": True}
                ).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(stream, timeout=120) as r:
                kind = r.headers.get("Content-Type", "")
                events = [line for line in r if line.startswith(b"data: ")]
            # Server-sent events through the gateway, ended by [DONE]. How many chunks
            # carry the 8 tokens is vLLM's: on a loaded machine its output loop merges
            # tokens that arrive while it is busy (once, all 8 in one chunk).
            assert kind.startswith("text/event-stream"), kind
            assert events[-1].strip() == b"data: [DONE]" and len(events) >= 2
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            assert {c["object"] for c in chunks} == {"text_completion"}
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

            # the holder's engine is SIGKILLed in the middle of a run of such requests
            statuses: list[int] = []
            killed = threading.Event()

            def run() -> None:
                for i in range(12):
                    if i == 3:
                        os.killpg(fleet.sims[holder].proc.pid, signal.SIGKILL)
                        killed.set()
                    statuses.append(_post(url, shared + _tokens(950 + i, 24)))

            queries_before = _metric(direct[other], queries)
            runner = threading.Thread(target=run)
            runner.start()
            runner.join(300)
            assert killed.is_set() and len(statuses) == 12
            # every request was answered: those after the kill by the other pod
            assert statuses == [200] * 12, statuses
            assert _metric(direct[other], queries) > queries_before
            # and the router forgets the dead pod and what it held
            wait_for(lambda: _metric(url, "spillway_router_index_blocks", pod=holder) == 0,
                     60, "the router to forget the killed pod's blocks", interval=0.5,
                     on_timeout=router_log)
            wait_for(lambda: json.loads(http_get(f"{url}/healthz")[1])["ready_pods"] == {MODEL: 1},
                     60, "the router to list one ready pod", interval=0.5,
                     on_timeout=router_log)
            # the survivor's own events now place the shared prefix there
            wait_for(lambda: _metric(url, "spillway_router_index_blocks", pod=other,
                                     source="events") >= PREFIX_TOKENS // unit,
                     30, "the survivor's events", interval=0.5)

            # the picker (the router process) goes: fail open keeps answering, on the
            # survivor (round robin; the dead pod's refusals retried); fail closed, 503
            kill_group(router)
            router = None
            assert [_post(fail_open.url, _tokens(970 + i, 24)) for i in range(4)] == [200] * 4
            assert _post(fail_closed.url, _tokens(980, 24)) == 503
        finally:
            for gateway in gateways:
                gateway.stop()
            if router is not None:
                kill_group(router)
