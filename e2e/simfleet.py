"""Engine simulators standing in for the containers of an InferenceDeployment's pods.

On the local control plane pods have loopback IPs and no containers. The fleet
watches the pods of one InferenceDeployment and, for each pod with an IP, starts
``spillway-engine simulate`` bound to that IP on the engine port with the pod's
plan (read from the ``<name>-plan`` ConfigMap), and stops it when the pod goes.

In namespaces named ``gated-*`` KWOK keeps pods unready until the harness says
so; there the fleet plays a model load: it marks the pod ready
(``spillway.dev/harness-ready=true``) ``load_seconds`` after its simulator started.
Used by the integration tests and the local demo.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client

ENGINE_PORT = 8000
READY_ANNOTATION = "spillway.dev/harness-ready"


@dataclass
class _Sim:
    proc: subprocess.Popen
    ip: str
    started: float
    log: Path


@dataclass
class SimulatorFleet:
    api: client.ApiClient
    namespace: str
    name: str
    sim_args: list[str] = field(default_factory=list)
    load_seconds: float = 0.0
    poll_seconds: float = 0.5
    sims: dict[str, _Sim] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)  # pods whose simulator we stopped on purpose

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self._dir = Path(tempfile.mkdtemp(prefix=f"simfleet-{self.name}-"))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

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

    def _plan_file(self) -> Path | None:
        try:
            cm = self.core.read_namespaced_config_map(f"{self.name}-plan", self.namespace)
        except client.ApiException:
            return None
        path = self._dir / f"plan-{cm.metadata.resource_version}.json"
        if not path.exists():
            path.write_text(cm.data["plan.json"])
        return path

    def sync(self) -> None:
        selector = f"spillway.dev/inference-deployment={self.name}"
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        alive = {p.metadata.name: p for p in pods if not p.metadata.deletion_timestamp}
        with self._lock:
            for pod_name in list(self.sims):
                if pod_name not in alive:
                    self._kill(self.sims.pop(pod_name))
            for pod_name, pod in alive.items():
                ip = pod.status.pod_ip
                if not ip or pod_name in self.sims or pod_name in self.paused:
                    continue
                plan = self._plan_file()
                if plan is None:
                    continue
                log = self._dir / f"{pod_name}.log"
                proc = subprocess.Popen(
                    [sys.executable, "-m", "spillway_engine.simulator", "--plan", str(plan),
                     "--host", ip, "--port", str(ENGINE_PORT), *self.sim_args],
                    stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                )
                self.sims[pod_name] = _Sim(proc, ip, time.monotonic(), log)
            if self.gated:
                for pod_name, sim in self.sims.items():
                    pod = alive.get(pod_name)
                    annotations = (pod.metadata.annotations or {}) if pod else {}
                    if (pod and annotations.get(READY_ANNOTATION) != "true"
                            and time.monotonic() - sim.started >= self.load_seconds):
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

    @staticmethod
    def _kill(sim: _Sim) -> None:
        sim.proc.terminate()
        try:
            sim.proc.wait(5)
        except subprocess.TimeoutExpired:
            sim.proc.kill()
            sim.proc.wait(5)

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
        with self._lock:
            for sim in self.sims.values():
                self._kill(sim)
            self.sims.clear()
