"""A stopping pod drops no request: vLLM 0.33.0's real server on the emulated GPU, stopped
as the kubelet stops a pod -- the preStop command (``spillway-engine drain``), then
SIGTERM to the container's first process (vLLM's API server, which the launcher exec'd).

A stream in flight when the drain starts completes (every token, finish_reason
``length``); the readiness path fails at once; a new request after the accept window
is refused with 503 (never vLLM's silent empty ``abort`` answer); the drain returns
once the stream has ended, and SIGTERM then stops vLLM cleanly."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from e2e.engine_process import (
    ENGINE,
    EXIT_TIMEOUT_S,
    Server,
    engine_env,
    free_port,
    get,
    kill_group,
    plan_for,
    wait_ready,
    write_plan,
)
from spillway_engine.emulator.tiny import llama_config, write_model

KV_BYTES = 80 * 4096
MAX_TOKENS = 48
# Modelled step times of a 70B model, slowed: a few tokens a second, so the stream is
# still running when the drain starts (the figure is not asserted).
SLOW = ["--emulate-speed", "1", "--emulate-model-params", "70e9"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("drain")
    model = write_model(root / "llama", llama_config(num_layers=2))
    plan = plan_for(model)
    plan_path = write_plan(root, plan, model)
    port, log = free_port(), root / "engine.log"
    (root / "shm").mkdir()
    cmd = [*ENGINE, "serve", "--plan", str(plan_path), "--host", "127.0.0.1", "--port",
           str(port), "--emulate-gpu", "--emulate-kv-bytes", str(KV_BYTES), *SLOW,
           "--kv-events-port", str(free_port())]
    env = engine_env({"SPILLWAY_SHM_DIR": str(root / "shm"),
                      "SPILLWAY_TERMINATION_LOG": str(root / "termination-log")})
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    srv = Server("llama", proc, port, log, plan, 0.0)
    try:
        wait_ready(srv)
        yield srv
    finally:
        kill_group(proc)


def stream(port: int, out: dict) -> None:
    """One streaming completion; records its chunks, finish reason and [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        out["status"], out["tokens"] = resp.status, 0
        for line in resp:
            data = line.strip().removeprefix(b"data:").strip()
            if not line.startswith(b"data:"):
                continue
            if data == b"[DONE]":
                out["done"] = True
                break
            chunk = json.loads(data)
            if "choices" not in chunk:  # an error event instead of tokens
                out["error"] = chunk
                break
            choice = chunk["choices"][0]
            out["tokens"] += 1
            out["finish"] = choice.get("finish_reason") or out.get("finish")
    except OSError as exc:
        out["error"] = repr(exc)


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def test_prestop_drain_finishes_the_stream_and_refuses_new_requests(server: Server):
    assert get(server.url("/spillway/ready"))[0] == 200
    out: dict = {}
    client = threading.Thread(target=stream, args=(server.port, out))
    client.start()
    deadline = time.monotonic() + 120
    while not out.get("tokens") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.get("tokens"), out

    # The kubelet's preStop: the pod's own command, over loopback.
    prestop = subprocess.Popen(
        [*ENGINE, "drain", "--port", str(server.port), "--timeout", "240",
         "--accept-seconds", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=engine_env())
    deadline = time.monotonic() + 60
    while get(server.url("/spillway/ready"))[0] != 503 and time.monotonic() < deadline:
        time.sleep(0.05)  # the drain has started: readiness fails at once
    assert get(server.url("/spillway/ready"))[0] == 503
    time.sleep(1.5)  # past the accept window
    assert prestop.poll() is None, "the drain returned while a stream was in flight"
    assert out.get("finish") is None, "the stream ended before the drain began: too fast"
    assert get(server.url("/health"))[0] == 200  # alive: liveness must not kill it
    status, answer = post(server.port, "/v1/completions",
                          {"model": "tiny", "prompt": [9, 9], "max_tokens": 4})
    assert status == 503 and "draining" in answer["error"]["message"]

    said = prestop.communicate(timeout=300)[0].decode()
    assert prestop.returncode == 0, said
    client.join(60)
    assert out == {"status": 200, "tokens": out["tokens"], "finish": "length",
                   "done": True}, out
    state = json.loads(get(server.url("/spillway/drain"))[1])
    assert state == {"draining": True, "in_flight": 0, "refused": 1}

    # SIGTERM to the container's first process: vLLM stops with nothing to abort.
    os.kill(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(EXIT_TIMEOUT_S) == 0, server.log_text()[-3000:]
    assert "aborting in-flight requests" not in server.log_text()
    print(f"\nstream of {out['tokens']} chunks completed across the drain; "
          f"{state['refused']} new request refused", file=sys.stderr)

