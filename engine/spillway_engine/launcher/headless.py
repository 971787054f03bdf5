"""A headless rank's probes: the pod of a multi-node worker (node rank > 0).

vLLM's ``--headless`` ranks run GPU workers (or, under data parallelism, engine cores)
and no API server, so nothing would answer the pod's probes on ``--port``. On such a
rank ``spillway-engine serve`` does not exec vLLM: it starts it as a child and answers
the probes itself, from its child's life:

* ``GET /health`` and ``GET`` :data:`~spillway_engine.seam.READY_PATH`: 200 while the
  vLLM process runs (``READY_PATH`` 503 once a drain began), 503 once it has exited;
* ``POST`` :data:`~spillway_engine.seam.DRAIN_PATH` (the preStop's
  ``spillway-engine drain``, loopback only): answered at once -- a worker holds no
  requests, the leader drains the group's -- so the preStop never hangs;
  ``GET`` the same path: the state.

SIGTERM and SIGINT are passed to vLLM, and the launcher exits with vLLM's status, as
if it had been exec'd.
"""

from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from spillway_engine.seam import DRAIN_PATH, READY_PATH

HEALTH_PATHS = frozenset({"/health", "/ping"})


class RankState:
    """What the probes report: whether vLLM runs, whether a drain began."""

    def __init__(self, alive: Any) -> None:
        self._alive = alive
        self.draining = False

    @property
    def alive(self) -> bool:
        return bool(self._alive())

    def view(self) -> dict[str, Any]:
        return {"headless": True, "alive": self.alive, "draining": self.draining,
                "in_flight": 0, "refused": 0}


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_handler(state: RankState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "spillway-headless"

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in HEALTH_PATHS:
                self._answer(200 if state.alive else 503, state.view())
            elif path == READY_PATH:
                ready = state.alive and not state.draining
                self._answer(200 if ready else 503, {"ready": ready, **state.view()})
            elif path == DRAIN_PATH:
                self._answer(200, state.view())
            else:
                self._answer(404, {"error": f"{path}: a headless rank serves no API "
                                   "(the group's leader does)"})

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path != DRAIN_PATH:
                self._answer(404, {"error": f"{path}: a headless rank serves no API"})
                return
            if not _loopback(self.client_address[0]):
                self._answer(403, {"error": "drain is accepted from loopback only"})
                return
            state.draining = True  # nothing in flight here: drained at once
            self._answer(200, {**state.view(), "drained": True})

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the kubelet probes every few seconds: keep the log vLLM's

    return Handler


def probe_server(host: str, port: int, state: RankState) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(state))
    server.daemon_threads = True
    return server


def _restore(saved: dict[int, Any]) -> None:
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def run_headless(argv: Sequence[str], env: dict[str, str], host: str, port: int) -> int:
    """Run vLLM (``argv``) as a child and answer the probes on ``host:port`` while it
    runs; vLLM's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    child = subprocess.Popen(list(argv), env=env)
    state = RankState(lambda: child.poll() is None)

    def forward(signum: int, frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    saved = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = probe_server(host, port, state)
    except OSError as e:
        child.terminate()
        child.wait()
        _restore(saved)
        raise OSError(f"cannot answer the probes on {host}:{port}: {e.strerror or e}") from e
    thread = threading.Thread(target=server.serve_forever, name="probes", daemon=True)
    thread.start()
    print(f"spillway-engine: headless rank: vLLM pid {child.pid}; probes on {host}:{port}",
          file=sys.stderr, flush=True)
    try:
        rc = child.wait()
    finally:
        server.shutdown()
        server.server_close()
        _restore(saved)
    return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's status
