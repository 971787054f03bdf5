"""The autoscaler's scrape against real HTTP servers on loopback that misbehave:
slow, huge, lying about their size, not UTF-8, compressed, failing. One bad pod is
that pod's problem: it is counted and named, the others are still measured, and
the event loop keeps answering."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillway_operator.flow import scaler
from spillway_operator.flow.pressure import MetricsError
from spillway_operator.flow.scaler import MAX_METRICS_BYTES, Autoscaler
from spillway_operator.flow.spec import InferenceDeploymentSpec

GOOD = b"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc 0.5
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 2
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total 100
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total 0
"""
HUGE = b"vllm:num_requests_running 1\n" * (40 * 2**20 // 28)  # 40 MB of valid text


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        mode = self.server.mode  # type: ignore[attr-defined]
        self.server.hits += 1  # type: ignore[attr-defined]
        body = {"good": GOOD, "latin1": GOOD + "é".encode("latin-1"), "huge": HUGE,
                "bytes": self.server.body}.get(mode, GOOD)  # type: ignore[attr-defined]
        if mode == "500":
            self.send_response(500)
            self.end_headers()
            return
        self.send_response(200)
        if mode == "gzip":
            body = gzip.compress(HUGE)
            self.send_header("Content-Encoding", "gzip")
        if mode == "liar":  # announces more than the cap: refused before reading
            self.send_header("Content-Length", str(MAX_METRICS_BYTES + 1))
        elif mode != "chunked-huge":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            if mode == "slow":
                for line in GOOD.splitlines(keepends=True):
                    self.wfile.write(line)
                    self.wfile.flush()
                    time.sleep(1.0)
            elif mode == "chunked-huge":
                for _ in range(64):
                    self.wfile.write(b"x" * 2**20)
            elif mode == "cut":
                self.wfile.write(body[:20])
            else:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def servers():
    """Two 'pods' on 127.0.0.1 and 127.0.0.2, same port, each with a settable mode."""
    first = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = first.server_address[1]
    second = ThreadingHTTPServer(("127.0.0.2", port), Handler)
    pods = [first, second]
    for s in pods:
        s.mode, s.hits, s.body = "good", 0, b""
        s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield port, pods
    for s in pods:
        s.shutdown()
        s.server_close()


def pod(name: str, ip: str) -> dict:
    return {"metadata": {"name": name}, "status": {"podIP": ip}}


async def _scrape_one(port: int, ip: str = "127.0.0.1"):
    a = Autoscaler(kube=None, port=port)
    try:
        scrape = await a._scrape("p", ip)
        try:
            return await a._parse(scrape, time.monotonic())
        except MetricsError as exc:
            return exc
    finally:
        await a.stop()


@pytest.mark.parametrize(("mode", "reason"), [
    ("latin1", "not_utf8"), ("huge", "too_large"), ("liar", "too_large"),
    ("chunked-huge", "too_large"), ("gzip", "not_utf8"), ("500", "http"), ("slow", "timeout"),
    ("cut", "unreachable"),
])
def test_a_bad_body_is_a_named_metrics_error(servers, mode, reason):
    port, pods = servers
    pods[0].mode = mode
    started = time.monotonic()
    got = asyncio.run(_scrape_one(port))
    assert isinstance(got, MetricsError), got
    assert got.reason == reason, (got.reason, str(got))
    assert time.monotonic() - started < scaler.SCRAPE_TIMEOUT + 2


def test_no_pod_answering_is_unreachable():
    got = asyncio.run(_scrape_one(1, "127.0.0.1"))
    assert isinstance(got, MetricsError) and got.reason == "unreachable"


def test_one_bad_pod_leaves_the_others_measured_and_the_loop_free(servers):
    """The issue's two pods: one not UTF-8 (the whole tick used to fail), one 40 MB
    (its parse used to hold the event loop for half a minute)."""
    port, pods = servers
    spec = InferenceDeploymentSpec(model={"name": "a/b"})

    async def run(bad_mode: str):
        pods[1].mode = bad_mode
        a = Autoscaler(kube=None, port=port)
        lags: list[float] = []

        async def heartbeat():  # what kopf's liveness endpoint needs: a free loop
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.05)
                lags.append(time.monotonic() - t - 0.05)

        beat = asyncio.create_task(heartbeat())
        try:
            ready = [pod("good", "127.0.0.1"), pod("bad", "127.0.0.2")]
            await a._measure(("ns", "x"), ready, spec, time.monotonic())
            await asyncio.sleep(0.2)
            agg = await a._measure(("ns", "x"), ready, spec, time.monotonic())
        finally:
            beat.cancel()
            await a.stop()
        return agg, a.objects[("ns", "x")].problems, max(lags)

    for bad_mode, needle in (("latin1", "not UTF-8"), ("huge", "body over")):
        agg, problems, lag = asyncio.run(run(bad_mode))
        assert agg.measured == 1 and agg.pressure is not None, bad_mode
        assert len(problems) == 1 and problems[0].startswith("bad: ") and needle in problems[0]
        assert lag < 0.5, f"event loop held for {lag:.2f}s with a {bad_mode} pod"


@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=2000), st.text(max_size=500).map(str.encode),
                 st.integers(MAX_METRICS_BYTES - 2, MAX_METRICS_BYTES + 2).map(
                     lambda n: b"#" * n)))
def test_scraping_any_body_never_raises(servers, body):
    port, pods = servers
    pods[0].mode, pods[0].body = "bytes", body
    got = asyncio.run(_scrape_one(port))
    if len(body) > MAX_METRICS_BYTES:
        assert isinstance(got, MetricsError) and got.reason == "too_large"
    assert not isinstance(got, BaseException) or isinstance(got, MetricsError)


def _pod(created, ready_at, restarts=0, ready="True"):
    return {"metadata": {"name": "p", "creationTimestamp": created},
            "status": {"conditions": [{"type": "Ready", "status": ready,
                                       "lastTransitionTime": ready_at}],
                       "containerStatuses": [{"name": "engine", "restartCount": restarts}]}}


def test_a_pods_start_up_is_read_from_its_own_status_unless_it_restarted():
    t0, t1 = "2026-12-03T10:00:00Z", "2026-12-03T10:02:10Z"
    assert scaler._started(_pod(t0, t1)) == (t0, t1)
    assert scaler._started(_pod(t0, t1, restarts=1)) == (None, None)  # last start's time
    assert scaler._started(_pod(t0, t1, ready="False"))[1] is None
    assert scaler.startup_seconds([scaler._started(_pod(t0, t1))]) == 130.0
