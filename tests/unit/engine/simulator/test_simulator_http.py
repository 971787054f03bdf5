"""The simulator over real HTTP on 127.0.0.1, and its command line."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spillway_cli.loadgen import TraceSpec, generate_trace, run_load, summarize
from spillway_engine.simulator.__main__ import simulate_main
from tests.helpers import wait_for
from tests.unit.simulator_support import LLAMA, PLANS, plan_dict

SPEED = 5.0  # the 2-core test machine keeps up at 10 req/s x 5 = 50 req/s wall


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read().decode()


def http_post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start_simulator(plan_path, *extra: str):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spillway_engine.simulator",
            "--plan",
            str(plan_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--speed",
            str(SPEED),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    base = f"http://127.0.0.1:{port}"

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"simulator exited: {proc.stderr.read().decode()}")
        try:
            return http_get(base + "/health")[0] == 200
        except OSError:
            return False

    wait_for(healthy, 30, "simulator /health")
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(http_get(base + "/metrics")[1]):
        for s in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            )
            out[(s.name, labels)] = s.value
    return out


@pytest.fixture(scope="module")
def simulator():
    proc, base = start_simulator(PLANS / LLAMA, "--gpu-kv-tokens", "4096", "--seed", "1")
    yield base
    stop(proc)


def test_openai_endpoints(simulator):
    status, body = http_get(simulator + "/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == "meta-llama/Llama-3.2-1B"
    status, out = http_post(
        simulator + "/v1/completions", {"prompt": "a b c d e f", "max_tokens": 3}
    )
    assert status == 200
    assert out["usage"]["prompt_tokens"] == 6 and out["usage"]["completion_tokens"] == 3
    assert len(out["choices"][0]["text"].split()) == 3
    status, out = http_post(
        simulator + "/v1/completions", {"prompt": list(range(100, 140)), "max_tokens": 2}
    )
    assert status == 200 and out["usage"]["prompt_tokens"] == 40
    messages = [
        {"role": "system", "content": " ".join(["s"] * 200)},
        {"role": "user", "content": "hello"},
    ]
    first = http_post(simulator + "/v1/chat/completions", {"messages": messages, "max_tokens": 2})[
        1
    ]
    second = http_post(simulator + "/v1/chat/completions", {"messages": messages, "max_tokens": 2})[
        1
    ]
    assert first["choices"][0]["message"]["role"] == "assistant"
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 206
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    status, err = http_post(simulator + "/v1/completions", {"prompt": 5})
    assert status == 400 and err["object"] == "error"
    status, err = http_post(simulator + "/v1/completions", {"prompt": "x", "model": "nope"})
    assert status == 404
    status, err = http_post(simulator + "/v1/completions", {"prompt": "x", "max_tokens": 10**6})
    assert status == 400 and "maximum context length" in err["message"]


def test_completion_stream(simulator):
    req = urllib.request.Request(
        simulator + "/v1/completions",
        data=json.dumps({"prompt": "one two three", "max_tokens": 4, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.read().decode().splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert chunks[-1]["spillway"]["ttft_s"] > 0
    assert len("".join(c["choices"][0]["text"] for c in chunks).split()) == 4


def test_loadgen_traffic_over_http_hits_the_host_pool(simulator):
    # 8 shared 1,024-word system prompts: more than the 4,096-token GPU, far less than
    # the host pool (262,144 tokens).
    spec = TraceSpec(
        kind="shared-prefix",
        rate=10,
        num_requests=60,
        duration=None,
        prefixes=8,
        prefix_tokens=1024,
        question_tokens=32,
        max_tokens=8,
        seed=5,
    )
    results, _ = asyncio.run(
        run_load(generate_trace(spec), [simulator], concurrency=32, timeout=30, time_scale=SPEED)
    )
    summary = summarize(results, 1.0)
    assert summary.errors == 0 and summary.ok == 60
    assert summary.completion_tokens == 60 * 8
    m = scrape(simulator)
    host = m[("vllm:prompt_tokens_cached_by_source_total", (("source", "host"),))]
    assert host > 0
    assert m[("vllm:kv_offload_load_bytes_total", ())] > 0
    assert m[("spillway_host_hit_tokens_total", ())] == host
    # TTFTs are reported (their size is a bench figure: under load the simulator's
    # real-time steps stretch, so no bound on them belongs in a test)
    assert summary.ttft_returned_p50 is not None
    assert summary.ttft_measured_p50 is not None
    assert m[("vllm:num_requests_running", ())] == 0


def test_working_set_beyond_gpu_and_host_over_http(tmp_path):
    plan = plan_dict(LLAMA, num_chunks=16, capacity_tokens=16 * 256)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    proc, base = start_simulator(path, "--gpu-kv-tokens", "4096")
    try:
        spec = TraceSpec(
            kind="shared-prefix",
            rate=10,
            num_requests=60,
            duration=None,
            prefixes=12,
            prefix_tokens=1024,
            question_tokens=32,
            max_tokens=4,
            seed=5,
        )
        results, _ = asyncio.run(
            run_load(generate_trace(spec), [base], concurrency=32, timeout=30, time_scale=SPEED)
        )
        assert all(r.ok for r in results)
        m = scrape(base)
    finally:
        stop(proc)
    assert m[("spillway_host_pool_evictions_total", ())] > 0
    assert m[("spillway_host_pool_thrash_total", ())] > 0
    assert m[("spillway_host_pool_used_chunks", ())] == 16
    assert m[("spillway_host_pool_capacity_chunks", ())] == 16
    computed = m[("vllm:prompt_tokens_by_source_total", (("source", "local_compute"),))]
    assert computed > 0.5 * m[("vllm:prompt_tokens_total", ())]


# --------------------------------------------------------------------------- CLI


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = simulate_main(list(argv))
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plan", "/nonexistent/plan.json"], "cannot read plan file"),
        (["--plan", str(PLANS / LLAMA), "--host", "10.0.0.1"], "127.0.0.0/8"),
        (["--plan", str(PLANS / LLAMA), "--host", "localhost"], "127.0.0.0/8"),
        (["--plan", str(PLANS / LLAMA), "--host", "::1"], "127.0.0.0/8"),
        (["--plan", str(PLANS / LLAMA), "--port", "70000"], "--port"),
        (["--plan", str(PLANS / LLAMA), "--gpu-kv-blocks", "0"], "--gpu-kv-blocks"),
        (["--plan", str(PLANS / LLAMA), "--speed", "-1"], "--speed"),
        (
            ["--plan", str(PLANS / LLAMA), "--gpu-kv-blocks", "5", "--gpu-kv-tokens", "9"],
            "not allowed",
        ),
        (["--port", "8000"], "--plan"),
        (["--plan", str(PLANS / LLAMA), "--bogus"], "unrecognized"),
    ],
)
def test_cli_usage_errors_are_one_line_and_status_2(capsys, args, message):
    code, err = run_cli(capsys, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ("[]", "JSON object"),
        ("{}", "kv_groups"),
        (json.dumps(plan_dict(LLAMA, tokens_per_hash=7)), "hash unit"),
        (json.dumps(plan_dict(LLAMA, num_chunks="many")), "num_chunks"),
        (json.dumps({**plan_dict(LLAMA), "kv_groups": [{"kind": "weird"}]}), "kv_groups[0].kind"),
    ],
)
def test_bad_plan_files(tmp_path, capsys, content, message):
    path = tmp_path / "plan.json"
    path.write_text(content)
    code, err = run_cli(capsys, "--plan", str(path))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err


def test_port_in_use(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, err = run_cli(capsys, "--plan", str(PLANS / LLAMA), "--port", str(port))
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err
    assert len(err.strip().splitlines()) == 1
