"""The operator as a local process against a cluster: shared by the integration
tests, the operator benchmark and the demo."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster.controlplane import REPO_ROOT, ClusterError, free_port


@dataclass
class OperatorProcess:
    proc: subprocess.Popen
    log: Path
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the operator's /metrics samples named ``name`` with these labels."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            text = resp.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def leader(self) -> bool:
        """Whether this process says (spillway_operator_leader) it holds the Lease."""
        return self.metric("spillway_operator_leader") == 1

    def stop(self, timeout: float = 20) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)


def start_operator(kubeconfig: Path, log: Path, *, verbose: bool = False,
                   env: dict[str, str] | None = None, timeout: float = 60,
                   scope: list[str] | None = None,
                   extra_args: list[str] | None = None) -> OperatorProcess:
    """``python -m spillway_operator --all-namespaces`` (or ``scope``, e.g. ``-n NS``) with
    ``extra_args`` and its log in ``log``; returns once it has started (a leader-election
    candidate: once it stands for election), or raises ClusterError with its log's tail."""
    port = free_port()
    args = [sys.executable, "-m", "spillway_operator", *(scope or ["--all-namespaces"]),
            "--liveness", "", "--metrics-port", str(port), *(extra_args or [])]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*args, "--verbose"] if verbose else args,
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                 **(env or {})},
        )
    op = OperatorProcess(proc, log, f"http://127.0.0.1:{port}/metrics")
    deadline = time.monotonic() + timeout
    while "spillway operator started" not in op.log_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            op.stop()
            raise ClusterError(f"the operator did not start; last log lines:\n"
                               f"{op.log_text()[-3000:]}")
        time.sleep(0.2)
    return op
