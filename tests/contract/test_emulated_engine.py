"""The whole engine a Spillway pod runs, on an emulated GPU (spillway_engine.emulator).

``spillway-engine serve`` -> vLLM 0.33.0's real OpenAI server -> engine core ->
scheduler, KV-cache manager, prefix cache, Spillway's plugin (plan check, metrics) and
``SpillwayOffloadingConnector`` (both sides, real bytes). Only the GPU is emulated: the
worker builds the model on the meta device, keeps KV caches in CPU tensors and answers
each step with tokens derived from the KV bytes it reads. One server per model,
shared by the assertions (start-up is about a minute of imports here).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spillway_engine.emulator import emulator_args, emulator_env
from spillway_engine.emulator.tiny import llama_config, write_model
from spillway_engine.planner.plan import Plan, PlanRequest, make_plan

MIB = 1 << 20
MAX_MODEL_LEN = 1024
POOL_BYTES = 16 * MIB
#: Emulated GPU KV memory: 80 blocks of the tiny Llama (4096 bytes a block), enough
#: for max_model_len (64 blocks) and small enough that a few prompts evict each other.
KV_BYTES = 80 * 4096
START_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 60
# The pod's entry point (the console script of this environment).
_SCRIPT = Path(sys.executable).with_name("spillway-engine")
ENGINE = (
    [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "spillway_engine.launcher.serve"]
)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    plan: Plan
    startup_s: float

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(kv_bytes: int) -> dict[str, str]:
    env = dict(os.environ)
    # The contract harness sets these for in-process planning; the server must pick
    # its platform itself (Spillway's plug-in) and log the plan check.
    env.pop("VLLM_TARGET_DEVICE", None)
    env.update(emulator_env(kv_bytes))
    env.update(VLLM_LOGGING_LEVEL="INFO", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _plan(model_dir: Path, **kw: Any) -> Plan:
    config = json.loads((model_dir / "config.json").read_text())
    kw.setdefault("cpu_memory_bytes", POOL_BYTES)
    return make_plan(
        config,
        PlanRequest(model_name=str(model_dir), gpu="h100", max_model_len=MAX_MODEL_LEN, **kw),
    )


def _write_plan(root: Path, plan: dict[str, Any] | Plan, model_dir: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    text = plan.model_dump_json(indent=1) if isinstance(plan, Plan) else json.dumps(plan)
    (root / "plan.json").write_text(text)
    (root / "engine.json").write_text(
        json.dumps({"model": str(model_dir), "served_model_name": "tiny"})
    )
    return root / "plan.json"


def _launch(plan_path: Path, log: Path, port: int) -> subprocess.Popen[bytes]:
    """``spillway-engine serve`` as the pod runs it, plus the emulator's flag; its own
    process group, so teardown reaches the engine core too."""
    cmd = [*ENGINE, "serve", "--plan", str(plan_path), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--", *emulator_args()]
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(KV_BYTES),
            start_new_session=True,
        )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        # the group may outlive its leader (the engine core): SIGKILL what is left
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return


def _rss_mib(pid: int) -> dict[str, float]:
    """RSS of ``pid`` and its children, by command name (for the record)."""
    out = {}
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        rss = re.search(r"VmRSS:\s+(\d+) kB", status)
        if rss:
            out[f"{p}:{Path(cmd).name}"] = int(rss.group(1)) / 1024
    return out


def _get(url: str, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(
                f"the engine exited ({server.proc.returncode}) before serving:\n"
                + server.log_text()[-6000:]
            )
        try:
            if _get(server.url("/health"), timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(
        f"the engine did not serve within {START_TIMEOUT_S} s:\n{server.log_text()[-6000:]}"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("emulated") / "tiny-llama", llama_config())


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    plan = _plan(model_dir)
    root = model_dir.parent / "good"
    plan_path = _write_plan(root, plan, model_dir)
    port = _free_port()
    t0 = time.monotonic()
    proc = _launch(plan_path, root / "engine.log", port)
    srv = Server(proc, port, root / "engine.log", plan, 0.0)
    try:
        _wait_ready(srv)
        srv.startup_s = time.monotonic() - t0
        print(
            f"\n[emulated engine] ready in {srv.startup_s:.1f} s; RSS MiB {_rss_mib(proc.pid)}",
            file=sys.stderr,
        )
        yield srv
    finally:
        _kill_group(proc)


# ------------------------------------------------------------------ the helpers


def metrics(server: Server) -> dict[str, float]:
    """``/metrics`` summed over label sets (``_created`` series dropped)."""
    status, text = _get(server.url("/metrics"))
    assert status == 200
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1).endswith("_created"):
            continue
        key = m.group(1)
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]  # 0-2 are the special tokens


def complete(server: Server, tokens: list[int], max_tokens: int = 8) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    return _post(server.url("/v1/completions"), body)


def output_ids(reply: dict[str, Any]) -> list[int]:
    choice = reply["choices"][0]
    return choice.get("token_ids") or choice["text"]


# -------------------------------------------------------------------- the tests


def test_plan_check_ran_and_passed(server: Server):
    log = server.log_text()
    assert "Spillway plan check passed: 1 KV-cache group(s), 16 tokens per hash" in log
    assert "FAILED" not in log
    # the emulated budget (SPILLWAY_EMULATE_KV_BYTES) is what vLLM sized the cache by
    assert re.search(r"KV cache size: 1,?280 tokens", log)


def test_completion_returns_tokens_from_the_kv_bytes(server: Server):
    tokens = prompt(1, 40)
    first = complete(server, tokens)
    assert first["usage"]["completion_tokens"] == 8
    assert first["usage"]["prompt_tokens"] == 40
    # deterministic: the same prefix writes the same signatures (now a prefix hit)
    assert output_ids(complete(server, tokens)) == output_ids(first)
    # and another prompt reads other signatures
    assert output_ids(complete(server, prompt(2, 40))) != output_ids(first)


def test_repeated_long_prompt_hits_the_prefix_cache(server: Server):
    tokens = prompt(3, 300)
    before = metrics(server)
    complete(server, tokens, max_tokens=2)
    complete(server, tokens, max_tokens=2)
    after = metrics(server)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits >= 288  # 18 full 16-token blocks of the repeat (the last token recomputes)


def test_prompt_evicted_from_the_gpu_comes_back_from_the_host_pool(server: Server):
    """A prompt pushed out of the 80-block GPU cache is loaded from Spillway's host
    pool, and the tokens derived from the loaded bytes equal the recomputed ones."""
    a = prompt(10, 600)
    first = complete(server, a)
    for seed in (11, 12, 13):  # 3 x 38 blocks push a's 38 blocks out of 79
        complete(server, prompt(seed, 600), max_tokens=2)
    before = metrics(server)
    again = complete(server, a)
    after = metrics(server)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vllm:external_prefix_cache_hits_total") >= 512  # two 256-token chunks
    assert delta("spillway_host_hit_tokens_total") >= 512
    assert delta("vllm:kv_offload_load_bytes_total") >= 512 * 4096 // 16  # real bytes moved
    assert output_ids(again) == output_ids(first)


def test_spillway_series_are_exported(server: Server):
    m = metrics(server)
    for name in (
        "spillway_plan_info",
        "spillway_host_pool_capacity_chunks",
        "spillway_host_pool_capacity_tokens",
        "spillway_host_pool_used_chunks",
        "spillway_host_pool_tokens",
        "spillway_host_lookup_tokens_total",
        "spillway_host_hit_tokens_total",
    ):
        assert name in m, name
    assert m["spillway_host_pool_capacity_chunks"] == server.plan.spillway.num_chunks
    assert m["spillway_host_pool_used_chunks"] > 0  # the earlier prompts were stored
    assert m["vllm:kv_offload_store_bytes_total"] > 0


def test_wrong_plan_stops_the_engine(model_dir: Path, server: Server):
    """A plan sized for another pool than the engine runs: the plan check refuses,
    and the whole server exits non-zero (no API server left behind)."""
    # Run after the good server's tests (module order), which are done with it now.
    _kill_group(server.proc)
    good = _plan(model_dir)
    stale = json.loads(_plan(model_dir, cpu_memory_bytes=2 * POOL_BYTES).model_dump_json())
    stale["kv_transfer_config"] = good.kv_transfer_config  # the engine runs the 16 MiB pool
    root = model_dir.parent / "stale"
    plan_path = _write_plan(root, stale, model_dir)
    proc = _launch(plan_path, root / "engine.log", _free_port())
    try:
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the engine kept running after a failed plan check:\n{root / 'engine.log'}")
    finally:
        _kill_group(proc)
    log = (root / "engine.log").read_text(errors="replace")
    assert rc != 0
    assert "Spillway plan check FAILED" in log
    assert re.search(rf"cpu_bytes_to_use\s+\|\s+{2 * POOL_BYTES}\s+\|\s+{POOL_BYTES}", log)
    assert re.search(r"spillway\.num_units\s+\|\s+\d+\s+\|\s+\d+", log)
