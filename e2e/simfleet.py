"""Engine processes standing in for the containers of an InferenceDeployment's pods.

On the local control plane pods have loopback IPs and no containers. The fleet
watches the pods of one InferenceDeployment and, for each pod with an IP, starts an
engine bound to that IP on the engine port with the pod's plan and serving options
(read from the ``<name>-plan`` ConfigMap), and stops it when the pod goes. The
engine is either

* ``engine="emulated"``: the pod's own entry point, ``spillway-engine serve
  --emulate-gpu`` -- vLLM 0.33's real server, scheduler, KV-cache manager, plan
  check and Spillway's offloader on an emulated GPU. The model named in the
  serving options is served from a local directory (``model_dirs``: what an image
  with the model baked in would hold); or
* ``engine="simulator"``: ``spillway_engine.simulator`` (virtual-time benches and
  the quick scenarios that need dozens of pods).

In namespaces named ``gated-*`` KWOK keeps pods unready until the harness says
so; there the fleet plays the kubelet's probes: it marks the pod ready
(``spillway.dev/harness-ready=true``) once its emulated engine answers ``/health``
(a simulator: ``load_seconds`` after it started). An emulated engine that exits
non-zero is recorded in the pod's status as the kubelet records it: the container
waiting in ``CrashLoopBackOff`` with the exit code and its termination message in
``lastState``. Used by the integration tests and the local demo.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e import processes

ENGINE_PORT = 8000
READY_ANNOTATION = "spillway.dev/harness-ready"
ENGINE_CONTAINER = "engine"
# The pod's entry point (the console script of this environment).
_SERVE = Path(sys.executable).with_name("spillway-engine")


@dataclass
class _Sim:
    proc: subprocess.Popen
    ip: str
    started: float
    log: Path
    termination: Path | None = None
    exit_recorded: bool = False
    prestop: list[str] | None = None  # the engine container's preStop command


def _engine_args(pod: Any) -> list[str]:
    """The engine container's args (``serve`` flags) from the pod spec."""
    for c in pod.spec.containers or []:
        if c.name == ENGINE_CONTAINER:
            return list(c.args or [])
    return []


def _prestop(pod: Any) -> list[str] | None:
    """The engine container's preStop exec command, if any."""
    for c in pod.spec.containers or []:
        hook = c.lifecycle.pre_stop if c.name == ENGINE_CONTAINER and c.lifecycle else None
        if hook is not None and hook._exec is not None:
            return list(hook._exec.command or [])
    return None


def _downward_env(pod: Any, ip: str) -> dict[str, str]:
    """The engine container's env that the kubelet fills from the pod's IP (the
    downward API's ``status.podIP``, e.g. SPILLWAY_POD_IP, which the KV-event
    publisher binds)."""
    out: dict[str, str] = {}
    for c in pod.spec.containers or []:
        if c.name != ENGINE_CONTAINER:
            continue
        for e in c.env or []:
            ref = e.value_from.field_ref if e.value_from else None
            if ref is not None and ref.field_path == "status.podIP":
                out[e.name] = ip
    return out


def _with_value(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (or the flag added)."""
    out = list(args)
    if flag in out[:-1]:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


@dataclass
class SimulatorFleet:
    api: client.ApiClient
    namespace: str
    name: str
    sim_args: list[str] = field(default_factory=list)
    load_seconds: float = 0.0
    engine: str = "simulator"  # or "emulated"
    # emulated: model name (as the spec names it) -> local model directory
    model_dirs: dict[str, Path] = field(default_factory=dict)
    # emulated: more ``spillway-engine serve`` flags (e.g. --emulate-speed 0)
    serve_args: list[str] = field(default_factory=list)
    # tests: what the kubelet mounts instead of the ConfigMap's plan (a wrong plan)
    plan_edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    poll_seconds: float = 0.5
    # emulated: stop a gone pod's engine as the kubelet does, its preStop command first
    # (run with --host the pod IP, the engine's loopback address here), then SIGTERM
    run_prestop: bool = False
    sims: dict[str, _Sim] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)  # pods whose simulator we stopped on purpose

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self._dir = Path(tempfile.mkdtemp(prefix=f"simfleet-{self.name}-"))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping: list[threading.Thread] = []

    @property
    def gated(self) -> bool:
        return self.namespace.startswith("gated-")

    def urls(self) -> list[str]:
        """Base URLs of the simulators that are up and accepting connections."""
        with self._lock:
            sims = [s for s in self.sims.values() if s.proc.poll() is None]
        up = []
        for s in sims:
            with contextlib.suppress(OSError), socket.create_connection((s.ip, ENGINE_PORT), 0.5):
                up.append(f"http://{s.ip}:{ENGINE_PORT}")
        return up

    def _plan_file(self, pod: Any = None) -> Path | None:
        """The pod's plan, mounted as the ConfigMap mounts it: plan.json with
        engine.json beside it (its model pointed at the local directory). The
        ConfigMap is the one the pod's plan volume names (a GPU pool's own)."""
        volumes = (pod.spec.volumes or []) if pod is not None else []
        name = next((v.config_map.name for v in volumes
                     if v.name == "plan" and v.config_map is not None), f"{self.name}-plan")
        try:
            cm = self.core.read_namespaced_config_map(name, self.namespace)
        except client.ApiException:
            return None
        folder = self._dir / f"plan-{cm.metadata.resource_version}"
        path = folder / "plan.json"
        if not path.exists():
            folder.mkdir(exist_ok=True)
            options = json.loads(cm.data.get("engine.json") or "{}")
            if options.get("model") in self.model_dirs:
                options["model"] = str(self.model_dirs[options["model"]])
            (folder / "engine.json").write_text(json.dumps(options))
            plan = cm.data["plan.json"]
            if self.plan_edit is not None:
                plan = json.dumps(self.plan_edit(json.loads(plan)))
            path.write_text(plan)
        return path

    def _start(self, pod_name: str, ip: str, plan: Path, pod_args: list[str],
               pod_env: dict[str, str] | None = None) -> _Sim:
        log = self._dir / f"{pod_name}.log"
        if self.engine == "emulated":
            termination = self._dir / f"{pod_name}.termination-log"
            termination.unlink(missing_ok=True)
            entry = [str(_SERVE)] if _SERVE.exists() else [
                sys.executable, "-m", "spillway_engine.cli"]
            # The container's own arguments, with the plan where this "kubelet" mounted
            # it and the pod's IP to bind; a pod rendered for a real GPU gets one emulated.
            args = _with_value(pod_args, "--plan", str(plan))
            if "--emulate-gpu" not in args:
                args.append("--emulate-gpu")
            cmd = [*entry, "serve", *args, "--host", ip, *self.serve_args]
            env = {**os.environ, "SPILLWAY_TERMINATION_LOG": str(termination),
                   "SPILLWAY_SHARED_REGION": "1", "SPILLWAY_SHM_DIR": str(self._shm(pod_name)),
                   "VLLM_LOGGING_LEVEL": "INFO", "HF_HUB_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false", **(pod_env or {})}
            env.pop("VLLM_TARGET_DEVICE", None)
            proc = subprocess.Popen(cmd, stdout=open(log, "wb"),  # noqa: SIM115
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            return _Sim(proc, ip, time.monotonic(), log, termination)
        proc = subprocess.Popen(
            [sys.executable, "-m", "spillway_engine.simulator", "--plan", str(plan),
             "--host", ip, "--port", str(ENGINE_PORT), *self.sim_args],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )
        return _Sim(proc, ip, time.monotonic(), log)

    def _shm(self, pod_name: str) -> Path:
        """The pod's own shm folder (its memory-backed emptyDir)."""
        folder = self._dir / f"{pod_name}.shm"
        folder.mkdir(exist_ok=True)
        return folder

    def _ready(self, sim: _Sim) -> bool:
        if self.engine != "emulated":
            return time.monotonic() - sim.started >= self.load_seconds
        try:
            with urllib.request.urlopen(f"http://{sim.ip}:{ENGINE_PORT}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _record_exit(self, pod_name: str, sim: _Sim) -> None:
        """What the kubelet writes when the container exits non-zero."""
        message = ""
        if sim.termination is not None:
            with contextlib.suppress(OSError):
                message = sim.termination.read_text(errors="replace")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        terminated = {"exitCode": sim.proc.returncode, "reason": "Error",
                      "finishedAt": now, "message": message}
        self.core.patch_namespaced_pod_status(pod_name, self.namespace, {"status": {
            "containerStatuses": [{
                "name": ENGINE_CONTAINER, "image": "spillway-engine", "imageID": "",
                "ready": False, "started": False, "restartCount": 1,
                "state": {"waiting": {"reason": "CrashLoopBackOff",
                                      "message": "back-off restarting failed container"}},
                "lastState": {"terminated": terminated},
            }]}})
        sim.exit_recorded = True

    def sync(self) -> None:
        selector = f"spillway.dev/inference-deployment={self.name}"
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        alive = {p.metadata.name: p for p in pods if not p.metadata.deletion_timestamp}
        with self._lock:
            for pod_name in list(self.sims):
                if pod_name not in alive:
                    sim = self.sims.pop(pod_name)
                    if self.run_prestop and sim.prestop and self.engine == "emulated":
                        stopping = threading.Thread(target=self._stop_pod, args=(sim,))
                        self._stopping.append(stopping)
                        stopping.start()
                    else:
                        self._kill(sim)
            for pod_name, pod in alive.items():
                ip = pod.status.pod_ip
                if not ip or pod_name in self.sims or pod_name in self.paused:
                    continue
                plan = self._plan_file(pod)
                if plan is None:
                    continue
                self.sims[pod_name] = self._start(pod_name, ip, plan, _engine_args(pod),
                                                  _downward_env(pod, ip))
                self.sims[pod_name].prestop = _prestop(pod)
            for pod_name, sim in self.sims.items():
                pod = alive.get(pod_name)
                if pod is None:
                    continue
                if sim.proc.poll() not in (None, 0) and not sim.exit_recorded:
                    self._record_exit(pod_name, sim)
                    continue
                annotations = pod.metadata.annotations or {}
                if (self.gated and annotations.get(READY_ANNOTATION) != "true"
                        and sim.proc.poll() is None and self._ready(sim)):
                    self.core.patch_namespaced_pod(pod_name, self.namespace, {
                        "metadata": {"annotations": {READY_ANNOTATION: "true"}}})

    def pause(self, pod_name: str) -> None:
        """Stop one pod's simulator (its metrics go unreachable) and keep it stopped."""
        with self._lock:
            self.paused.add(pod_name)
            sim = self.sims.pop(pod_name, None)
            if sim:
                self._kill(sim)

    def resume_all(self) -> None:
        with self._lock:
            self.paused.clear()

    def log_text(self, pod_name: str) -> str:
        with contextlib.suppress(OSError):
            return (self._dir / f"{pod_name}.log").read_text(errors="replace")
        return ""

    def _stop_pod(self, sim: _Sim) -> None:
        """The kubelet's stop: the preStop command to its end, then SIGTERM."""
        entry = [str(_SERVE)] if _SERVE.exists() else [
            sys.executable, "-m", "spillway_engine.cli"]
        command = list(sim.prestop or [])
        if command and command[0] == "spillway-engine":
            command = [*entry, *command[1:]]
        with open(sim.log.with_suffix(".prestop.log"), "wb") as out:
            subprocess.run([*command, "--host", sim.ip], stdout=out, stderr=subprocess.STDOUT,
                           check=False)
        self._kill(sim)

    def _kill(self, sim: _Sim) -> None:
        if self.engine == "emulated":  # the engine core is a child: the whole group
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(sim.proc.pid, sig)
                try:
                    sim.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(sim.proc.pid, signal.SIGKILL)
                return
            return
        processes.stop(sim.proc, 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.sync()
            self._stop.wait(self.poll_seconds)

    def __enter__(self) -> SimulatorFleet:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)
        for stopping in self._stopping:
            stopping.join(300)
        with self._lock:
            for sim in self.sims.values():
                self._kill(sim)
            self.sims.clear()
