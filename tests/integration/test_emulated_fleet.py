"""The whole path on the local control plane with vLLM's real server in every pod.

``InferenceDeployment`` -> operator -> plan ConfigMap + Deployment -> KWOK pods with
loopback IPs -> on each pod's IP, ``spillway-engine serve --emulate-gpu`` (the pod's
own entry point: vLLM 0.33's API server, engine core, scheduler, KV-cache manager,
Spillway's plan check and offloader; only the GPU is emulated, see
``spillway_engine.emulator``). The fleet plays the kubelet: it starts the engine with
the plan the ConfigMap holds, marks the pod ready when ``/health`` answers, and
records a non-zero exit and its termination message in the pod's status.

Two tiny models with two KV-cache groups of different kinds each: a Gemma-3-style
sliding-window + full attention model and a Qwen3-Next-style Gated DeltaNet hybrid.
Each runs as two replicas with a host tier and one replica without; a prompt pushed
out of the emulated GPU comes back from the host tier with the same greedy tokens as
a fresh prefill on the replica without one, and the emulator finds no page that
differs from recomputation.
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request
import uuid
from typing import Any

import pytest
from kubernetes import client

from e2e.simfleet import SimulatorFleet
from spillway_engine.emulator.tiny import gemma3_config, qwen3_next_config, write_model
from spillway_engine.planner.plan import make_plan
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION, InferenceDeploymentSpec
from tests.helpers import fresh_namespace, wait_for

pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.local_only]

MAX_MODEL_LEN = 1024
PROMPT_TOKENS = 600
START_S = 420  # engines start in about a minute each; several share two cores in CI
#: name -> (config.json, emulated GPU KV blocks: room for a little more than one
#: max_model_len sequence, so a few long prompts push others out of the GPU cache,
#: and how many prompts it takes to push one out entirely)
MODELS: dict[str, tuple[dict[str, Any], int, int]] = {
    "swa": (gemma3_config(num_layers=4, sliding_window=64), 80, 5),
    "gdn": (qwen3_next_config(num_layers=4), 24, 8),
}


@pytest.fixture
def gated_namespace(api):
    """Pods stay unready until their engine answers /health (the fleet says so)."""
    with fresh_namespace(api, f"gated-emu-{uuid.uuid4().hex[:6]}") as name:
        yield name


def _spec(model: str, replicas: int, kv_bytes: int, **offload: Any) -> dict[str, Any]:
    return {
        "model": {"name": f"tiny/{model}", "configMapRef": {"name": model}},
        "replicas": replicas,
        "engine": {"maxModelLen": MAX_MODEL_LEN,
                   "emulateGPU": {"speed": 0, "kvBytes": kv_bytes}},
        "offload": {"hostMemory": "16Mi", **offload},
    }


def _kv_bytes(config: dict[str, Any], blocks: int) -> int:
    plan = make_plan(config, InferenceDeploymentSpec.model_validate(
        _spec("x", 1, 1 << 20)).plan_request())
    return blocks * sum(g.bytes_per_block for g in plan.kv_groups)


def _create(custom, ns: str, name: str, spec: dict[str, Any]) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
        "metadata": {"name": name}, "spec": spec})


def _obj(custom, ns: str, name: str) -> dict[str, Any]:
    return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def _condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == ctype),
                None)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]


def _complete(url: str, model: str, tokens: list[int], max_tokens: int = 8) -> list[int]:
    body = json.dumps({"model": model, "prompt": tokens, "max_tokens": max_tokens,
                       "temperature": 0, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return choice["token_ids"]


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m and not m.group(1).endswith("_created"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _metrics(url: str) -> dict[str, float]:
    """``/metrics`` once it is settled: the engine core sends a step's stats (the
    connector's transfer counters among them) after the reply, so read until two
    scrapes half a second apart agree."""
    last = _scrape(url)
    for _ in range(20):
        time.sleep(0.5)
        now = _scrape(url)
        if now == last:
            return now
        last = now
    return last


def _ready(custom, ns: str, name: str, replicas: int, fleet: SimulatorFleet) -> None:
    def state() -> str:
        obj = _obj(custom, ns, name)
        logs = {pod: fleet.log_text(pod)[-1500:] for pod in fleet.sims}
        return f"{obj.get('status')}; engine logs: {logs}"

    wait_for(lambda: _obj(custom, ns, name).get("status", {}).get("readyReplicas") == replicas
             and len(fleet.urls()) == replicas, START_S,
             f"{replicas} emulated engine(s) of {name} to serve", interval=1, on_timeout=state)


@pytest.mark.parametrize("model", list(MODELS))
def test_replicas_serve_from_the_host_tier_with_the_tokens_of_recomputation(
        api, gated_namespace, tmp_path, model):
    ns, (config, blocks, pushes) = gated_namespace, MODELS[model]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    model_dir = write_model(tmp_path / model, config)
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=model), data={"config.json": json.dumps(config)}))
    kv_bytes = _kv_bytes(config, blocks)
    _create(custom, ns, "host", _spec(model, 2, kv_bytes))
    _create(custom, ns, "plain", _spec(model, 1, kv_bytes, enabled=False))
    dirs = {f"tiny/{model}": model_dir}
    with (SimulatorFleet(api, ns, "host", engine="emulated", model_dirs=dirs) as host,
          SimulatorFleet(api, ns, "plain", engine="emulated", model_dirs=dirs) as plain):
        _ready(custom, ns, "host", 2, host)
        _ready(custom, ns, "plain", 1, plain)
        for pod in (*host.sims, *plain.sims):
            log = (host.sims.get(pod) or plain.sims[pod]).log.read_text(errors="replace")
            assert "Spillway plan check passed" in log, pod
            assert "Emulated GPU h100" in log, pod
        [reference] = plain.urls()
        served = f"tiny/{model}"
        a = _prompt(1)
        expected = _complete(reference, served, a)
        for i, url in enumerate(host.urls()):
            assert _complete(url, served, a) == expected, url
            for seed in range(10 + 10 * i, 10 + 10 * i + pushes):  # push a out of the GPU
                _complete(url, served, _prompt(seed), max_tokens=2)
            before = _metrics(url)
            again = _complete(url, served, a)
            after = _metrics(url)
            hit = "spillway_host_hit_tokens_total"
            hits = after[hit] - before[hit]
            assert hits >= 256, f"{url}: {hits} host-hit tokens"
            loaded = "vllm:kv_offload_load_bytes_total"
            assert after.get(loaded, 0) > before.get(loaded, 0), sorted(after)
            assert again == expected, url
            assert after["spillway_emulator_kv_mismatch_total"] == 0
            assert after["spillway_host_pool_used_chunks"] <= after[
                "spillway_host_pool_capacity_chunks"]
        plain_metrics = _metrics(reference)
        assert "spillway_host_hit_tokens_total" not in plain_metrics or \
            plain_metrics["spillway_host_hit_tokens_total"] == 0


def test_a_pod_with_a_wrong_plan_exits_and_the_deployment_says_why(
        api, gated_namespace, tmp_path):
    """The kubelet (the fleet) starts the engine with a plan sized for twice the host
    pool the engine is told to run: the plan check refuses, the engine exits non-zero
    with the side-by-side table as its termination message, and the operator turns
    that into Degraded=True, reason EngineStartFailed."""
    ns, (config, blocks, _) = gated_namespace, MODELS["swa"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    model_dir = write_model(tmp_path / "swa", config)
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="swa"), data={"config.json": json.dumps(config)}))
    spec = _spec("swa", 1, _kv_bytes(config, blocks))
    _create(custom, ns, "stale", spec)
    request = InferenceDeploymentSpec.model_validate(spec).plan_request()
    bigger = request.model_copy(update={"cpu_memory_bytes": 2 * request.cpu_memory_bytes})
    stale = json.loads(make_plan(config, bigger).model_dump_json())

    def stale_plan(good: dict[str, Any]) -> dict[str, Any]:
        return {**stale, "kv_transfer_config": good["kv_transfer_config"]}

    with SimulatorFleet(api, ns, "stale", engine="emulated", model_dirs={"tiny/swa": model_dir},
                        plan_edit=stale_plan) as fleet:
        def degraded() -> dict[str, Any] | None:
            cond = _condition(_obj(custom, ns, "stale"), "Degraded")
            return cond if cond and cond["reason"] == "EngineStartFailed" else None

        cond = wait_for(degraded, START_S, "Degraded=EngineStartFailed", interval=1,
                        on_timeout=lambda: (_obj(custom, ns, "stale").get("status"),
                                            [fleet.log_text(p)[-2000:] for p in fleet.sims]))
        assert cond["status"] == "True"
        assert "Spillway plan check FAILED" in cond["message"]
        assert re.search(r"cpu_bytes_to_use\s+\|\s+\d+\s+\|\s+\d+", cond["message"])
        [pod] = core.list_namespaced_pod(ns, label_selector="spillway.dev/inference-deployment"
                                         "=stale").items
        last = pod.status.container_statuses[0].last_state.terminated
        assert last.exit_code != 0
        assert last.message.startswith("Spillway plan check FAILED")
        events = core.list_namespaced_event(ns, field_selector="reason=EngineStartFailed").items
        assert events, "no EngineStartFailed event"
