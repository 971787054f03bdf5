"""The Gateway API Inference Extension's own endpoint picker (GIE v1.2.0's ``cmd/epp``, as
tools/build.sh builds it) behind a real Envoy, in front of engine simulator processes:
client -> Envoy -> ext_proc (gRPC, FULL_DUPLEX_STREAMED) -> GIE's picker, which reads
its InferencePool and pods from a real kube-apiserver (e2e/gateway/gie.py) and scrapes
the engines' vLLM metrics; Envoy -> the engine it names.

This is the baseline bench/routing.py --gateway measures Spillway's picker against
("gateway + GIE EPP"). The binary missing fails these tests (CI builds it first).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.engine_process import kill_group
from e2e.gateway import Envoy
from e2e.gateway.gie import GiePicker, gateway_config, picker_binary, pod_addresses
from tests.helpers import http_get, wait_for
from tests.unit.simulator_support import LLAMA, PLANS

MODEL = "m"


@dataclass
class Stack:
    picker: GiePicker
    envoy: Envoy
    engines: list[str]  # ip:port, a pod IP each


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gie")
    addresses = pod_addresses(2)
    sims: list[subprocess.Popen] = []
    picker = envoy = None
    try:
        for i, address in enumerate(addresses):
            host, port = address.rsplit(":", 1)
            sims.append(subprocess.Popen(
                [sys.executable, "-m", "spillway_engine.simulator", "--plan",
                 str(PLANS / LLAMA), "--host", host, "--port", port, "--speed", "1",
                 "--served-model-name", MODEL],
                stdout=(tmp / f"engine-{i}.log").open("wb"), stderr=subprocess.STDOUT,
                start_new_session=True))
        for a in addresses:
            wait_for(lambda a=a: http_get(f"http://{a}/health")[0] == 200, 60, f"engine {a}")
        picker = GiePicker(tmp, addresses).start()
        envoy = Envoy(gateway_config(picker.picker, addresses), tmp / "envoy").start()
        yield Stack(picker, envoy, addresses)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        for proc in sims:
            kill_group(proc)


def _post(url: str, body: dict) -> tuple[int, dict, dict[str, str]]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:  # GIE's own refusals are plain text
        text = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(text), dict(e.headers)
        except ValueError:
            return e.code, {"text": text}, dict(e.headers)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"x{rng.randrange(10**6)}" for _ in range(n))


def _chat(url: str, text: str, **extra) -> tuple[int, dict, dict[str, str]]:
    return _post(url + "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": text}], **extra})


def test_the_picker_is_built_and_lists_the_pools_pods(stack):
    assert picker_binary().is_file()
    # the pods it read from the API server, and metrics scraped from each engine
    assert sorted(stack.picker.pods()) == ["engine-0-rank-0", "engine-1-rank-0"]


def test_envoy_routes_through_gies_picker_to_an_engine_and_a_prefix_sticks(stack):
    shared = _words(1, 600)
    upstreams = []
    for i in range(5):
        status, reply, headers = _chat(stack.envoy.url, f"{shared} {_words(10 + i, 8)}")
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"]
        upstreams.append(headers["x-spillway-upstream"])
        if i:  # GIE's prefix scorer sent it back where the 600 words were cached
            assert reply["spillway"]["cached_tokens_device"] >= 592, reply["spillway"]
    assert set(upstreams) <= set(stack.engines) and len(set(upstreams)) == 1, upstreams

    # streamed, end to end, the response body passing through the picker (full duplex)
    req = urllib.request.Request(
        stack.envoy.url + "/v1/completions",
        json.dumps({"model": MODEL, "prompt": _words(2, 64), "max_tokens": 8,
                    "stream": True}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:].strip() for line in r if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) >= 9


def test_gies_picker_refuses_a_completion_of_token_ids(stack):
    # GIE v1.2.0 reads `prompt` as a string: token ids are a bad request to it, so
    # bench/routing.py sends it the trace as chat messages
    status, reply, _ = _post(stack.envoy.url + "/v1/completions",
                             {"model": MODEL, "prompt": [17, 18, 19, 20], "max_tokens": 2})
    assert status == 400, reply
    assert "chat-completions request must have at least one message" in reply["text"]
    # the engine itself takes them
    status, reply, _ = _post(f"http://{stack.engines[0]}/v1/completions",
                             {"model": MODEL, "prompt": [17, 18, 19, 20], "max_tokens": 2})
    assert status == 200, reply


def test_the_picker_missing_is_an_error_naming_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tools/build\.sh"):
        picker_binary(Path(tmp_path))
