"""Launch, watch and stop ``spillway-engine serve --emulate-gpu`` as a real process.

Shared by the contract and integration tests (``tests/contract/test_emulated_engine.py``
and its neighbours) and the benches that run real engines (``bench/pod_memory.py``,
``bench/emulated_engine.py``, ``bench/disk_tier.py``), so it lives in the harness both
may import: a tiny model's plan on disk, the pod's launch in its own process group,
readiness over HTTP, a teardown that reaches the engine core too, and the few
requests the tests and benches send (a completion, ``/metrics`` summed).
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillway_engine.planner.plan import Plan, PlanRequest, make_plan

MIB = 1 << 20
MAX_MODEL_LEN = 1024
POOL_BYTES = 16 * MIB
START_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 60
#: vLLM's back-pressure water marks assume NVMe; fsynced chunks on a busy CI disk are
#: slower per MiB, and a shed store would leave nothing to load back
DISK_TIER_TUNING = json.dumps({"backpressure": {"backpressure_cls": "EMABackpressureDetector",
                                      "high_water_s": 1e6, "low_water_s": 1e5,
                                      "failure_threshold": 3}})
# The pod's entry point (the console script of this environment).
_SCRIPT = Path(sys.executable).with_name("spillway-engine")
ENGINE = (
    [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "spillway_engine.cli"]
)


class EngineNotReady(AssertionError):
    """The engine exited or did not serve in time; the message ends with its log."""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    plan: Plan
    startup_s: float

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The contract harness sets these for in-process planning; the server must pick
    # its platform itself (Spillway's plug-in) and log the plan check.
    env.pop("VLLM_TARGET_DEVICE", None)
    env.update(VLLM_LOGGING_LEVEL="INFO", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def plan_for(model_dir: Path, **kw: Any) -> Plan:
    config = json.loads((model_dir / "config.json").read_text())
    kw.setdefault("cpu_memory_bytes", POOL_BYTES)
    kw.setdefault("gpu", "h100")
    return make_plan(
        config, PlanRequest(model_name=str(model_dir), max_model_len=MAX_MODEL_LEN, **kw)
    )


def write_plan(root: Path, plan: dict[str, Any] | Plan, model_dir: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    text = plan.model_dump_json(indent=1) if isinstance(plan, Plan) else json.dumps(plan)
    (root / "plan.json").write_text(text)
    (root / "engine.json").write_text(
        json.dumps({"model": str(model_dir), "served_model_name": "tiny"})
    )
    return root / "plan.json"


def launch(
    plan_path: Path,
    log: Path,
    port: int,
    kv_bytes: int,
    *,
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
    serve_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``spillway-engine serve --emulate-gpu``: the pod's launch on the emulated GPU,
    with no step-time sleeping (speed 0) so the tests stay fast; its own process
    group, so teardown reaches the engine core too. ``prefix`` wraps the command (a
    mount namespace) and ``serve_args`` follow it; unless ``env`` names them, the shm
    folder the launcher frees and the termination log are private folders beside
    ``log``, never the machine's."""
    cmd = [*prefix, *ENGINE, "serve", "--plan", str(plan_path), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--emulate-gpu", "--emulate-speed", "0"]
    cmd += ["--emulate-kv-bytes", str(kv_bytes), *serve_args]
    if "--kv-events-port" not in serve_args:
        # engines here share 127.0.0.1: each publishes its KV events on a port of its own
        cmd += ["--kv-events-port", str(free_port())]
    private = {
        "SPILLWAY_SHM_DIR": str(log.parent / "shm"),
        "SPILLWAY_TERMINATION_LOG": str(log.parent / "termination-log"),
    }
    private.update(env or {})
    if private["SPILLWAY_SHM_DIR"] == str(log.parent / "shm"):
        (log.parent / "shm").mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=engine_env(private),
            start_new_session=True,
        )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
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


def sigkill_group(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGKILL the whole group at once (a crash: nothing gets to clean up) and wait
    until no process of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def group_pids(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def rss_mib(pid: int) -> dict[str, float]:
    """RSS of ``pid`` and its children, by command name (for the record)."""
    out = {}
    for p in group_pids(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        rss = re.search(r"VmRSS:\s+(\d+) kB", status)
        if rss:
            out[f"{p}:{Path(cmd).name}"] = int(rss.group(1)) / 1024
    return out


def get(url: str, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())


def wait_ready(server: Server) -> None:
    """Returns once /health answers 200; raises EngineNotReady with the log's tail."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise EngineNotReady(
                f"the engine exited ({server.proc.returncode}) before serving:\n"
                + server.log_text()[-6000:]
            )
        try:
            if get(server.url("/health"), timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise EngineNotReady(
        f"the engine did not serve within {START_TIMEOUT_S} s:\n{server.log_text()[-6000:]}"
    )


# ---------------------------------------------------------- talking to a server


def metrics(server: Server) -> dict[str, float]:
    """``/metrics`` summed over label sets (``_created`` series dropped)."""
    status, text = get(server.url("/metrics"))
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
    return post(server.url("/v1/completions"), body)


def output_ids(reply: dict[str, Any]) -> list[int]:
    choice = reply["choices"][0]
    return choice.get("token_ids") or choice["text"]
